"""Data: corpus, tokenizers, memory-mapped token files and the deterministic, resumable sampler.

The names below are imported on first use, so ``threefold data prepare`` does not pay for torch,
which only the sampler needs.
"""
import importlib

_EXPORTS = {
    "BatchSampler": "threefold.data.sampler",
    "val_batches": "threefold.data.sampler",
    "Tokenizer": "threefold.data.tokenizer",
    "Dataset": "threefold.data.tokens",
    "prepare_dataset": "threefold.data.tokens",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
