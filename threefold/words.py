"""Words for messages: a count and its noun, agreed ("1 GPU", "8 GPUs").

A leaf that imports nothing, so every layer may use it (config.py, itself a leaf, spells its
plurals inline).
"""


def plural(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, the noun plural unless the count is 1: ``plural(1, "GPU")`` is
    "1 GPU", ``plural(1024, "GPU")`` "1,024 GPUs" (thousands separated, as the messages write
    large counts). ``plural`` gives an irregular plural; see ``plural_of`` for the regular ones."""
    return f"{count:,} {agree(count, noun, plural)}"


def agree(count: int, noun: str, plural: str | None = None) -> str:
    """``noun`` in the number ``count`` asks for, without the count: "rank" for 1, else "ranks"
    (for a list that follows the noun: "ranks 2, 3 did not …")."""
    return noun if count == 1 else plural or plural_of(noun)


def plural_of(noun: str) -> str:
    """The regular English plural of ``noun`` (its last word): "GPU" → "GPUs", "process" →
    "processes", "micro-batch" → "micro-batches", "entry" → "entries"."""
    if noun.endswith(("s", "x", "z", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"
