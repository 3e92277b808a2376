"""Token files: the corpus encoded once into memory-mapped arrays, split into train and validation.

Layout of the cache (``data.cache_dir``)::

    <corpus>-<fingerprint>-v<FORMAT_VERSION>/   one folder per version of the corpus and of this code
        tokenizer-bpe4096.json               the trained BPE (gpt2 needs no file)
        bpe4096-val0.05.train.bin            uint16 (uint32 when the vocabulary needs it)
        bpe4096-val0.05.val.bin
        bpe4096-val0.05.json                 metadata; written last, so its presence means complete
        .lock                                serializes processes that prepare at the same time

The split is taken per document: the tail of every document goes to validation, sized so that
validation holds ``val_fraction`` of all tokens so far. Validation then covers every document in
the proportion training does, and the two never overlap.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from threefold.config import ConfigError, DataConfig
from threefold.data.corpus import Corpus, find_corpus
from threefold.data.tokenizer import Tokenizer, gpt2_tokenizer, load_tokenizer, save_tokenizer, train_bpe
from threefold.words import plural

FORMAT_VERSION = 1  # bump when the text cleaning, tokenizer training or file layout changes
# Documents are encoded in groups of about GROUP_CHARS characters (the unit of progress), each cut
# into pieces of about PIECE_CHARS at line ends, which tokenizers encodes in parallel.
GROUP_CHARS = 1 << 20
PIECE_CHARS = 1 << 17


@dataclass
class Dataset:
    tokenizer: Tokenizer
    train_tokens: np.memmap
    val_tokens: np.memmap
    meta: dict
    cached: bool = False  # True when the token files were already in the cache


def prepare_dataset(data_cfg: DataConfig, seq_len: int, progress: bool = True) -> Dataset:
    """Tokenize the corpus into the cache (once), then open the token files memory-mapped.

    Safe to call from several processes at once: the first to take the folder's lock builds,
    the others wait and then read what it wrote.
    """
    data_cfg.validate()
    corpus = find_corpus(data_cfg.corpus, data_cfg.allow_binary)
    folder = Path(data_cfg.cache_dir) / f"{corpus.name}-{corpus.fingerprint()}-v{FORMAT_VERSION}"
    key = _tokenizer_key(data_cfg)
    stem = f"{key}-val{data_cfg.val_fraction:g}"
    meta_path = folder / f"{stem}.json"
    with _locked(folder):
        tokenizer = _tokenizer(data_cfg, corpus, folder / f"tokenizer-{key}.json", progress)
        cached = meta_path.exists()
        if not cached:
            _write_tokens(corpus, tokenizer, data_cfg, folder, stem, progress)
    meta = json.loads(meta_path.read_text())
    for split in ("train", "val"):
        if meta[f"{split}_tokens"] < seq_len + 1:
            raise ConfigError(
                f"data.corpus: {data_cfg.corpus!r} gives {plural(meta[f'{split}_tokens'], f'{split} token')}, fewer than one "
                f"sequence of model.seq_len + 1 = {seq_len + 1}; use a larger corpus or a smaller seq_len")
    dtype = np.dtype(meta["dtype"])
    return Dataset(
        tokenizer=tokenizer,
        train_tokens=np.memmap(folder / f"{stem}.train.bin", dtype=dtype, mode="r"),
        val_tokens=np.memmap(folder / f"{stem}.val.bin", dtype=dtype, mode="r"),
        meta=meta,
        cached=cached,
    )


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def unigram_entropy(counts: np.ndarray) -> float:
    """Entropy in nats per token of the token frequencies: the loss of a model that ignores context."""
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _tokenizer_key(data_cfg: DataConfig) -> str:
    if data_cfg.tokenizer == "bpe":
        return f"bpe{data_cfg.vocab_size}"
    if data_cfg.tokenizer == "gpt2":
        return "gpt2"
    # A tokenizer.json file (a pretrained model's own): keyed by its content.
    return "file-" + hashlib.sha256(Path(data_cfg.tokenizer).read_bytes()).hexdigest()[:16]


def _tokenizer(data_cfg: DataConfig, corpus: Corpus, path: Path, progress: bool) -> Tokenizer:
    if data_cfg.tokenizer == "gpt2":
        return gpt2_tokenizer()
    if data_cfg.tokenizer != "bpe":
        return load_tokenizer(Path(data_cfg.tokenizer), Path(data_cfg.tokenizer).stem)
    if path.exists():
        return load_tokenizer(path, path.stem.removeprefix("tokenizer-"))
    with _progress(progress) as bar:
        bar.add_task(f"training BPE ({data_cfg.vocab_size} tokens)", total=None)
        tokenizer = train_bpe(corpus.documents(), data_cfg.vocab_size, length=len(corpus.files))
    save_tokenizer(tokenizer, path)
    return tokenizer


def _write_tokens(corpus: Corpus, tokenizer: Tokenizer, data_cfg: DataConfig, folder: Path, stem: str,
                  progress: bool) -> None:
    started = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    documents = characters = written_train = written_val = 0
    suffix = f".{os.getpid()}.tmp"
    paths = {split: folder / f"{stem}.{split}.bin" for split in ("train", "val")}
    with open(paths["train"].with_name(paths["train"].name + suffix), "wb") as train_file, \
            open(paths["val"].with_name(paths["val"].name + suffix), "wb") as val_file, \
            _progress(progress, transfer=True) as bar:
        task = bar.add_task(f"encoding with {tokenizer.name}", total=corpus.total_bytes())
        file_sizes = (path.stat().st_size for path in corpus.files)  # documents come in file order
        for texts, ids in _encode_groups(corpus.documents(), tokenizer):
            for text, doc_ids in zip(texts, ids):
                doc = np.asarray(doc_ids + [tokenizer.eos_id], dtype=dtype)
                # this document's tail brings validation to val_fraction of all tokens so far
                total = written_train + written_val + len(doc)
                cut = len(doc) - min(len(doc), round(data_cfg.val_fraction * total) - written_val)
                train_file.write(doc[:cut].tobytes())
                val_file.write(doc[cut:].tobytes())
                counts += np.bincount(doc[:cut], minlength=tokenizer.vocab_size)
                written_train += cut
                written_val += len(doc) - cut
                documents += 1
                characters += len(text)
                bar.advance(task, next(file_sizes))
    for path in paths.values():
        os.replace(path.with_name(path.name + suffix), path)
    meta = {
        "format_version": FORMAT_VERSION,
        "corpus": data_cfg.corpus,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": dtype.name,
        "val_fraction": data_cfg.val_fraction,
        "documents": documents,
        "characters": characters,
        "train_tokens": written_train,
        "val_tokens": written_val,
        "unigram_entropy": unigram_entropy(counts),
        "encode_seconds": round(time.perf_counter() - started, 3),
    }
    meta_path = folder / f"{stem}.json"
    temporary = meta_path.with_name(meta_path.name + suffix)
    temporary.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temporary, meta_path)


def _encode_groups(documents: Iterator[str], tokenizer: Tokenizer) -> Iterator[tuple[list[str], list[list[int]]]]:
    """Yields (texts, ids) for groups of whole documents; long documents are encoded in pieces."""
    group: list[str] = []
    group_chars = 0
    for text in documents:
        group.append(text)
        group_chars += len(text)
        if group_chars >= GROUP_CHARS:
            yield group, _encode_documents(group, tokenizer)
            group, group_chars = [], 0
    if group:
        yield group, _encode_documents(group, tokenizer)


def _encode_documents(texts: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    pieces, owners = [], []
    for index, text in enumerate(texts):
        for piece in _pieces(text):
            pieces.append(piece)
            owners.append(index)
    ids: list[list[int]] = [[] for _ in texts]
    for owner, piece_ids in zip(owners, tokenizer.encode_batch(pieces)):
        ids[owner].extend(piece_ids)
    return ids


def _pieces(text: str) -> Iterator[str]:
    """Cuts text into pieces of about PIECE_CHARS, each cut just before a space or line end that
    follows a non-space. GPT-2's pre-tokenizer splits there too (no pre-token runs from a
    non-space into whitespace), so the pieces encode to exactly the tokens of the whole text."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        cut = start + PIECE_CHARS
        while cut > start and not (text[cut] in " \n" and not text[cut - 1].isspace()):
            cut -= 1
        cut = cut if cut > start else start + PIECE_CHARS  # no clean cut in a whole piece: cut anyway
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


@contextmanager
def _locked(folder: Path):
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / ".lock", "w")
    except OSError as err:
        raise ConfigError(f"data.cache_dir: cannot write {folder} ({err.strerror})") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _progress(enabled: bool, transfer: bool = False) -> Progress:
    columns = [TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    if transfer:
        columns.insert(2, TransferSpeedColumn())
    return Progress(*columns, disable=not enabled, transient=True)
