"""Data: corpus, tokenizers, memory-mapped token files and the deterministic, resumable sampler."""
from threefold.data.sampler import BatchSampler, val_batches
from threefold.data.tokenizer import Tokenizer
from threefold.data.tokens import Dataset, prepare_dataset

__all__ = ["BatchSampler", "Dataset", "Tokenizer", "prepare_dataset", "val_batches"]
