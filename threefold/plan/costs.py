"""The planner's cost model: FLOPs, memory, communication and step time of a parallel layout.

Every formula is plain arithmetic (with ``np.where`` / ``np.minimum`` for the branches), so the
same function evaluates one layout given scalars or thousands of layouts given numpy arrays;
the search relies on that. Sources and derivations are in docs/planner.md.
"""
from __future__ import annotations

import numpy as np

from threefold.config import ConfigError, ModelConfig


def _scalar_or_array(value):
    """A 0-d numpy result becomes a Python float; arrays stay arrays."""
    return float(value) if np.ndim(value) == 0 else value


# --------------------------------------------------------------------------------------------
# Parameters and FLOPs
# --------------------------------------------------------------------------------------------

def _require_vocab(cfg: ModelConfig) -> int:
    if cfg.vocab_size is None:
        raise ConfigError("model.vocab_size: the planner needs a vocabulary size (--vocab)")
    return cfg.vocab_size


def attention_width(cfg: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width): heads·head_dim and kv_heads·head_dim."""
    return cfg.heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim


def block_param_count(cfg: ModelConfig) -> int:
    """Parameters of one transformer block, norms and biases included."""
    h, f = cfg.hidden, cfg.ffn_hidden
    q, kv = attention_width(cfg)
    attn = h * q * 2 + h * kv * 2  # wq, wo; wk, wv
    if cfg.arch == "llama":
        return attn + 3 * h * f + 2 * h  # SwiGLU's three matrices; two RMSNorm weights
    # GPT: biases on every linear, two LayerNorms with weight and bias.
    return attn + (q + 2 * kv + h) + 2 * h * f + (f + h) + 4 * h


def embedding_param_count(cfg: ModelConfig) -> int:
    """Parameters of the input embedding lookup tables (tokens, and learned positions for GPT)."""
    v = _require_vocab(cfg)
    positions = cfg.seq_len * cfg.hidden if cfg.arch == "gpt" else 0
    return v * cfg.hidden + positions


def param_count(cfg: ModelConfig) -> int:
    """Exact number of distinct parameters (tied embeddings counted once)."""
    if cfg.arch == "llama":
        _require_vocab(cfg)
        from threefold.models.llama import count_parameters  # the model's own count; imports torch

        return count_parameters(cfg)
    h, v = cfg.hidden, _require_vocab(cfg)
    head = 0 if cfg.tie_embeddings else v * h
    final_norm = 2 * h  # LayerNorm weight and bias
    return cfg.layers * block_param_count(cfg) + embedding_param_count(cfg) + head + final_norm


def matmul_param_count(cfg: ModelConfig) -> int:
    """Parameters that take part in a matrix multiply per token: all but the lookup tables.

    With tied embeddings the table is also the output head, so it stays counted once.
    """
    lookup_only = embedding_param_count(cfg) - (_require_vocab(cfg) * cfg.hidden if cfg.tie_embeddings else 0)
    return param_count(cfg) - lookup_only


def attention_flops_per_token(cfg: ModelConfig) -> float:
    """Forward FLOPs of the attention core (q·kᵀ and scores·v) per token, all layers.

    Counted over the full s×s square (no causal halving), as PaLM, Megatron and torchtitan do.
    """
    q, _ = attention_width(cfg)
    return 4.0 * cfg.layers * cfg.seq_len * q


def model_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token without recomputation: 6·N + 12·L·s·(heads·head_dim).

    N excludes the embedding lookup tables (a lookup does no arithmetic); the PaLM / torchtitan
    convention for MFU. For GPT-3 175B this equals Megatron's "72-formula" up to its biases.
    """
    return 6.0 * matmul_param_count(cfg) + 3.0 * attention_flops_per_token(cfg)


def hardware_flops_per_token(cfg: ModelConfig, recompute: str) -> float:
    """FLOPs the GPU actually executes per token, including the recomputed forward.

    full: every block's forward runs twice (the logits are not recomputed);
    selective: the attention core's forward runs twice (Korthikanti et al. 2022).
    """
    extra = {"none": 0.0,
             "selective": attention_flops_per_token(cfg),
             "full": 2.0 * cfg.layers * block_param_count(cfg) + attention_flops_per_token(cfg)}
    if recompute not in extra:
        raise ConfigError(f"--recompute: must be none, selective or full, got {recompute!r}")
    return model_flops_per_token(cfg) + extra[recompute]


# --------------------------------------------------------------------------------------------
# Model states and data-parallel traffic, exact, for the engine's own fp32 runs
# --------------------------------------------------------------------------------------------

def dp_bytes_per_step(numel, dp, zero, microbatches, grad_bytes: int = 4, param_bytes: int = 4):
    """Bytes each rank sends on the data-parallel axis per optimizer step (ring convention).

    ``numel`` is the number of parameter elements the dp group holds replicas of.
      zero 0:    one all-reduce of the accumulated gradients:       2(n−1)/n · numel · grad_bytes
      zero 1, 2: reduce-scatter of gradients + all-gather of the updated parameters:
                                                   (n−1)/n · numel · (grad_bytes + param_bytes)
      zero 3:    per micro-batch, all-gather of parameters for forward and again for backward,
                 and a reduce-scatter of gradients:  m · (n−1)/n · numel · (2·param_bytes + grad_bytes)
    With n = 1 every term is 0. Works elementwise on numpy arrays.
    """
    numel, dp, zero = np.asarray(numel, dtype=float), np.asarray(dp), np.asarray(zero)
    share = (dp - 1) / dp
    all_reduce = 2 * share * numel * grad_bytes
    sharded_optimizer = share * numel * (grad_bytes + param_bytes)
    fully_sharded = microbatches * share * numel * (2 * param_bytes + grad_bytes)
    return _scalar_or_array(np.where(zero == 0, all_reduce, np.where(zero == 3, fully_sharded, sharded_optimizer)))


def model_state_bytes(numel, dp, zero, param_bytes: int = 4, grad_bytes: int = 4, optimizer_bytes: int = 8) -> dict:
    """Bytes of parameters, gradients and optimizer states on one rank under ZeRO stage ``zero``.

    zero 0 keeps all three whole; 1 shards the optimizer states over the n data-parallel ranks;
    2 also the gradients; 3 also the parameters. ``optimizer_bytes`` is 8 for Adam's two fp32
    moments (12 with the fp32 master copy that 16-bit training keeps).
    """
    numel, dp, zero = np.asarray(numel, dtype=float), np.asarray(dp), np.asarray(zero)
    return {
        "params": _scalar_or_array(numel * param_bytes / np.where(zero >= 3, dp, 1)),
        "grads": _scalar_or_array(numel * grad_bytes / np.where(zero >= 2, dp, 1)),
        "optimizer": _scalar_or_array(numel * optimizer_bytes / np.where(zero >= 1, dp, 1)),
    }
