"""Sizes of the plain model that need no torch, so the planner starts fast: parameter counts of
the whole model, of one block, and of what one pipeline stage holds on one tensor-parallel rank
(the engine's shards: threefold/parallel/tensor_parallel.py)."""
from __future__ import annotations

from threefold.config import ModelConfig


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


def count_parameters(cfg: ModelConfig) -> int:
    """Exact number of distinct parameters of ``Llama(cfg)`` (tied embeddings counted once)."""
    h, v = cfg.hidden, cfg.vocab_size
    embeddings = v * h * (1 if cfg.tie_embeddings else 2)
    return cfg.layers * block_param_count(cfg) + embeddings + h


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary as the tp shards hold it: padded with zero rows to a multiple of tp."""
    return -(-vocab // tp) * tp


def tp_replicated_block_param_count(cfg: ModelConfig) -> int:
    """Parameters of one block that every tp rank holds whole: a Llama block's two RMSNorm
    weights; a GPT block's two LayerNorms (weight and bias) and its row-parallel products'
    biases (wo's and the second MLP matrix's, added after the all-reduce, as Megatron-LM does)."""
    return 2 * cfg.hidden if cfg.arch == "llama" else 6 * cfg.hidden


def tp_block_param_count(cfg: ModelConfig, tp):
    """Parameters of one block on one tp rank (``tp`` an int, or an array for the planner): the
    attention's and the MLP's matrices are split over tp (column-parallel wq, wk, wv, w_gate,
    w_up, and a GPT block's biases of them; row-parallel wo, w_down); the rest whole on every rank
    (``tp_replicated_block_param_count``)."""
    whole = tp_replicated_block_param_count(cfg)
    return (block_param_count(cfg) - whole) // tp + whole


def stage_param_count(cfg: ModelConfig, blocks: int, first: bool, last: bool, tp: int = 1, moe_blocks: int = 0,
                      shared_split: bool = False) -> int:
    """Parameters one tp rank of a Llama pipeline stage holds: its blocks, the embedding's rows
    on the first stage, the final norm and the head's rows on the last. With tied embeddings a
    stage that is both first and last holds the one table once; a last stage that is not the
    first holds its own copy of it (the engine keeps the two ends' gradients in step).
    ``moe_blocks`` of the ``blocks`` hold experts: those count ``tp_moe_block_param_count``, and
    their routed experts not at all (``rank_expert_param_count``: ZeRO shards them apart).
    ``shared_split``: the shared experts split over tp (experts folded over tp)."""
    h = cfg.hidden
    table = padded_vocab(cfg.vocab_size, tp) // tp * h
    numel = ((blocks - moe_blocks) * tp_block_param_count(cfg, tp)
             + moe_blocks * tp_moe_block_param_count(cfg, tp, shared_split))
    if first:
        numel += table
    if last:
        numel += h + (0 if cfg.tie_embeddings and first else table)
    return numel


# --- Mixture-of-Experts ------------------------------------------------------------------------


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether block ``layer`` has experts: after the first ``moe_first_dense`` layers, every
    ``moe_every``-th one (layer − first_dense ≡ 0 mod every), none when ``moe_experts`` is 0."""
    return (cfg.moe_experts > 0 and layer >= cfg.moe_first_dense
            and (layer - cfg.moe_first_dense) % cfg.moe_every == 0)


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many blocks ``is_moe_layer`` gives experts, counted without visiting each."""
    if cfg.moe_experts <= 0:
        return 0
    return -(-max(0, cfg.layers - cfg.moe_first_dense) // cfg.moe_every)


def moe_block_param_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(rest, router, routed experts): parameters of one MoE block. ``rest``: the attention, the
    two norms and the shared experts (the dense block with its SwiGLU swapped for the shared one,
    ``moe_shared_experts · moe_ffn`` wide); ``router``: E·h; routed experts: E SwiGLUs of
    ``moe_ffn``, 3·h·moe_ffn each (gate, up, down)."""
    h, expert = cfg.hidden, 3 * cfg.hidden * cfg.moe_ffn_hidden
    rest = block_param_count(cfg) - 3 * h * cfg.ffn_hidden + cfg.moe_shared_experts * expert
    return rest, cfg.moe_experts * h, cfg.moe_experts * expert


def tp_moe_block_param_count(cfg: ModelConfig, tp: int, shared_split: bool = False) -> int:
    """Parameters of one MoE block on one tp rank, its routed experts left out: the attention's
    matrices split over tp as in a dense block; the two norms, the router and the shared experts
    whole (an MoE block is replicated over tp: parallel/tensor_parallel.py's ReplicatedMoE), or
    with ``shared_split`` the shared experts split over tp as a dense MLP (experts folded over
    tp: tensor_parallel.FoldedMoE)."""
    h, shared = cfg.hidden, cfg.moe_shared_experts * 3 * cfg.hidden * cfg.moe_ffn_hidden
    attention = block_param_count(cfg) - 3 * h * cfg.ffn_hidden - 2 * h
    return attention // tp + 2 * h + cfg.moe_experts * h + (shared // tp if shared_split else shared)


def rank_expert_param_count(cfg: ModelConfig, ep: int) -> int:
    """Routed-expert parameters of one MoE block on one rank: E/ep whole experts (the same on
    every tp rank), 3·h·moe_ffn each."""
    return cfg.moe_experts // ep * 3 * cfg.hidden * cfg.moe_ffn_hidden


def moe_parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of ``Llama(cfg)``; active = what one token computes with: the
    router, its top-k routed experts and the shared experts in each MoE layer, everything else
    whole. Equal for a dense model. The experts' routing biases are buffers, not counted."""
    layers = moe_layer_count(cfg)
    if not layers:
        return (count_parameters(cfg),) * 2
    rest, router, experts = moe_block_param_counts(cfg)
    moe_minus_dense = rest + router - block_param_count(cfg)
    total = count_parameters(cfg) + layers * (moe_minus_dense + experts)
    active = count_parameters(cfg) + layers * (moe_minus_dense + experts * cfg.moe_top_k_experts // cfg.moe_experts)
    return total, active
