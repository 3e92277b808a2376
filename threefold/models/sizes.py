"""Sizes of the plain model that need no torch, so the planner starts fast."""
from __future__ import annotations

from threefold.config import ModelConfig


def count_parameters(cfg: ModelConfig) -> int:
    """Exact number of distinct parameters of ``Llama(cfg)`` (tied embeddings counted once)."""
    h, f, v, d = cfg.hidden, cfg.ffn_hidden, cfg.vocab_size, cfg.head_dim
    attn = h * cfg.heads * d * 2 + h * cfg.n_kv_heads * d * 2  # wq, wo; wk, wv
    mlp = 3 * h * f
    block = attn + mlp + 2 * h  # two RMSNorm weights
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return cfg.layers * block + embeddings + h
