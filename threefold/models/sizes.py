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


# --- Mixture-of-Experts ------------------------------------------------------------------------


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` has experts: after the first ``moe_first_dense`` layers, every
    ``moe_every``-th one (layer − first_dense ≡ 0 mod every), none when ``moe_experts`` is 0."""
    return (cfg.moe_experts > 0 and layer >= cfg.moe_first_dense
            and (layer - cfg.moe_first_dense) % cfg.moe_every == 0)


def moe_layer_count(cfg: ModelConfig) -> int:
    return sum(is_moe_layer(cfg, layer) for layer in range(cfg.layers))


def moe_parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of ``Llama(cfg)``; active = what one token computes with: the
    router, its top-k routed experts and the shared experts in each MoE layer, everything else
    whole. Equal for a dense model. The experts' routing biases are buffers, not counted."""
    h, dense_mlp = cfg.hidden, 3 * cfg.hidden * cfg.ffn_hidden
    expert = 3 * h * cfg.moe_ffn_hidden  # one SwiGLU expert: gate, up, down
    layers = moe_layer_count(cfg)
    router, shared = cfg.moe_experts * h, cfg.moe_shared_experts * expert
    total = count_parameters(cfg) + layers * (router + cfg.moe_experts * expert + shared - dense_mlp)
    active = count_parameters(cfg) + layers * (router + cfg.moe_top_k_experts * expert + shared - dense_mlp)
    return (total, active) if layers else (count_parameters(cfg),) * 2
