"""The planner's cost model: FLOPs, memory, communication and step time of a parallel layout.

Every formula is plain arithmetic (with ``np.where`` / ``np.minimum`` for the branches), so the
same function evaluates one layout given scalars or thousands of layouts given numpy arrays;
the search relies on that. Sources and derivations are in docs/planner.md.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from threefold.config import PARTIAL_IN_PLACE_NUMEL, ConfigError, ModelConfig
from threefold.models.sizes import (attention_width, block_param_count, count_parameters, moe_layer_count,
                                    moe_parameter_counts, padded_vocab, rank_expert_param_count,
                                    tp_block_param_count, tp_moe_block_param_count)
from threefold.parallel.pipeline.schedule import EQUAL_SHARES, SCHEDULE_REGISTRY, check_schedule, schedule_names
from threefold.plan import context
from threefold.plan.context import METHODS as CP_METHODS
from threefold.words import plural

SCHEDULES = schedule_names()  # the registry's order: Layout.schedule indexes it


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


def embedding_param_count(cfg: ModelConfig) -> int:
    """Parameters of the input embedding lookup tables (tokens, and learned positions for GPT)."""
    v = _require_vocab(cfg)
    positions = cfg.seq_len * cfg.hidden if cfg.arch == "gpt" else 0
    return v * cfg.hidden + positions


def param_count(cfg: ModelConfig) -> int:
    """Exact number of distinct parameters (tied embeddings counted once); of an MoE model, every
    expert's (its total parameters)."""
    if cfg.arch == "llama":
        _require_vocab(cfg)
        return moe_parameter_counts(cfg)[0]  # the model's own count, torch-free
    h, v = cfg.hidden, _require_vocab(cfg)
    head = 0 if cfg.tie_embeddings else v * h
    final_norm = 2 * h  # LayerNorm weight and bias
    return cfg.layers * block_param_count(cfg) + embedding_param_count(cfg) + head + final_norm


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token computes with: all of a dense model's; of an MoE model, the router,
    the top-k routed experts and the shared experts of each MoE layer, everything else whole
    (``sizes.moe_parameter_counts``). MFU counts these, as Mixtral's and DeepSeek-V3's reports do."""
    if cfg.arch == "llama":
        _require_vocab(cfg)
        return moe_parameter_counts(cfg)[1]
    return param_count(cfg)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Active parameters that take part in a matrix multiply per token: all but the lookup tables.

    With tied embeddings the table is also the output head, so it stays counted once.
    """
    lookup_only = embedding_param_count(cfg) - (_require_vocab(cfg) * cfg.hidden if cfg.tie_embeddings else 0)
    return active_param_count(cfg) - lookup_only


def active_block_param_count(cfg: ModelConfig) -> int:
    """Active parameters of all blocks together: L · block_param_count for a dense model; each
    MoE block with its router, top-k and shared experts in place of the dense SwiGLU."""
    dense_count = count_parameters(cfg) if cfg.arch == "llama" else param_count(cfg)
    outside_blocks = dense_count - cfg.layers * block_param_count(cfg)
    return active_param_count(cfg) - outside_blocks  # the embeddings, the final norm and the head


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


def recompute_flops_per_token(cfg: ModelConfig) -> tuple[float, float, float, float]:
    """Extra forward FLOPs per token that recomputation executes, for each of RECOMPUTE.

    full: every block's forward runs twice (the logits are not recomputed);
    selective: the attention core's forward runs twice (Korthikanti et al. 2022);
    op: the products that op-level selective checkpointing does not save run again
    (``op_recomputed_products``: every second one; of an MoE block, its attention's).
    """
    dense_layers = cfg.layers - moe_layer_count(cfg)
    op = 2.0 * (dense_layers * sum(k * n for k, n in op_recomputed_products(cfg, 1))
                + moe_layer_count(cfg) * sum(k * n for k, n in op_recomputed_products(cfg, 1, attention_only=True)))
    return (0.0, attention_flops_per_token(cfg), 2.0 * active_block_param_count(cfg) + attention_flops_per_token(cfg),
            op)


def hardware_flops_per_token(cfg: ModelConfig, recompute: str) -> float:
    """FLOPs the GPU executes per token including the recomputed forward (for HFU)."""
    return model_flops_per_token(cfg) + recompute_flops_per_token(cfg)[_index(RECOMPUTE, recompute, "--recompute")]


# --------------------------------------------------------------------------------------------
# Model states, data- and tensor-parallel traffic, exact, for the engine's own runs
# --------------------------------------------------------------------------------------------

# The widths of the engine's activations per train.dtype: (a product's output, the residual
# stream). bfloat16 is fp32 weights under torch.autocast: the matrix products compute and return
# bf16, while the embedding's lookup, the residual adds and the RMSNorms (which compute in fp32)
# keep the stream fp32, so what crosses a pipeline stage, a norm's output and their gradients
# are 4 bytes an element, a product's output and its gradient 2. The planner's "mixed" precision
# is Megatron's instead: 16-bit weights, every activation 2 bytes.
ENGINE_BYTES = {"float32": (4, 4), "bfloat16": (2, 4)}


def dp_bytes_per_step(numel, dp, zero, microbatches, grad_bytes: int = 4, param_bytes: int = 4, shard=None,
                      reshard_after_forward=True):
    """Bytes each rank sends on the data-parallel axis per optimizer step (ring convention).

    ``numel`` is the number of parameter elements the dp group holds replicas of.
      zero 0:    one all-reduce of the accumulated gradients:       2(n−1)/n · numel · grad_bytes
      zero 1:    reduce-scatter of the accumulated gradients + all-gather of the updated parameters:
                                                   (n−1)/n · numel · (grad_bytes + param_bytes)
      zero 2:    as zero 1, but gradients are reduce-scattered after every micro-batch, so no rank
                 ever holds the full gradient (the ZeRO paper's way):
                                                   (n−1)/n · numel · (m · grad_bytes + param_bytes)
      zero 1, 2 sharded over groups of s (hybrid sharding, Megatron-Core's distributed optimizer
                 instances): as over s ranks, and the step's reduced shard all-reduced once over
                 the r = n/s groups:          + 2(r−1)/r · numel/s · grad_bytes
      zero 3:    per micro-batch, all-gather of parameters for forward and again for backward,
                 and a reduce-scatter of gradients:  m · (n−1)/n · numel · (2·param_bytes + grad_bytes)
      zero 3 sharded over groups of s of the n ranks (hybrid sharding, ``shard``; None or 0: s = n):
                 as zero 3 over s ranks, and an all-reduce of each reduced shard over the r = n/s
                 groups holding it:  m · [(s−1)/s · numel · (2·param_bytes + grad_bytes)
                                          + 2(r−1)/r · numel/s · grad_bytes]
      zero 3 kept gathered through the step (``reshard_after_forward`` False: FSDP2's, torchtitan's
                 under a pipeline): one gather and one reduction a step, whatever m; zero 1's bytes
    With n = 1 every term is 0. Works elementwise on numpy arrays.
    """
    numel, dp, zero = np.asarray(numel, dtype=float), np.asarray(dp), priced_zero(zero, reshard_after_forward)
    shard = dp if shard is None else np.where(np.asarray(shard) > 0, shard, dp)
    share, groups = (dp - 1) / dp, dp / shard
    all_reduce = 2 * share * numel * grad_bytes
    in_group, between_groups = (shard - 1) / shard, hsdp_all_reduce_bytes(numel, shard, groups, 1, grad_bytes)
    sharded_optimizer = in_group * numel * (grad_bytes + param_bytes) + between_groups
    sharded_gradients = in_group * numel * (microbatches * grad_bytes + param_bytes) + between_groups
    fully_sharded = (microbatches * (shard - 1) / shard * numel * (2 * param_bytes + grad_bytes)
                     + hsdp_all_reduce_bytes(numel, shard, groups, microbatches, grad_bytes))
    return _scalar_or_array(np.select([zero == 0, zero == 1, zero == 2], [all_reduce, sharded_optimizer, sharded_gradients],
                                      fully_sharded))


def priced_zero(zero, reshard_after_forward=True):
    """The ZeRO stage a layout sends and holds as: ZeRO-3 with its units kept gathered through the
    step (``reshard_after_forward`` False) gathers once and reduces once a step and holds every
    weight and gradient while it runs, ZeRO-1's bytes and memory; else ``zero``. Elementwise."""
    zero = np.asarray(zero)
    return np.where((zero == 3) & ~np.asarray(reshard_after_forward, dtype=bool), 1, zero)


def tp_bytes_per_step(layers, microbatches, micro_batch, seq_len, hidden, tp, sequence_parallel, recompute,
                      dtype_bytes: int = 4, arch: str = "llama", embedding=True, moe_layers=0,
                      residual_bytes: int | None = None, tp_overlap=False, expert_tp=0, top_k=1, shared_experts=0):
    """Bytes each rank sends on the tensor-parallel axis per optimizer step, for the blocks, the
    embedding and the head (the CommLedger's key ``tp``; ring convention).

    With B = micro_batch · seq_len · hidden · dtype_bytes (one micro-batch's activations) and
    a = 2(t−1)/t (an all-reduce of B sends a·B; an all-gather or reduce-scatter a/2·B), each
    micro-batch sends ``tp_collectives_per_microbatch`` · a · B. See that function for the terms.
    ``embedding``: False for the last pipeline stage, which holds the head but not the embedding.
    ``moe_layers``: how many of the ``layers`` blocks hold experts; ``expert_tp``, ``top_k`` and
    ``shared_experts``: how their experts sit over tp (``Layout.expert_tp``), each token's routed
    experts and the shared ones.
    ``residual_bytes``: the width of the residual stream where it differs from the products'
    outputs (``dtype_bytes``): 4 in the engine's bf16 runs (``ENGINE_BYTES``); the collectives of
    ``tp_residual_collectives_per_microbatch`` carry it (``tp_overlap`` changes which), the others
    a product's output. None: every activation is ``dtype_bytes`` wide (fp32, and Megatron's pure
    16-bit activations).
    Works elementwise on numpy arrays (``recompute`` then as indices into RECOMPUTE).
    """
    ring = 2 * (np.asarray(tp) - 1) / tp
    collectives = tp_collectives_per_microbatch(layers, sequence_parallel, recompute, arch, embedding, moe_layers,
                                                expert_tp, top_k, shared_experts)
    if residual_bytes is None or residual_bytes == dtype_bytes:
        return _scalar_or_array(microbatches * collectives * ring * micro_batch * seq_len * hidden * dtype_bytes)
    residual = tp_residual_collectives_per_microbatch(layers, sequence_parallel, recompute, arch, embedding,
                                                      moe_layers, tp_overlap, expert_tp, shared_experts)
    widths = (collectives - residual) * dtype_bytes + residual * residual_bytes
    return _scalar_or_array(microbatches * ring * micro_batch * seq_len * hidden * widths)


def tp_residual_collectives_per_microbatch(layers, sequence_parallel, recompute, arch: str = "llama",
                                           embedding=True, moe_layers=0, tp_overlap=False, expert_tp=0,
                                           shared_experts=0):
    """Of ``tp_collectives_per_microbatch``, those whose tensor is the residual stream or a
    norm's output, or their gradients (autograd gives a gradient its tensor's dtype); the others
    carry a row-parallel product's output or its gradient. They differ in width where the
    residual stream is wider than the products (the engine's bf16 autocast: fp32 and bf16).

    Per block, without SP: 2, each sublayer's f (dL/dx of the norm's output); its g sums a
    product. With SP: 3, per sublayer the gather of the norm's output, its gradient's
    reduce-scatter and the re-gather for the weight gradient (½ each); the reduce-scatter of the
    product and its gradient's gather carry the product. Full recomputation: none without SP (it
    repeats the attention's g), with SP the attention's and the MLP's gathers, 1. An MoE block:
    the attention's (1, SP 1½), and with SP the gather of the block's input and its gradient's
    reduce-scatter (½ + ½: tensor_parallel.SequenceSplitMoE), 2½; placed as Megatron-Core places
    experts (``expert_tp`` ≥ 1) the attention's 1½ (full recomputation ½ more), and the shared
    experts' as a dense MLP's where there are any: the router reads this rank's positions and the
    all-to-all carries the rest (an expert-tp gather carries the dispatched rows, a product's
    width). The embedding's lookup and the
    head's input are the residual stream: all of theirs, 1 (SP 1) and 1 (SP 1½). With
    ``tp_overlap`` (SP only) the reduce-scatter of dL/dx is a ring of the addends each product's
    gradient gives, in the products' dtype: ½ less per column-parallel sublayer (a dense block 1,
    an MoE block's attention ½, the head ½).
    """
    sp = np.asarray(sequence_parallel, dtype=bool)
    full = _recompute_index(recompute) == RECOMPUTE.index("full")
    per_block = np.where(sp, 3.0, 2.0) + np.where(full & sp, 1.0, 0.0)
    megatron = np.asarray(expert_tp) >= 1
    _, megatron_residual = megatron_moe_block_collectives(full, expert_tp, 1, shared_experts)
    moe_less = np.where(megatron, per_block - megatron_residual, np.where(sp, 0.5, 1.0))
    residual = layers * per_block - moe_layers * moe_less + np.where(embedding, 1.0, 0.0) + np.where(sp, 1.5, 1.0)
    ringed = np.asarray(tp_overlap, dtype=bool) & sp
    moe_ringed = 0.5 + np.where(megatron & (shared_experts > 0), 0.5, 0.0)  # the attention's; the shared MLP's
    return _scalar_or_array(residual - np.where(ringed, (layers - moe_layers) * 1.0 + moe_layers * moe_ringed + 0.5,
                                                0.0))


def megatron_moe_block_collectives(full, expert_tp, top_k, shared_experts, op=False):
    """(all tp collectives, those of residual width) of one MoE block on Megatron-Core's expert
    grid under SP, in all-reduces of the activations: the attention's 2½ (1½ of residual width;
    full recomputation repeats its gather and reduce-scatter, 1, ½ of it residual); the shared
    experts', a dense MLP's where there are any (2½, 1½; full recomputation its gather, ½); with
    the experts split over tp (``expert_tp`` > 1) the dispatched rows' gather and reduce-scatter,
    forward and backward, each ``top_k`` times the activations (2k; full recomputation k more),
    a product's width. Op-level recomputation (``op``) gathers the attention's input again (½),
    as in a dense block; it keeps an MoE block's feed-forward whole."""
    full = np.asarray(full, dtype=bool)
    shared = np.asarray(shared_experts) > 0
    split = np.where(np.asarray(expert_tp) > 1, 2 * top_k * (1 + 0.5 * full), 0)
    collectives = 2.5 + 1.0 * full + 0.5 * np.asarray(op, dtype=bool) + np.where(shared, 2.5 + 0.5 * full, 0) + split
    residual = 1.5 + 0.5 * full + np.where(shared, 1.5 + 0.5 * full, 0)
    return collectives, residual


def tp_collectives_per_microbatch(layers, sequence_parallel, recompute, arch: str = "llama", embedding=True,
                                  moe_layers=0, expert_tp=0, top_k=1, shared_experts=0):
    """The tensor-parallel collectives of one micro-batch, in all-reduces of its activations
    (an all-gather or a reduce-scatter of the same tensor counts ½), as the engine
    (threefold/parallel/tensor_parallel.py) runs them.

    Per block, without SP: 4. Forward, g after each sublayer's row-parallel linear (all-reduce of
      the partial sums); backward, f before each sublayer's column-parallel linears (all-reduce
      of dL/dx, to which every rank's slice contributes).
    Per block, with SP: 5. Each f and g becomes an all-gather + reduce-scatter pair along the
      sequence (½ + ½: the same bytes); and the column-parallel linears save only this rank's
      part of their input, so backward gathers it again for the weight gradient: ½ per sublayer.
    Full recomputation repeats the block's forward collectives, but only up to its last saved
      tensor: PyTorch's non-reentrant checkpoint (torch.utils.checkpoint, early stop on) stops
      recomputing there. In our Llama block that is the MLP's down-projection input, so the MLP's
      g is not repeated: 1 (SP: the attention's gather and reduce-scatter and the MLP's gather,
      1½). GPT's dropout after the MLP saves a mask after its g, so the whole forward reruns: 2
      (SP: 2), as Megatron-LM's own checkpointing also does.
    Embedding (vocab-parallel lookup): g forward, 1 (SP: reduce-scatter forward, all-gather of
      its gradient backward, 1). Head (column-parallel over the vocabulary): f backward, 1 (SP:
      gather forward, reduce-scatter backward, re-gather for the weight gradient, 1½).
    An MoE block (``moe_layers`` of the ``layers``) is replicated over tp, as the engine runs it
      (tensor_parallel.ReplicatedMoE): its feed-forward has no f or g, so without SP (each tp
      rank runs it on the whole sequence) the block has only the attention's 2; with SP the
      block's input is all-gathered forward for the router and its gradient reduce-scattered
      backward (½ + ½; SequenceSplitMoE) besides the attention's 2½: 3½. Its full recomputation
      repeats what a dense block's does (the attention's g, and with SP the block input's
      gather): 1 (SP 1½).
    An MoE block placed as Megatron-Core places experts (``expert_tp`` ≥ 1, under SP, which it
      requires): the attention's 2½ and the shared experts' (a dense MLP's, 2½, where there are
      any); its router reads this rank's positions and the all-to-all dispatches them (no tp
      collective), and with the experts' weights split over tp (``expert_tp`` > 1, its default)
      the dispatched rows are all-gathered over tp before the experts and their output
      reduce-scattered, forward and backward: each a ``top_k``-times larger tensor, 2k more
      (Megatron-Core's token dispatcher, gather_from_sequence_parallel_region over the expert-tp
      group). Full recomputation repeats the attention's 1, the shared MLP's gather ½ and those k
      (``megatron_moe_block_collectives``).
    Not counted here: the loss (``tp_loss_bytes_per_step``), and per step, not per micro-batch,
    the norm gains' gradients under SP and the gradient norm's scalar, O(layers · hidden) bytes.
    """
    sp = np.asarray(sequence_parallel, dtype=bool)
    full = _recompute_index(recompute) == RECOMPUTE.index("full")
    op = _recompute_index(recompute) == RECOMPUTE.index("op")
    recomputed = np.where(sp, 1.5, 1.0) if arch == "llama" else 2.0
    # op-level SAC (``block_activation_bytes``) keeps the reduce-scatters' outputs, not the
    # gathers: with SP it gathers both sublayers' inputs again (½ + ½); without SP it repeats the
    # attention's g (Llama; GPT's dropout mask after the MLP's g repeats both, 2), as full does.
    op_recomputed = np.where(sp, 1.0, 1.0 if arch == "llama" else 2.0)
    per_block = np.where(sp, 5.0, 4.0) + np.where(full, recomputed, np.where(op, op_recomputed, 0.0))
    moe_saves = np.where(sp, 1.5, 2.0)  # a replicated MoE block's feed-forward: no f or g
    megatron_block, _ = megatron_moe_block_collectives(full, expert_tp, top_k, shared_experts, op)
    moe_saves = np.where(np.asarray(expert_tp) >= 1, per_block - megatron_block, moe_saves)
    return _scalar_or_array(layers * per_block - moe_layers * moe_saves + np.where(embedding, 1.0, 0.0)
                            + np.where(sp, 1.5, 1.0))


def tp_loss_bytes_per_step(microbatches, micro_batch, seq_len, tp):
    """Bytes each rank sends on the tensor-parallel axis per step for the vocab-parallel loss
    (ledger key ``tp.loss``): per token, an all-reduce of the max logit and one of the sum of
    exponentials and the target's logit, three fp32 numbers whatever the activations' type."""
    return _scalar_or_array(microbatches * 2 * (np.asarray(tp) - 1) / tp * 3 * micro_batch * seq_len * 4)


def pp_bytes_per_step(pp_rank: int, pp: int, microbatches: int, virtual_stages: int, micro_batch: int, seq_len: int,
                      hidden: int, tp: int = 1, sequence_parallel: bool = False, dtype_bytes: int = 4,
                      schedule: str = "1f1b") -> float:
    """Bytes pipeline rank ``pp_rank`` sends on the pp axis per step (ledger key ``pp``).

    Each of its v stages sends every micro-batch's output activations forward, except the very
    last stage, and every micro-batch's input gradient backward, except stage 0: m · (2v − [last
    rank] − [first rank]) messages. A message is one micro-batch's hidden states; each tp rank
    sends 1/tp of it: its part of the sequence under sequence parallelism, and without SP its
    slice of the flat tensor (Megatron's scatter/gather, ``scatter_gather_bytes_per_step``).
    DualPipeV's V sends fewer messages (``pp_messages_per_step``). ``dtype_bytes``: the width of
    the hidden states, the residual stream (the engine's bf16 runs keep it fp32, ``ENGINE_BYTES``).
    """
    messages = pp_messages_per_step(pp_rank, pp, microbatches, virtual_stages, schedule)
    return messages * micro_batch * seq_len * hidden * dtype_bytes / tp


def pp_messages_per_step(pp_rank: int, pp: int, microbatches: int, virtual_stages: int,
                         schedule: str = "1f1b") -> int:
    """Messages pipeline rank ``pp_rank`` sends per step; it receives as many.

    DualPipeV (``dualpipev_messages_per_step``) leaves out the local hand-off at the turn of its V."""
    if schedule == "dualpipev":
        return dualpipev_messages_per_step(pp_rank, pp, microbatches)
    return microbatches * (2 * virtual_stages - (pp_rank == pp - 1) - (pp_rank == 0))


def dualpipev_messages_per_step(pp_rank: int, pp: int, microbatches: int) -> int:
    """DualPipeV's messages from rank r per step. Each of its two stages sends every micro-batch's
    activation on and its input gradient back, 4m in all, except across the model's two ends,
    both on rank 0 (stage 0 sends no gradient, the last stage no activation), and across the turn
    of the V on rank pp − 1, where stages pp − 1 and pp hand both over in memory: 2m·([r > 0] +
    [r < pp − 1])."""
    return 2 * microbatches * ((pp_rank > 0) + (pp_rank < pp - 1))


def scatter_gather_bytes_per_step(pp_rank: int, pp: int, microbatches: int, virtual_stages: int, micro_batch: int,
                                  seq_len: int, hidden: int, tp: int, dtype_bytes: int = 4,
                                  schedule: str = "1f1b") -> float:
    """Bytes a rank sends on the tp axis per step to put the messages it received back
    together under tp without SP (ledger key ``tp.scatter_gather``): one all-gather of the
    whole message per message received."""
    message = micro_batch * seq_len * hidden * dtype_bytes
    return pp_messages_per_step(pp_rank, pp, microbatches, virtual_stages, schedule) * (tp - 1) / tp * message


def ep_bytes_per_step(tokens, top_k, hidden, ep, moe_layers, microbatches, num_experts, recompute="none",
                      dtype_bytes: int = 4, count_bytes: int = 8):
    """Bytes each rank sends on the expert-parallel axis per optimizer step (ledger key ``ep``),
    for dropless routing that sends every rank's experts the same share of the assignments
    (round-robin routing; balanced routing on average).

    ``tokens`` is T, the tokens this rank routes in one micro-batch (micro_batch · seq_len / cp);
    each makes ``top_k`` = k assignments, one row of ``hidden`` = h elements. Of a rank's T·k
    rows, 1/ep are for its own experts and stay; (ep−1)/ep go to the other ep − 1 ranks. Per MoE
    layer and micro-batch:
      dispatch (forward)      all_to_all of the rows to their experts' ranks:  (ep−1)/ep · T·k·h · bytes
      combine (forward)       all_to_all of the experts' outputs back:         (ep−1)/ep · T·k·h · bytes
      backward                the gradients of both, the same sizes reversed: 2 · (ep−1)/ep · T·k·h · bytes
                              → 4 · (ep−1)/ep · T·k·h · dtype_bytes
      count exchange          before the dispatch, an all_to_all_single of this rank's E per-expert
      (forward)               counts (int64, E = ``num_experts``) split evenly over the ep ranks: each
                              other rank gets the E/ep counts of its own experts, so a rank sends
                              (ep−1) · E/ep · count_bytes. The receiver needs per-expert counts, not
                              one total per peer, to group its rows by local expert. The backward
                              reuses the forward's splits: no second exchange.
    Recomputation: ``full`` reruns each block's forward, its routing, count exchange, dispatch and
    combine included: + 2 · (ep−1)/ep · T·k·h · bytes + (ep−1) · E/ep · count_bytes per MoE layer
    and micro-batch; ``selective`` reruns only the attention core: nothing. With ep = 1 every term
    is 0. Works elementwise on numpy arrays (``recompute`` then as indices into RECOMPUTE).
    """
    ep = np.asarray(ep)
    share = (ep - 1) / ep
    rows = share * np.asarray(tokens, dtype=float) * top_k * hidden
    sent = 2 * rows * dtype_bytes  # one way and back
    counts = (ep - 1) * (num_experts / ep) * count_bytes
    full = _recompute_index(recompute) == RECOMPUTE.index("full")
    per_layer = 2 * sent + counts + np.where(full, sent + counts, 0)
    return _scalar_or_array(microbatches * moe_layers * per_layer)


def hsdp_all_reduce_bytes(numel, shard, groups, microbatches, grad_bytes: int = 4):
    """Hybrid sharding's share of ``dp_bytes_per_step``: the reduced shards (numel/s elements)
    all-reduced over the ``groups`` that hold them, on a group of dp ranks alone, ``microbatches``
    times a step (ZeRO-3: each micro-batch's; ZeRO-1, 2: once, the step's)."""
    groups = np.asarray(groups)
    return _scalar_or_array(microbatches * 2 * (groups - 1) / groups * np.asarray(numel, dtype=float) / shard
                            * grad_bytes)


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


# --------------------------------------------------------------------------------------------
# Layouts
# --------------------------------------------------------------------------------------------

# none; selective: Korthikanti et al.'s, the attention core (Megatron's --recompute-activations);
# full: each block; op: op-level selective activation checkpointing (torchtitan's "selective"
# with selective_ac_option "op": ``block_activation_bytes``). ``recompute_policy`` reads the
# name "selective" of a ZeRO-3 layout under flash attention as op (docs/planner.md).
RECOMPUTE = ("none", "selective", "full", "op")
ATTENTION = ("flash", "eager")


def recompute_policy(recompute, zero, attention: str = "flash"):
    """The recomputation a user's ``--recompute`` names, as an index into RECOMPUTE (arrays of
    layouts elementwise): "selective" on a ZeRO-3 layout under flash attention is op-level SAC,
    what the FSDP frameworks that offer a selective mode run there (torchtitan's default
    ``selective_ac_option = "op"``), since the attention core Megatron's selective reruns stores
    nothing under flash; everything else as named. The engine's own runs (compare, dryrun) do not
    go through here: its selective is the attention core at any ZeRO stage."""
    index = _recompute_index(recompute)
    if attention == "eager" and np.any(index == RECOMPUTE.index("op")):
        raise ConfigError("--recompute: op (op-level selective checkpointing) saves the fused attention kernel's "
                          "output; it needs --attention flash")
    op = (index == RECOMPUTE.index("selective")) & (np.asarray(zero) == 3) & (attention == "flash")
    resolved = np.where(op, RECOMPUTE.index("op"), index)
    return int(resolved) if np.ndim(resolved) == 0 else resolved


@dataclass
class Layout:
    """One parallel layout, or (numpy arrays in every field) many of them.

    ``recompute`` and ``schedule`` are indices into RECOMPUTE and SCHEDULES so that arrays of
    layouts stay numeric; ``Layout.named`` builds one from names.
    """
    tp: Any = 1
    pp: Any = 1
    dp: Any = 1
    cp: Any = 1
    zero: Any = 0
    micro_batch: Any = 1
    virtual_stages: Any = 1
    sequence_parallel: Any = False
    recompute: Any = 0
    schedule: Any = 1
    ep: Any = 1  # expert-parallel ranks, carved out of the dp ranks (ep divides dp)
    cp_method: Any = 0  # index into CP_METHODS: ring, allgather, ulysses
    dp_shard: Any = 0  # hybrid sharding: ZeRO's shard group, in dp ranks (0: all of them)
    # ZeRO-3: True frees each unit after its forward, False keeps it gathered through the step;
    # None (unset) is torchtitan's default: False under a pipeline, True without one
    reshard_after_forward: Any = None
    # How an MoE model's experts sit over tp. 0: threefold's engine (and DeepSpeed-MoE): whole on
    # every tp rank, under SP each rank running them on its own positions, ep carved out of dp.
    # ≥ 1: Megatron-Core's expert grid (--expert-tensor-parallel-size), which folds the tp·cp·dp
    # ranks of a stage into expert-tp × ep × expert-dp: 1, whole experts, ep over tp·cp·dp; tp, each
    # expert's matrices split over the tp ranks, ep over cp·dp (Megatron-Core's default).
    expert_tp: Any = 0

    def __post_init__(self):
        if self.reshard_after_forward is None:
            pp = np.asarray(self.pp)
            self.reshard_after_forward = bool(pp == 1) if pp.ndim == 0 else pp == 1

    @classmethod
    def named(cls, recompute: str = "none", schedule: str = "1f1b", cp_method: str = "ring", **sizes) -> "Layout":
        return cls(recompute=_index(RECOMPUTE, recompute, "--recompute"),
                   schedule=_index(SCHEDULES, schedule, "--schedule"),
                   cp_method=_index(CP_METHODS, cp_method, "--cp-method"), **sizes)

    def take(self, index) -> "Layout":
        """The layouts at ``index`` of an array-valued Layout."""
        return Layout(**{f.name: np.asarray(getattr(self, f.name))[index] for f in fields(self)})

    def describe(self, i: int | None = None) -> str:
        """``TP=8 PP=16 DP=8 mb=1 zero=1 SP selective 1f1b`` (``EP=8``, ``CP=4 ring`` where they are
        above 1): one layout (element ``i`` of an array)."""
        v = {f.name: (np.asarray(getattr(self, f.name))[i] if i is not None else getattr(self, f.name))
             for f in fields(self)}
        parts = [f"TP={int(v['tp'])}", f"PP={int(v['pp'])}", f"DP={int(v['dp'])}"]
        if int(v["ep"]) > 1:
            parts.append(f"EP={int(v['ep'])}")
        if int(v["expert_tp"]) >= 1 and expert_grid_differs(*(int(v[k]) for k in ("tp", "cp", "dp", "ep"))):
            parts.append(f"ETP={int(v['expert_tp'])}")  # Megatron-Core's grid, where it is not the engine's
        if int(v["cp"]) > 1:
            parts.append(f"CP={int(v['cp'])} {CP_METHODS[int(v['cp_method'])]}")
        parts += [f"mb={int(v['micro_batch'])}", f"zero={int(v['zero'])}"]
        reshard = bool(v["reshard_after_forward"])
        if int(v["zero"]) == 3 and (int(v["pp"]) > 1 or not reshard):  # where it is not the default's way
            parts.append("reshard" if reshard else "no-reshard")
        if int(v["dp_shard"]) > 0:  # ZeRO-3's is FSDP's HSDP; ZeRO-1, 2's Megatron's optimizer instances
            parts.append(f"{'hsdp' if int(v['zero']) == 3 else 'shard'}={int(v['dp_shard'])}")
        if bool(v["sequence_parallel"]):
            parts.append("SP")
        parts.append(RECOMPUTE[int(v["recompute"])])
        if int(v["pp"]) > 1:
            schedule = SCHEDULES[int(v["schedule"])]
            parts.append(f"{schedule} v={int(v['virtual_stages'])}" if SCHEDULE_REGISTRY[schedule].chunked else schedule)
        return " ".join(parts)


def expert_grid_differs(tp, cp, dp, ep):
    """Where Megatron-Core's expert grid (``Layout.expert_tp`` ≥ 1) is not threefold's engine's
    placement: under tp; over cp with ep > 1 (its ep group is consecutive ranks, the engine's
    t·c apart); with ep past the dp ranks. Elsewhere (tp 1, cp 1, ep dividing dp) they price
    alike. Elementwise."""
    return (np.asarray(tp) > 1) | ((np.asarray(cp) > 1) & (np.asarray(ep) > 1)) | (np.asarray(dp) % np.asarray(ep) > 0)


def ep_stride(tp, cp, expert_tp):
    """Ranks between two members of an ep group: t·c on the engine's placement (ep within dp),
    expert_tp on Megatron-Core's grid (its expert-tp ranks innermost). Elementwise."""
    expert_tp = np.asarray(expert_tp)
    return np.where(expert_tp >= 1, expert_tp, np.asarray(tp) * np.asarray(cp))


def _index(names: tuple[str, ...], name: str, flag: str) -> int:
    if name not in names:
        raise ConfigError(f"{flag}: must be one of {', '.join(names)}, got {name!r}")
    return names.index(name)


def _recompute_index(recompute):
    """An index into RECOMPUTE (or an array of them) from a name or from indices."""
    return _index(RECOMPUTE, recompute, "--recompute") if isinstance(recompute, str) else np.asarray(recompute)


def check_layout(model: ModelConfig, layout: Layout, global_batch: int, num_gpus: int) -> None:
    """Raise ConfigError, one line, for a scalar layout that cannot run this model on these GPUs."""
    t, p, d, c, b, v, e = (int(x) for x in (layout.tp, layout.pp, layout.dp, layout.cp, layout.micro_batch,
                                           layout.virtual_stages, layout.ep))
    schedule = SCHEDULES[int(layout.schedule)]
    for flag, value in (("--tp", t), ("--pp", p), ("--dp", d), ("--cp", c), ("--ep", e), ("--micro-batch", b),
                        ("--virtual-stages", v), ("--global-batch", global_batch), ("--num-gpus", num_gpus)):
        if value < 1:
            raise ConfigError(f"{flag}: must be a positive integer, got {value}")
    if int(layout.zero) not in (0, 1, 2, 3):
        raise ConfigError(f"--zero: must be 0, 1, 2 or 3, got {int(layout.zero)}")
    if t * p * d * c != num_gpus:
        raise ConfigError(f"--tp × --pp × --dp × --cp = {t}×{p}×{d}×{c} = {t * p * d * c}, not --num-gpus {num_gpus}")
    if model.heads % t or model.n_kv_heads % t:
        apart = [f"the {plural(n, kind)}" for n, kind in ((model.heads, "head"), (model.n_kv_heads, "kv head")) if n % t]
        raise ConfigError(f"--tp: {t} does not divide {' or '.join(apart)} (tp splits whole heads)")
    if model.ffn_hidden % t:
        raise ConfigError(f"--tp: {t} does not divide the FFN width {model.ffn_hidden}")
    if c > 1 and model.seq_len % (2 * c):
        raise ConfigError(f"--cp: {c} does not divide half the sequence, {model.seq_len}/2 (the zigzag split "
                          f"gives each rank 2 of 2·cp equal chunks)")
    method = CP_METHODS[int(layout.cp_method)]
    for heads, kind in ((model.heads // t, "query"), (model.n_kv_heads // t, "key/value")):
        if c > 1 and method == "ulysses" and heads % c:
            raise ConfigError(f"--cp-method ulysses: --cp {c} does not divide the {plural(heads, kind + ' head')} "
                              f"of one tp rank (Ulysses splits the heads over cp)")
    check_experts(model, e, d, t, c, int(layout.expert_tp))
    if model.moe_experts and int(layout.expert_tp) >= 1 and t > 1 and not layout.sequence_parallel:
        raise ConfigError("--expert-tp: Megatron-Core runs an MoE model under --tp only with --sequence-parallel")
    check_hybrid_sharding(int(layout.dp_shard), int(layout.zero), d, e, t, c, int(layout.expert_tp))
    full = _recompute_index(layout.recompute) == RECOMPUTE.index("full")
    if p > 1 and full and SCHEDULE_REGISTRY[schedule].split_backward:
        raise ConfigError(f"--recompute: full with --schedule {schedule} is not priced: its weight gradients (W) run "
                          "apart from the input gradients (B), so each block would run its forward again for W "
                          "(threefold's engine refuses it); use --recompute selective or none, or --schedule 1f1b "
                          "or interleaved")
    if global_batch % (d * b):
        raise ConfigError(f"--global-batch: {global_batch} is not divisible by --dp × --micro-batch = {d} × {b}")
    if layout.sequence_parallel and t == 1:
        raise ConfigError("--sequence-parallel: needs --tp > 1")
    if p > 1 or v > 1:
        # The planner prices an uneven split at its busiest rank (ceil(L/p) layers), as Megatron
        # runs one (--decoder-first/last-pipeline-num-layers; Llama 3 405B: 126 layers over 16
        # stages), so the registry's equal-chunk rules, which the engine needs, are checked on the
        # layers of a split whose every chunk is as long as the longest.
        chunks = model_chunks(schedule, p, v)
        if chunks > model.layers:
            raise ConfigError(f"--pp: pp × virtual_stages = {p} × {chunks // p} = {chunks} stages, more than the "
                              f"model's {plural(model.layers, 'layer')} (each stage needs a block)")
        check_schedule(schedule, p, global_batch // (d * b), v, balanced_layers(model.layers, chunks), flags=PLAN_FLAGS)


def check_hybrid_sharding(dp_shard: int, zero: int | None = None, dp: int | None = None, ep: int = 1, tp: int = 1,
                          cp: int = 1, expert_tp: int = 0) -> None:
    """--dp-shard: ZeRO (1, 2 or 3) over groups of that many dp ranks, as threefold's engine runs
    it (the ZeRO stage and dp checked where they are known: plan searches them)."""
    if not dp_shard:
        return
    if dp_shard < 0:
        raise ConfigError(f"--dp-shard: must not be negative (0: shard over all dp ranks), got {dp_shard}")
    if zero is not None and zero == 0:
        raise ConfigError(f"--dp-shard: hybrid sharding splits ZeRO's states over groups of {plural(dp_shard, 'dp rank')}; "
                          f"it needs --zero 1, 2 or 3, got 0 (DDP keeps every state whole)")
    if dp_shard < 2 or (dp is not None and dp % dp_shard):
        raise ConfigError(f"--dp-shard: must {f'divide --dp {dp} and ' if dp is not None else ''}be at least 2 (a "
                          f"group of one rank shards nothing), got {dp_shard}")
    if expert_tp >= 1:  # Megatron-Core's grid: a group's tp·cp·dp_shard ranks hold whole ep × expert-tp groups
        if (tp // expert_tp * cp * dp_shard) % ep:
            raise ConfigError(f"--dp-shard: a shard group's experts fill whole ep groups on Megatron-Core's grid, so "
                              f"(--tp / --expert-tp) × --cp × --dp-shard = {tp // expert_tp * cp * dp_shard} must be a "
                              f"multiple of --ep {ep}")
        return
    if dp is not None and dp % ep:
        raise ConfigError(f"--dp-shard: a shard group holds whole expert-parallel groups of dp ranks, and --ep {ep} "
                          f"spans more than the dp ranks (--dp {dp}): hybrid sharding is not priced with it")
    if dp_shard % ep:
        raise ConfigError(f"--dp-shard: a shard group holds whole expert-parallel groups, so it must be a multiple "
                          f"of --ep {ep}, got {dp_shard}")


def model_chunks(schedule: str, pp: int, virtual_stages: int) -> int:
    """The model chunks a pipeline splits the blocks into: pp × the schedule's chunks a rank."""
    return pp * (SCHEDULE_REGISTRY[schedule].stages_per_rank or virtual_stages)


def balanced_layers(layers: int, chunks: int) -> int:
    """The layers of a split into ``chunks`` model chunks whose every chunk is as long as the
    longest, ceil(layers/chunks): what the registry's equal-chunk rules are checked on, since an
    uneven split is priced at its busiest rank (``check_layout``; ``search`` enumerates the same)."""
    return -(-layers // chunks) * chunks


def check_experts(model: ModelConfig, ep: int, dp: int, tp: int = 1, cp: int = 1, expert_tp: int = 0) -> None:
    """ConfigError, one line, for an expert-parallel size (or an expert-tp, ``Layout.expert_tp``)
    the model or the ranks cannot take."""
    if expert_tp not in (0, 1, tp):
        raise ConfigError(f"--expert-tp: must be 0 (threefold's engine), 1 or --tp {tp}, got {expert_tp}")
    if expert_tp > 1 and model.moe_ffn_hidden % expert_tp:
        raise ConfigError(f"--expert-tp: {expert_tp} does not divide the experts' FFN width {model.moe_ffn_hidden}")
    if ep == 1:
        return
    if not model.moe_experts:
        raise ConfigError(f"--ep: {ep} needs an MoE model (--moe-experts); this one is dense")
    if model.moe_experts % ep:
        raise ConfigError(f"--ep: {ep} does not divide the {plural(model.moe_experts, 'expert')} (--moe-experts)")
    if expert_tp == 0 and dp % ep:
        raise ConfigError(f"--ep: {ep} does not divide --dp {dp} (the expert-parallel ranks are data-parallel ranks)")
    if expert_tp >= 1 and (tp * cp * dp // expert_tp) % ep:
        ranks = "--tp × --cp × --dp" if expert_tp == 1 else "--cp × --dp"
        raise ConfigError(f"--ep: {ep} does not divide {ranks} = {tp * cp * dp // expert_tp} (Megatron-Core's "
                          f"expert grid at --expert-tp {expert_tp})")


PLAN_FLAGS = {"schedule": "--schedule", "pp": "--pp", "virtual_stages": "--virtual-stages",
              "microbatches": "--global-batch"}


# --------------------------------------------------------------------------------------------
# The cost model of a training step
# --------------------------------------------------------------------------------------------

# Model states per parameter: 16-bit weights, gradients of Workload.grad_bytes (4: fp32, as
# Megatron's main_grad and FSDP's fp32 reduction keep them, 2 + 4 + 12 = 18 bytes; 2: the classic
# 16), fp32 master weights and Adam's two fp32 moments.
PARAM_BYTES = 2
ACTIVATION_BYTES = 2  # 16-bit activations, and the TP, CP and PP messages that carry them
OPTIMIZER_BYTES = 12
# HBM bytes moved by the memory-bound (non-matmul) kernels, per byte of activations a layer stores:
# each is written and read in forward, read again in backward, and its gradient written and read.
ELEMENTWISE_PASSES = 6
# Bytes per element of each precision: fp32 training keeps no master copy (Adam's two moments only).
# optimizer_pass_bytes: what Adam reads and writes per parameter, besides the gradient: mixed, the
# fp32 master and both moments read and written and the 16-bit copy written (2·12 + 2); fp32, the
# weights and both moments read and written (2·(4 + 8)).
# loss_pass_bytes: what the loss moves per logit, forward and backward. mixed: a fused
# cross-entropy reads the 16-bit logits and writes and re-reads fp32 ones (2 + 4 + 4, and the
# 16-bit gradient's 2). fp32: the engine's eager F.cross_entropy on fp32 logits, pass by pass:
# log_softmax reads them twice (the row's max, the sum of exponentials) and writes its output
# (12); the backward writes the zero-filled gradient of nll_loss (4), log_softmax's backward
# reads it for the row sums and again with the output, and writes the logits' gradient (16);
# the product wrote the logits (4).
PRECISIONS = {"mixed": dict(param_bytes=PARAM_BYTES, activation_bytes=ACTIVATION_BYTES, optimizer_bytes=OPTIMIZER_BYTES,
                            optimizer_pass_bytes=26, loss_pass_bytes=12),
              "fp32": dict(param_bytes=4, activation_bytes=4, optimizer_bytes=8, optimizer_pass_bytes=24,
                           loss_pass_bytes=36)}
# fp8: mixed precision whose blocks' linear layers multiply in float8 (Transformer Engine's and
# torchao's float8 training): the same weights, master copy, moments and activations as mixed.
# Its memory is counted as mixed's: the fp8 copies of weights and saved inputs that TE keeps are
# left out (docs/planner.md, "What the planner does not know").
PRECISIONS["fp8"] = dict(PRECISIONS["mixed"])
# autocast: threefold's engine in bfloat16 (train.dtype), what `compare` prices its runs with:
# fp32 weights, gradients and moments, no master copy (torch AdamW on the fp32 weights, as in
# fp32), the products in bf16; ZeRO gathers the fp32 weights. Not a --dtype: GPU runs are mixed.
PRECISIONS["autocast"] = dict(PRECISIONS["fp32"], activation_bytes=ACTIVATION_BYTES,
                              loss_pass_bytes=PRECISIONS["mixed"]["loss_pass_bytes"])
# Bytes a float8 cast moves per element: Transformer Engine's fused cast-transpose reads the
# 16-bit tensor once and writes its fp8 copy and the copy's transpose (2 + 1 + 1), the scale's
# amax taken in the same pass. Each block product casts its input in the forward and the
# output's gradient in the backward, and its weight once a step (or per micro-batch under ZeRO-3:
# part_seconds).
FLOAT8_CAST_BYTES = 4
# Megatron-Core's default gradient bucket, in parameters: max(40M, 1M × dp) (megatron/core/
# distributed/distributed_data_parallel_config.py: "larger DP sizes need larger buckets to ensure
# collectives do not become latency-bound"); DeepSpeed's default, 5e8, is larger still
BUCKET_PARAMS, BUCKET_PARAMS_PER_REPLICA = 40_000_000, 1_000_000
RESERVED_BYTES = 2 * 2**30  # CUDA context, NCCL and cuBLAS workspaces, allocator slack


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the global batch in sequences, and numeric choices; with the
    model's FLOPs per token counted once here, not in every (vectorised) estimate."""
    model: ModelConfig
    global_batch: int
    attention: str = "flash"  # flash: never stores the s×s scores; eager: stores them (Megatron 2021-22)
    grad_bytes: int = 4
    overlap_dp: bool = True  # data-parallel reductions (and ZeRO gathers) run behind compute, as DDP/FSDP do
    tp_comm_overlap: bool = False  # Megatron-Core's --tp-comm-overlap: TP collectives pipelined with the GEMMs
    # parameters in one DDP / ZeRO-1/2 gradient bucket; None: Megatron-Core's default, which grows
    # with the replicas (bucket_params); threefold's engine: parallel.bucket_mb of fp32 gradients
    bucket_params: float | None = None
    # threefold's engine keeps activations as (batch, sequence, hidden): each sequence-parallel
    # gather and reduce-scatter reorders the whole tensor to and from rank-major order, a copy,
    # where a micro-batch holds more than one sequence; Megatron's (sequence, batch, hidden) needs none
    sequence_copies: bool = False
    # mixed: 16-bit weights and activations, fp32 master (GPUs); fp8: mixed, the blocks' products in
    # float8; fp32: all fp32 (CPUs)
    precision: str = "mixed"
    # the busiest expert-parallel rank's routed rows over the mean share (1: balanced routing):
    # under ep every rank waits at each MoE block's combine for that rank's experts and exchange
    moe_imbalance: float = 1.0
    model_flops_per_token: float = field(init=False)
    recompute_flops_per_token: tuple[float, float, float] = field(init=False)
    param_bytes: int = field(init=False)
    activation_bytes: int = field(init=False)
    optimizer_bytes: int = field(init=False)
    optimizer_pass_bytes: int = field(init=False)
    loss_pass_bytes: int = field(init=False)
    params_total: int = field(init=False)  # every expert's parameters
    params_active: int = field(init=False)  # what one token computes with (MFU counts these)

    def __post_init__(self):
        if self.model.moe_experts and self.model.arch != "llama":
            raise ConfigError("--moe-experts: the planner models experts in llama blocks only (--arch llama)")
        if not (math.isfinite(self.moe_imbalance) and self.moe_imbalance >= 1):
            raise ConfigError(f"--moe-imbalance: the busiest rank's routed rows over the mean, at least 1 "
                              f"(1: balanced), got {self.moe_imbalance:g}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--dtype: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for key, value in PRECISIONS[self.precision].items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "model_flops_per_token", model_flops_per_token(self.model))
        object.__setattr__(self, "params_total", param_count(self.model))
        object.__setattr__(self, "params_active", active_param_count(self.model))
        object.__setattr__(self, "recompute_flops_per_token", recompute_flops_per_token(self.model))


def activation_coefficients(model: ModelConfig, attention: str, dtype_bytes: int = ACTIVATION_BYTES) -> dict:
    """Bytes stored per token per layer for the backward pass, by how TP shards them.

    ``dtype_bytes`` is the size of one activation element: 2 for 16-bit training (what the
    planner assumes), 4 for the engine's fp32 runs. Tensors that are fp32 whatever the
    activations are (log-sum-exp, our RMSNorm's internals) count 4 bytes per element.
    norm:       what one norm saves, its output included (the next linear's input);
    replicated: held whole on every TP rank unless sequence parallelism splits them;
    sharded:    split over TP ranks (heads, FFN columns);
    core:       the attention core's internals, dropped by selective recomputation;
    embedding:  stored by the embedding layer per token (GPT's dropout mask);
    checkpoint: what full recomputation keeps of a block: its input.

    GPT (Korthikanti et al. 2022, 1-byte dropout masks): two LayerNorms' inputs and outputs
    (the outputs are the QKV and MLP inputs) and two dropout masks, replicated; Q, K, V, the
    attention output, GELU's input and output, sharded; eager scores: softmax, its dropout mask
    and the dropout output. At 16 bits, with q = kv = h and f = 4h: sbh(34 + 5as/h) per layer.

    Our Llama block (threefold/models/llama.py, no dropout), counted as PyTorch's autograd saves
    it: each RMSNorm computes in fp32 and keeps its input as fp32 (a copy when the activations are
    16-bit), x·rsqrt and rsqrt, besides its output; Q and K after rotary, V and the attention
    output; SwiGLU's gate, up, silu(gate) and product. Grouped-query attention repeats k and v to
    every query head before scaled_dot_product_attention, which saves the repeats: 2(q − kv) more
    elements in the core, since selective recomputation keeps only the unrepeated k and v.
    """
    h, f, a, s = model.hidden, model.ffn_hidden, model.heads, model.seq_len
    q, kv = attention_width(model)
    d = dtype_bytes
    if attention not in ATTENTION:
        raise ConfigError(f"--attention: must be flash or eager, got {attention!r}")
    eager = attention == "eager"
    if model.arch == "llama":
        norm = 4 * h + 4 * h + 4 + d * h  # fp32 input, fp32 x·rsqrt, fp32 rsqrt; output
        scores = d * a * s if eager else 4 * a  # softmax, or flash's fp32 log-sum-exp per head
        return dict(norm=norm, replicated=2 * norm, sharded=d * (2 * q + 2 * kv) + 4 * d * f,
                    core=scores + d * 2 * (q - kv), embedding=0, checkpoint=d * h)
    norm = 2 * d * h
    return dict(norm=norm, replicated=2 * norm + 2 * h, sharded=d * (2 * q + 2 * kv) + 2 * d * f,
                core=(2 * d + 1) * a * s if eager else 4 * a, embedding=h, checkpoint=d * h)


def block_activation_bytes(model: ModelConfig, tokens, tp, sequence_parallel, recompute, attention: str = "flash",
                           dtype_bytes: int = ACTIVATION_BYTES):
    """Bytes one block saves for backward on one TP rank, for a micro-batch of ``tokens`` tokens.

    Without recomputation everything in ``activation_coefficients``; selective drops the
    attention core; full keeps only the block's input; op what ``op_checkpoint_bytes`` keeps.
    Sequence parallelism splits the replicated part (and the block input) over the TP ranks.
    ``recompute`` is a name or an index into RECOMPUTE; the sizes may be numpy arrays.
    """
    coef = activation_coefficients(model, attention, dtype_bytes)
    recompute = _recompute_index(recompute)
    tp = np.asarray(tp)
    seq_split = np.where(np.asarray(sequence_parallel, dtype=bool), tp, 1)
    kept = tokens * (coef["replicated"] / seq_split + coef["sharded"] / tp)
    op_kept = op_checkpoint_bytes(model, tokens, tp, sequence_parallel, dtype_bytes)
    return _scalar_or_array(np.where(recompute == RECOMPUTE.index("full"), tokens * coef["checkpoint"] / seq_split,
                                     np.where(recompute == RECOMPUTE.index("selective"), kept,
                                              np.where(recompute == RECOMPUTE.index("op"), op_kept,
                                                       kept + tokens * coef["core"] / tp))))


def norm_weight_input_bytes(model: ModelConfig, coef: dict) -> float:
    """Of what one norm saves per token (``coef["norm"]``, ``activation_coefficients``), what a
    split backward keeps until W: an RMSNorm's x·rsqrt and output (its fp32 input and rsqrt only
    B reads), a LayerNorm's all (its backward, which W reruns, reads the input)."""
    return coef["norm"] - (4 * model.hidden + 4 if model.arch == "llama" else 0)


def weight_input_bytes(model: ModelConfig, tokens, tp, sequence_parallel, recompute, attention: str = "flash",
                       dtype_bytes: int = ACTIVATION_BYTES):
    """Of what one block saves (``block_activation_bytes``), the part a split backward keeps from
    a micro-batch's B to its W: the tensors of the nodes W runs, where each weight meets the
    input's path (parallel/pipeline/runtime.SavedForW releases the rest at B). Per token, on one
    tp rank:

      Llama: each RMSNorm's x·rsqrt (fp32) and output, the input of the products after it, of
        the rank's tokens: 2·(4h + d·h) / (tp under SP); the attention's output and SwiGLU's
        product, the inputs of wo and w_down: d·(q + f)/tp. Released: the norms' fp32 inputs and
        rsqrt, rotary's Q and K, V, gate, up and silu(gate), and the attention core.
      GPT: each LayerNorm's input and output (its backward, which W reruns, reads the input):
        2·2·d·h / (tp under SP); the attention's output and GELU's: d·(q + f)/tp. Released: the
        dropout masks, Q, K, V, GELU's input and the core.
    Under op-level or full recomputation the products' saved tensors sit inside the block's
    checkpoint, whose recomputation reads the block's input: nothing is released."""
    coef = activation_coefficients(model, attention, dtype_bytes)
    q, _ = attention_width(model)
    t = np.asarray(tp)
    seq_split = np.where(np.asarray(sequence_parallel, dtype=bool), t, 1)
    norms = 2 * norm_weight_input_bytes(model, coef)
    kept = tokens * (norms / seq_split + dtype_bytes * (q + model.ffn_hidden) / t)
    recompute = _recompute_index(recompute)
    checkpointed = (recompute == RECOMPUTE.index("full")) | (recompute == RECOMPUTE.index("op"))
    return _scalar_or_array(np.where(checkpointed, block_activation_bytes(model, tokens, tp, sequence_parallel, recompute,
                                                                          attention, dtype_bytes), kept))


def op_checkpoint_bytes(model: ModelConfig, tokens, tp, sequence_parallel, dtype_bytes: int = ACTIVATION_BYTES):
    """Bytes one block keeps for backward under op-level selective activation checkpointing, on
    one tp rank for ``tokens`` tokens: torchtitan's policy (``_save_list`` in
    torchtitan/parallelisms/parallelize_llama.py, 2024), which wraps each block in a
    non-reentrant checkpoint and saves the outputs of the matrix products except every second
    one (``op_saved_products``), of the fused attention kernel, and of the reduce-scatters;
    every other operator (norms, rotary, SwiGLU's elementwise, the products not saved) runs
    again in the backward. With d = dtype_bytes, per token:

      the block's input (the checkpoint's argument)        d·h / (tp under SP)
      the saved products' outputs: Llama wq, wv, w_gate,   d·(q + kv + f)/tp + d·h
        w_down; GPT the fused QKV and fc1. A row-parallel  (GPT: d·(q + 2kv + f)/tp)
        product's output is whole rows of partial sums
      scaled_dot_product_attention: its output, and its    d·q/tp + 4·heads/tp
        fp32 log-sum-exp per head (flash's, or the
        memory-efficient kernel's)
      under SP, the two reduce-scatters' outputs           2·d·h/tp
    Flash attention only: the policy saves the fused kernel's outputs, which eager attention has
    none of (``recompute_policy`` refuses op under eager)."""
    h, a = model.hidden, model.heads
    q, _ = attention_width(model)
    d, t = dtype_bytes, np.asarray(tp)
    sp = np.asarray(sequence_parallel, dtype=bool)
    products = sum(d * n for _, n in op_saved_products(model, t))
    attention = d * q / t + 4 * a / t
    return _scalar_or_array(tokens * (d * h / np.where(sp, t, 1) + products + attention + np.where(sp, 2 * d * h / t, 0)))


def moe_blocks_on_rank_0(cfg: ModelConfig, layers, stage_layers, pp, virtual_stages, v_shape):
    """MoE blocks on pipeline rank 0, for arrays of layouts: of its ``virtual_stages`` chunks of
    stage_layers/virtual_stages blocks, model chunks 0, p, 2p, … (interleaved), or the first and
    the last (a V: DualPipeV), so a model whose first blocks are dense has its MoE blocks counted
    where the rank holds them; one chunk, blocks 0 … stage_layers − 1, without a pipeline's chunks."""
    v, p = np.asarray(virtual_stages), np.asarray(pp)
    chunk = np.asarray(stage_layers) / v

    def moe_in(first_chunk):
        start = first_chunk * chunk
        return (moe_layers_below(cfg, np.minimum(layers, start + chunk))
                - moe_layers_below(cfg, np.minimum(layers, start)))

    interleaved = sum(np.where(k < v, moe_in(k * p), 0) for k in range(int(np.max(v)) if np.size(v) else 1))
    last_chunk = moe_layers_below(cfg, layers) - moe_layers_below(cfg, np.maximum(0, layers - chunk))  # the V's end
    return np.where(v_shape, moe_in(0) + last_chunk, interleaved)


def moe_layers_below(cfg: ModelConfig, n):
    """How many of the blocks 0 … n−1 hold experts (``sizes.is_moe_layer``), for arrays of n: none
    among the first ``moe_first_dense``, then every ``moe_every``-th."""
    if not cfg.moe_experts:
        return np.zeros(np.shape(n))
    after = np.maximum(0, np.asarray(n) - cfg.moe_first_dense)
    return np.ceil(after / cfg.moe_every)


def tp_partial_numel(model: ModelConfig, blocks, moe_blocks, last_stage, ep=1, folded=False):
    """The parameters of a tp rank whose gradients are partial sums over tp under sequence
    parallelism, summed once a step (placements.sum_partial_grads): the RMSNorm gains (two a
    block, the final one on the last stage) and an MoE block's router, shared experts and this
    rank's E/ep experts (tensor_parallel.SequenceSplitMoE); with the experts ``folded`` over tp
    (tensor_parallel.FoldedMoE) the router alone. ``(norm gains, MoE blocks')``."""
    h = model.hidden
    norms = 2 * h * np.asarray(blocks) + h * np.asarray(last_stage, dtype=float)
    moe = 0 * norms
    if model.moe_experts and folded:
        moe = np.asarray(moe_blocks) * model.moe_experts * h
    elif model.moe_experts:
        moe = np.asarray(moe_blocks) * (moe_replicated_param_count(model) + rank_expert_param_count(model, ep))
    return _scalar_or_array(norms), _scalar_or_array(moe)


def moe_replicated_param_count(model: ModelConfig) -> int:
    """An MoE block's parameters outside its routed experts and attention: the router (E·h)
    and the shared experts' three matrices."""
    return model.moe_experts * model.hidden + 3 * model.hidden * model.moe_shared_experts * model.moe_ffn_hidden


def moe_token_share(tp, sequence_parallel):
    """The share of a micro-batch's tokens whose experts one tp rank runs: under sequence
    parallelism its own s/t positions (tensor_parallel.SequenceSplitMoE), else all of them (the
    block replicated, its experts' work repeated on every tp rank). Elementwise."""
    t = np.asarray(tp)
    return _scalar_or_array(np.where(np.asarray(sequence_parallel, dtype=bool) & (t > 1), 1 / t, 1.0))


def imbalance_ceiling(model: ModelConfig, ep):
    """The most the busiest of ``ep`` ranks can take over the mean, min(ep, E/k): every row of the
    group (ep times the mean), or each token's k choices all among its E/ep experts (a rank's
    rows are at most T·min(k, E/ep) of the mean's T·k/ep). Elementwise."""
    return np.minimum(np.asarray(ep, dtype=float), model.moe_experts / model.moe_top_k_experts)


def routed_load(work: "Workload", ep):
    """The busiest expert-parallel rank's routed rows over a balanced share: the workload's
    ``moe_imbalance`` where the experts are split over ep ranks, at most ``imbalance_ceiling``
    (``plan`` prices every ep at the one imbalance it was given: none takes more than it can); 1
    where each rank holds every expert (its rows are every assignment of its own tokens, however
    they fall). Elementwise."""
    e = np.asarray(ep)
    return _scalar_or_array(np.where(e > 1, np.minimum(work.moe_imbalance, imbalance_ceiling(work.model, e)), 1.0))


def moe_activation_bytes(model: ModelConfig, tokens, tp, sequence_parallel, recompute,
                         dtype_bytes: int = ACTIVATION_BYTES, expert_tp=0, load=1.0):
    """Bytes an MoE block saves for backward beyond the dense block of ``block_activation_bytes``,
    on one tp rank, for the ``tokens`` of a micro-batch: the tensors autograd saves for
    threefold/models/moe.py's block, counted with saved-tensor hooks on one process (the input,
    already counted as the norm's output, and the weights left out). The block is replicated
    over tp. Without SP it runs on the whole sequence on every tp rank, so all of it is whole;
    under SP the router runs on the gathered sequence and the experts on this rank's positions
    (tensor_parallel.SequenceSplitMoE), so what the experts and the sort keep is of
    ``moe_token_share`` of the tokens. Per token, the experts': the SwiGLU internals (gate, up,
    silu(gate), product) of its k routed and the shared experts, 4·(k + S)·f_e, in place of the
    dense SwiGLU's 4·f/tp; three tensors of k rows of h (the permuted input, the experts' output
    and its weighted copy); the sort orders and the gathered weights (28·k, int64 and fp32). The
    router's, whole: in fp32 and int64 whatever the dtype, its logits and scores (8·E bytes),
    the choices' indices and weights (12·k) and the renormalising sum (4); under SP the gathered
    input (h), in place of the norm's output shard (h/tp), which nothing else keeps unless
    shared experts read it. Expert parallelism's regrouping adds a few bytes (not counted).
    Full recomputation keeps only the block's input, as for a dense block. Op-level SAC
    keeps an MoE block's feed-forward whole (``op_recomputed_products``: the policy predates MoE
    blocks) where the dense block it replaces kept w_gate's and w_down's outputs, d·(f/tp + h),
    and not the norm's output, which the experts' input then is.
    Placed as Megatron-Core places experts (``expert_tp`` ≥ 1, under SP): the router reads this
    rank's positions, so its tensors are of 1/tp of the tokens and nothing is gathered; with the
    experts split over tp (``expert_tp`` > 1) their input is the k dispatched rows of every tp
    rank's positions, gathered: k·h more a token, less this rank's share. ``load``: the routed
    rows this rank's experts take over a balanced share (``routed_load``: the busiest rank's): its
    experts' inputs and internals, and split experts' gathered rows, are of those."""
    d, k, f, h = dtype_bytes, model.moe_top_k_experts, model.moe_ffn_hidden, model.hidden
    t, sp = np.asarray(tp), np.asarray(sequence_parallel, dtype=bool)
    megatron = np.asarray(expert_tp) >= 1
    recompute = _recompute_index(recompute)
    gathered = _moe_gathered_bytes(model, t, sp, d, expert_tp, load)
    # the rows this rank's experts run, per token of its share: what the experts save (their input
    # rows, their SwiGLU internals) is of those; the combine's output and its weighted copy, of its own
    routed = k * np.asarray(load)
    experts = (4 * d * (routed + model.moe_shared_experts) * f + (routed + 2 * k) * h * d + 28 * k) * moe_token_share(t, sp)
    router = (8 * model.moe_experts + 12 * k + 4) * np.where(megatron, moe_token_share(t, sp), 1)
    dense_ffn = np.where(recompute == RECOMPUTE.index("op"), d * (model.ffn_hidden / t + h - h / np.where(sp, t, 1)),
                         4 * d * model.ffn_hidden / t)
    return _scalar_or_array(np.where(recompute == RECOMPUTE.index("full"), 0,
                                     tokens * (experts + router + gathered - dense_ffn)))


def _moe_gathered_bytes(model: ModelConfig, t, sp, d, expert_tp=0, load=1.0):
    """Per token, under SP: the gathered sequence the router reads, in place of the norm's output
    shard, unless the shared experts keep that (they read this rank's positions). On
    Megatron-Core's grid (``expert_tp`` ≥ 1) the router reads this rank's positions, and split
    experts (``expert_tp`` > 1) keep the k dispatched rows of every tp rank's positions, gathered:
    k·h a token, less this rank's share."""
    shard = np.where(model.moe_shared_experts > 0, 0, model.hidden * d / t)
    engine = np.where(sp, model.hidden * d - shard, 0)
    routed = model.moe_top_k_experts * np.asarray(load)  # the busiest rank's share (``routed_load``)
    split = np.where(np.asarray(expert_tp) > 1, d * routed * model.hidden * (1 - 1 / t), 0)
    return np.where(np.asarray(expert_tp) >= 1, split, engine)


def moe_weight_input_bytes(model: ModelConfig, tokens, tp, sequence_parallel, recompute,
                           dtype_bytes: int = ACTIVATION_BYTES, expert_tp=0, load=1.0):
    """Of what an MoE block saves beyond a dense one (``moe_activation_bytes``), the part a split
    backward keeps from B to W, beyond the dense block's ``weight_input_bytes``: the experts'
    inputs, the k permuted rows of h (read by gate and up) and the (k + S) SwiGLU products of f_e
    (read by w_down), of ``moe_token_share`` of the tokens, in place of the dense w_down's input
    (f/tp); under SP the gathered sequence the router reads, in place of the norm's shard. Released at B: the
    router's scores and choices, the SwiGLU internals, the combine's rows. Nothing is released
    under op-level or full recomputation (``weight_input_bytes``)."""
    d, k, h = dtype_bytes, model.moe_top_k_experts, model.hidden
    t, sp = np.asarray(tp), np.asarray(sequence_parallel, dtype=bool)
    routed = k * np.asarray(load)  # the rows this rank's experts run (``moe_activation_bytes``)
    experts = (d * routed * h + d * (routed + model.moe_shared_experts) * model.moe_ffn_hidden) * moe_token_share(t, sp)
    kept = tokens * (experts + _moe_gathered_bytes(model, t, sp, d, expert_tp, load) - d * model.ffn_hidden / t)
    recompute = _recompute_index(recompute)
    checkpointed = (recompute == RECOMPUTE.index("full")) | (recompute == RECOMPUTE.index("op"))
    return _scalar_or_array(np.where(checkpointed, moe_activation_bytes(model, tokens, tp, sequence_parallel, recompute,
                                                                        d, expert_tp, load), kept))


def captured_gradient_bytes(model: ModelConfig, tokens, tp, sequence_parallel, dtype_bytes: int = ACTIVATION_BYTES,
                            residual_bytes: int = 4, expert_tp=0, load=1.0):
    """What a schedule that splits the backward (ZB-H1, DualPipeV) keeps from a micro-batch's B to
    its W, on one tp rank: the gradient arriving at each product and norm whose weight W will
    differentiate (parallel/pipeline/runtime.backward_input; torch.distributed.pipelining keeps
    the same). Autograd saves none of them, so they are not activations. Returns bytes for
    ``tokens`` (dense block, MoE block, head, embedding):

      a dense block: the output gradients of q, k, v, gate and up (a GPT block: its first
        feed-forward product in place of gate and up) (their tp shards, of the whole
        sequence, gathered under SP), of the attention's and the feed-forward's output (a tp
        rank's partial sum), in the products' ``dtype_bytes``; and of its two RMSNorms, fp32
        (the norm multiplies in fp32), of the rank's tokens (1/tp of them under SP);
      an MoE block: the router's fp32 logits (of the whole sequence) and the gate, up and output
        rows of its k routed and its shared experts (of ``moe_token_share`` of it) in place of
        the dense feed-forward's; on Megatron-Core's grid (``expert_tp`` ≥ 1) the router's of
        this rank's positions, the shared experts' output whole (a tp MLP's partial sum), and
        split experts' (``expert_tp`` > 1) output rows of the tp group's gathered rows; the
        routed experts' rows ``load`` times a balanced rank's (``routed_load``);
      the head: the final norm's (fp32) and the logits' (the vocabulary's tp shard, padded);
      the embedding: its output's, the first stage's input gradient, of the ``residual_bytes``
        stream."""
    d, h = dtype_bytes, model.hidden
    q, kv = attention_width(model)
    t = np.asarray(tp)
    rank_tokens = tokens / np.where(np.asarray(sequence_parallel, dtype=bool), t, 1)
    shared = 2 * rank_tokens * h * 4 + tokens * d * ((q + 2 * kv) / t + h)  # norms and attention
    products = 1 if model.arch == "gpt" else 2  # GELU's one product into the feed-forward, SwiGLU's gate and up
    dense = shared + tokens * d * (products * model.ffn_hidden / t + h)
    moe = 0 * dense
    if model.moe_experts:
        routed = model.moe_top_k_experts * np.asarray(load)
        experts = routed + model.moe_shared_experts
        share = moe_token_share(t, sequence_parallel)
        rows = share * d * experts * (2 * model.moe_ffn_hidden + h)
        moe = shared + tokens * (4 * model.moe_experts + rows)
        etp = np.asarray(expert_tp)
        whole_rows = model.moe_shared_experts + np.where(etp > 1, routed, 0)
        megatron = moe + tokens * (d * h * (1 - 1 / t) * whole_rows - 4 * model.moe_experts * (1 - share))
        moe = np.where(etp >= 1, megatron, moe)
    head = rank_tokens * h * 4 + tokens * d * padded_vocab(model.vocab_size, t) / t
    return tuple(_scalar_or_array(x) for x in (dense, moe, head, rank_tokens * h * residual_bytes))


def autocast_activation_bytes(model: ModelConfig, tokens, tp, sequence_parallel, recompute, tp_overlap=False,
                              moe=False, ep=1, dtype_bytes: int = 2, residual_bytes: int = 4, expert_tp=0):
    """What one block of the engine's bf16 runs (fp32 weights under torch.autocast,
    ``ENGINE_BYTES``) saves for backward beyond ``block_activation_bytes`` at ``dtype_bytes``
    (and, for an MoE block (``moe``), ``moe_activation_bytes``), on one tp rank for a micro-batch
    of ``tokens`` tokens, as the saved-tensor meter measures it. With d = dtype_bytes and
    r = residual_bytes:

      A norm's output is the fp32 stream's dtype. Under SP a column-parallel product saves its
        input shard, fp32: (r − d)·h/t per norm. Without SP (and at tp 1) each product casts
        it to bf16 and saves its own copy: q, k and v three, gate and up two, (2 + 1)·d·h beyond
        one shared output. An MoE block's router reads it in fp32 (under SP the gathered
        sequence; moe_activation_bytes already leaves the shard out): (r − d)·h.
      Autocast casts a product's weight to bf16 once per forward, and the product keeps that copy
        until its backward: d · the block's matrices / t per micro-batch in flight without SP;
        under SP the two row-parallel ones (wo, w_down), since a column-parallel product saves
        the fp32 weight, a parameter; none with tp_overlap, whose products save the parameters.
        An MoE block copies its E/ep experts' three matrices and its shared experts' (whose gate
        and up also cast the input: 2·d·h per token). With the experts folded over tp under SP
        (``expert_tp`` ≥ 1, tensor_parallel.FoldedMoE) the router reads this rank's positions,
        the very fp32 shard the shared experts' column-parallel products save, and the shared
        experts copy their row-parallel weight alone, as a dense MLP.
      An MoE block's combine weights the experts' rows in fp32: it saves their fp32 copy and the
        weighted rows, 8 bytes an element where 16-bit rows would be 2·d: k·h·(8 − 2d) per token.
    Full recomputation keeps only the block's input, of the fp32 stream, (r − d)·h/seq_split per
    token, and no copies; selective changes nothing here (q, k and v are bf16 either way).
    Works elementwise on numpy arrays of the sizes (``recompute`` a name or indices)."""
    h, f, d, r = model.hidden, model.ffn_hidden, dtype_bytes, residual_bytes
    q, kv = attention_width(model)
    t = np.asarray(tp)
    sp = np.asarray(sequence_parallel, dtype=bool)
    rows = np.asarray(tp_overlap, dtype=bool)  # tp_overlap: no weight copies in the tp products
    attention_outputs = np.where(sp, (r - d) * h / t, 2 * d * h)
    attention_copies = np.where(rows, 0, q * h + np.where(sp, 0, h * q + 2 * h * kv)) * d / t
    if moe:
        k, f_e, shared = model.moe_top_k_experts, model.moe_ffn_hidden, model.moe_shared_experts
        # the router's fp32 input (whole), the experts' rows and the shared experts' casts (its share)
        ffn_outputs = (r - d) * h + (k * h * (8 - 2 * d) + 2 * d * h * (shared > 0)) * moe_token_share(t, sp)
        ffn_copies = (model.moe_experts / np.asarray(ep) + shared) * 3 * h * f_e * d
        folded = (np.asarray(expert_tp) >= 1) & sp & (t > 1)  # the router's input a shard, the shared a tp MLP
        ffn_outputs = np.where(folded, ((r - d) * h + k * h * (8 - 2 * d)) / t, ffn_outputs)
        ffn_copies = np.where(folded, model.moe_experts / np.asarray(ep) * 3 * h * f_e * d
                              + np.where(rows, 0, shared * f_e * h * d / t), ffn_copies)
    else:
        ffn_outputs = np.where(sp, (r - d) * h / t, d * h)
        ffn_copies = np.where(rows, 0, f * h + np.where(sp, 0, 2 * f * h)) * d / t
    kept = tokens * (attention_outputs + ffn_outputs) + attention_copies + ffn_copies
    checkpoint = tokens * (r - d) * h / np.where(sp, t, 1)
    return _scalar_or_array(np.where(_recompute_index(recompute) == RECOMPUTE.index("full"), checkpoint, kept))


def bubble_fraction(schedule, pp, microbatches, virtual_stages=1, shares=None):
    """Idle fraction of a pipeline step at uniform stage costs: each schedule's closed form from
    the registry (threefold/parallel/pipeline/schedule.py), 0 without a pipeline. ``schedule`` is
    an index into SCHEDULES (or an array of them) or a name. ``shares``: a slot's (F, B, W), B the
    input gradient alone (``backward_shares``), for the schedules whose bubble depends on them
    (ZB-H1); None: F = B = W."""
    if isinstance(schedule, str):
        schedule = _index(SCHEDULES, schedule, "--schedule")
    return _scalar_or_array(_per_schedule("bubble", schedule, pp, microbatches, virtual_stages, single=0.0,
                                          shares=shares))


def _per_schedule(form: str, schedule, p, m, v, single: float, shares=None):
    """The registry's closed form ``form`` of each layout's schedule, over arrays of layouts;
    ``single`` where pp = 1 (no pipeline). Each schedule's form is evaluated only on its rows."""
    shares = () if shares is None else tuple(np.asarray(x, dtype=float) for x in shares)
    schedule, p, m, v, *shares = np.broadcast_arrays(np.asarray(schedule), np.asarray(p, dtype=float),
                                                     np.asarray(m, dtype=float), np.asarray(v, dtype=float), *shares)
    out = np.full(schedule.shape, float(single))
    for index, spec in enumerate(SCHEDULE_REGISTRY.values()):
        rows = (schedule == index) & (p > 1)
        if not rows.any():
            continue
        if form == "bubble" and shares and spec.bubble_at_shares is not None:
            out[rows] = spec.bubble_at_shares(p[rows], m[rows], v[rows], tuple(x[rows] for x in shares))
        else:  # a schedule that never flushes: a step in the middle of the run (it fills once)
            out[rows] = getattr(spec.steady or spec, form)(p[rows], m[rows], v[rows])
    return out


def backward_shares(gemm_s, core_s, memory_s, total_s):
    """A slot's (F, B, W) shares, B the input gradient alone, from its parts' seconds (a stage's
    ``part_seconds``, added up): ``gemm_s`` its products forward and backward (3× the forward's),
    ``core_s`` the attention cores' forward, ``memory_s`` the memory-bound kernels, ``total_s`` all
    of its compute. A product's weight gradient is one product of the forward's shape, so W is a
    third of the products; the forward runs the products once, the cores, and a third of the
    memory-bound passes (a norm's or SwiGLU's backward reads and writes about twice its forward's
    bytes); the input gradient is the rest: the products' input gradients, the cores' backward
    (twice their forward), any recomputation. On this CPU's tiny model, measured: 46 : 62 : 39 ms."""
    weight = gemm_s / 3 / total_s
    forward = (gemm_s / 3 + core_s + memory_s / 3) / total_s
    return forward, 1 - forward - weight, weight


def weight_versions(schedule, pp, stage):
    """(versions of its weights, staleness in updates) that pipeline stage ``stage`` holds: 1 and 0
    for the schedules that flush, the registry's for 2bw and pipedream (over arrays of layouts)."""
    schedule, p, stage = np.broadcast_arrays(np.asarray(schedule), np.asarray(pp, dtype=float),
                                             np.asarray(stage, dtype=float))
    versions, staleness = np.zeros(schedule.shape), np.zeros(schedule.shape)
    for index, spec in enumerate(SCHEDULE_REGISTRY.values()):
        rows = (schedule == index) & (p > 1)
        if rows.any() and spec.weight_versions is not None:
            versions[rows] = spec.weight_versions(stage[rows], p[rows])
            staleness[rows] = spec.delay(stage[rows], p[rows]) - 1
    return versions, staleness


def layer_products(cfg: ModelConfig, tp) -> list[tuple]:
    """(K, N) of each matrix product of one block's forward on one tp rank, as the engine (llama:
    separate wq, wk, wv; SwiGLU's gate, up, down) or Megatron (gpt: fused QKV; fc1, fc2) runs them;
    M is the micro-batch's tokens."""
    h, f = cfg.hidden, cfg.ffn_hidden
    q, kv = attention_width(cfg)
    if cfg.arch == "llama":
        return [(h, q / tp), (h, kv / tp), (h, kv / tp), (q / tp, h), (h, f / tp), (h, f / tp), (f / tp, h)]
    return [(h, (q + 2 * kv) / tp), (q / tp, h), (h, f / tp), (f / tp, h)]


def op_saved_products(cfg: ModelConfig, tp) -> list[tuple]:
    """(K, N) of the products whose outputs op-level SAC keeps: the 1st, 3rd, … of a block's
    forward in order (torchtitan's policy counts ``aten.mm`` calls and saves all but every
    second): Llama wq, wv, w_gate, w_down; GPT the fused QKV and fc1."""
    return layer_products(cfg, tp)[0::2]


def op_recomputed_products(cfg: ModelConfig, tp, attention_only: bool = False) -> list[tuple]:
    """(K, N) of the products op-level SAC runs again in the backward, the 2nd, 4th, …: Llama
    wk, wo, w_up; GPT wo, fc2. ``attention_only``: of an MoE block, its attention's (wk, wo);
    its feed-forward is taken as kept whole (the 2024 policy predates MoE blocks)."""
    products = layer_products(cfg, tp)
    return (products[:4] if attention_only and cfg.arch == "llama" else products)[1::2]


def matmul_seconds(m, k, n, gpu, dtype_bytes: int = ACTIVATION_BYTES, float8: bool = False):
    """Seconds of one (m×k)·(k×n) product: a smooth roofline. Its arithmetic time 2mkn / (peak ·
    matmul efficiency) and its memory time (reading both operands, writing the result) / (HBM
    bandwidth · HBM efficiency) add as the sides of a right triangle, √(t_math² + t_memory²):
    far above the GPU's FLOP/byte ridge a product runs at the large-GEMM rate, at the ridge at
    1/√2 of it, below it at the memory's rate (the roofline of Williams et al. 2009, its corner
    rounded as measured GEMM efficiency curves are).

    ``float8``: the operands are fp8 (one byte each, the result ``dtype_bytes``) and the product
    runs at the GPU's fp8 peak, at the same fraction of it as a 16-bit product of its own."""
    if float8 and gpu.peak_flops_fp8 is None:
        raise ConfigError(f"--dtype: no float8 peak known for {gpu.name}")
    peak = gpu.peak_flops_fp8 if float8 else gpu.peak_flops
    operand_bytes = 1 if float8 else dtype_bytes
    math = 2.0 * m * k * n / (peak * gpu.matmul_efficiency)
    memory = (operand_bytes * (m * k + k * n) + dtype_bytes * m * n) / (gpu.hbm_bw * gpu.hbm_efficiency)
    return np.sqrt(math * math + memory * memory)


def part_seconds(work: Workload, layout: Layout, gpu) -> dict:
    """Seconds of one micro-batch's forward and backward through each part of the model on one
    rank of ``layout``, as ``estimate`` adds them up per stage: ``block`` (a dense block),
    ``moe_block`` (an MoE block, for an MoE model) and ``head`` (the output products and the
    loss), each ``{"math", "gemm", "memory"}``: its products and attention core, recomputation
    included (math); its products alone, forward and backward (gemm: what tp overlap hides
    behind); its memory-bound kernels (memory). ``core``: one layer's attention-core forward. The
    embedding, a lookup, costs nothing in this model. Sizes may be numpy arrays of layouts.

    Each matrix product is timed by its own shape (``matmul_seconds``): a thin tp shard or a
    small hidden size runs below the large-GEMM rate. A product's backward is two products of
    the same shape (input and weight gradients), so a layer costs 3× its forward products."""
    cfg = work.model
    h, s, V = cfg.hidden, cfg.seq_len, _require_vocab(cfg)
    q, _ = attention_width(cfg)
    t, c, e, b = (np.asarray(x) for x in (layout.tp, layout.cp, layout.ep, layout.micro_batch))
    sp, recompute = np.asarray(layout.sequence_parallel, dtype=bool), _recompute_index(layout.recompute)
    full, selective = recompute == RECOMPUTE.index("full"), recompute == RECOMPUTE.index("selective")
    op = recompute == RECOMPUTE.index("op")
    tokens = b * s / c  # tokens of one micro-batch on one rank, before TP
    rows = tokens  # the products see the whole micro-batch (sequence parallelism gathers it first)
    a_bytes = work.activation_bytes
    hbm = gpu.elementwise_rate  # the memory-bound kernels' bytes/s
    coef = activation_coefficients(cfg, work.attention, a_bytes)
    attention_executed = 4 * s * q * (0.5 if work.attention == "flash" else 1.0)  # flash skips the causal half
    # a fused attention kernel's rate (hardware.GPU.attention_efficiency); eager attention's core
    # is two batched products and a softmax, at the GEMM rate
    fused = gpu.attention_efficiency if work.attention == "flash" else 1.0
    attention_rate = gpu.peak_flops * gpu.matmul_efficiency * fused
    core_s = tokens / t * attention_executed / attention_rate  # one layer's forward
    recomputed_core = np.where(selective, 0.5 * tokens * coef["core"] / t, 0)  # selective: the core's tensors again

    float8 = work.precision == "fp8"  # the blocks' products in fp8, the head's and the router's in 16 bits
    # A weight's fp8 copy: Transformer Engine casts it in the step's first micro-batch and reuses
    # it (Megatron's forward_step calls set_is_first_microbatch), so a micro-batch pays 1/m of the
    # cast; under ZeRO-3 each micro-batch gathers the weights anew and casts them anew (torchao's
    # Float8Linear under FSDP2), in a recomputed forward too.
    microbatches = work.global_batch / (np.asarray(layout.dp) * b)
    gathered = np.asarray(layout.zero) == 3

    def block(gemm_s, saved, op_gemm_s, casts=(0.0, 0.0, 0.0)):
        """A block whose forward products take ``gemm_s`` and which saves ``saved`` bytes without recomputation:
        full recomputation runs its forward again (and its tensors' traffic half again); op-level
        SAC runs every memory-bound operator of the forward again, as full does, but of the
        products only those it does not save (``op_gemm_s``) and not the attention core.
        ``casts``: the float8 casts' seconds: the inputs' in the forward, the gradients' in the
        backward, and the weights' (``cast_seconds``)."""
        again = full | op  # the forward's memory-bound operators run twice
        math = 3 * (gemm_s + core_s) + np.where(full, gemm_s + core_s, np.where(selective, core_s,
                                                                                 np.where(op, op_gemm_s, 0)))
        memory = ELEMENTWISE_PASSES * (saved * np.where(again, 1.5, 1.0) + recomputed_core) / hbm
        weight_casts = casts[2] * np.where(gathered, np.where(again, 2, 1), 1 / microbatches)
        memory = memory + casts[0] * np.where(again, 2, 1) + casts[1] + weight_casts
        # a CPU's fixed cost per block and micro-batch (0 on a GPU); a recomputed forward's again
        memory = memory + gpu.block_overhead_s * np.where(again, 4 / 3, 1.0)
        return {"math": math, "gemm": 3 * gemm_s, "memory": memory}

    def products_s(products, m=rows):
        return sum(matmul_seconds(m, k, n, gpu, a_bytes, float8) for k, n in products)

    def cast_seconds(products, m=rows):
        """The float8 casts of products of ``m`` rows, at FLOAT8_CAST_BYTES an element: (the
        inputs in the forward, the outputs' gradients in the backward, the weights); 0 without float8."""
        if not float8:
            return 0.0, 0.0, 0.0
        return (sum(FLOAT8_CAST_BYTES * m * k for k, _ in products) / hbm,
                sum(FLOAT8_CAST_BYTES * m * n for _, n in products) / hbm,
                sum(FLOAT8_CAST_BYTES * k * n for k, n in products) / hbm)

    layer_gemm_s = products_s(layer_products(cfg, t))
    layer_all = block_activation_bytes(cfg, tokens, t, sp, "none", work.attention, a_bytes)
    head_gemm_s = matmul_seconds(rows, h, V / t, gpu, a_bytes)
    parts = {"block": block(layer_gemm_s, layer_all, products_s(op_recomputed_products(cfg, t)),
                            cast_seconds(layer_products(cfg, t))), "core": core_s,
             # the loss's passes over this rank's logits (PRECISIONS' loss_pass_bytes)
             "head": {"math": 3 * head_gemm_s, "gemm": 3 * head_gemm_s,
                      "memory": tokens * work.loss_pass_bytes * V / t / hbm}}
    if cfg.moe_experts:
        # An MoE block: the attention's products (over tp); the router, whole on every tp rank
        # and on the micro-batch's whole sequence; then, on this rank's share of the tokens
        # (moe_token_share: its own positions under SP, all of them without), the shared experts
        # and this rank's E/ep experts, each on its share of the T·k rows the dispatch brings
        # (balanced routing: T·k·ep/E rows each). The same 3× for backward as any product.
        # On Megatron-Core's grid (expert_tp ≥ 1) the router reads this rank's positions only, the
        # shared experts run as a dense MLP over tp (every position, 1/t of each matrix), and split
        # experts (expert_tp > 1) run the tp group's dispatched rows on 1/expert_tp of each matrix:
        # the same FLOPs, in other shapes.
        k, f_e, shared = cfg.moe_top_k_experts, cfg.moe_ffn_hidden, cfg.moe_shared_experts
        placed = np.where(np.asarray(layout.expert_tp) >= 1, layout.expert_tp, 0)
        expert_split, shared_split = np.maximum(placed, 1), np.where(placed >= 1, t, 1)
        attention = layer_products(cfg, t)[:4]
        shared_experts = ([(h, shared * f_e / shared_split)] * 2 + [(shared * f_e / shared_split, h)]
                          if shared else [])
        expert = [(h, f_e / expert_split), (h, f_e / expert_split), (f_e / expert_split, h)]
        moe_rows = rows * moe_token_share(t, sp)
        load = routed_load(work, e)  # the busiest ep rank's rows: every rank waits for it at the combine
        expert_rows = moe_rows * k * e / cfg.moe_experts * expert_split * load
        local_experts = cfg.moe_experts / e
        router_rows = np.where(placed >= 1, moe_rows, rows)
        moe_gemm_s = (products_s(attention) + products_s(shared_experts, moe_rows * shared_split)
                      + matmul_seconds(router_rows, h, cfg.moe_experts, gpu, a_bytes)
                      + local_experts * products_s(expert, expert_rows))
        dense_casts = tuple(a + x for a, x in zip(cast_seconds(attention),
                                                  cast_seconds(shared_experts, moe_rows * shared_split)))
        expert_casts = cast_seconds(expert, expert_rows)
        moe_casts = tuple(d + local_experts * x for d, x in zip(dense_casts, expert_casts))
        moe_all = moe_activation_bytes(cfg, tokens, t, sp, "none", a_bytes, placed, load)
        parts["moe_block"] = block(moe_gemm_s, layer_all + moe_all,
                                   products_s(op_recomputed_products(cfg, t, attention_only=True)), moe_casts)
    return parts


def in_one_node(group_span, gpus_per_node):
    """Whether every group of ``group_span`` consecutive ranks lies in one node: it fits in one,
    and the node holds whole groups (tp 4 on nodes of 6 would put ranks 4-7 on two nodes, whose
    collectives then cross the network and hold up the step)."""
    return (group_span <= gpus_per_node) & (gpus_per_node % group_span == 0)


def members_in_node(gpus_per_node, *dims):
    """How many members of a group one node holds: the group spans grid dimensions given as
    (stride, size), innermost first, and a node is ``gpus_per_node`` consecutive ranks. A dimension
    whose stride is a node or more has one member in it."""
    members = 1
    for stride, size in dims:
        members = members * np.clip(gpus_per_node // stride, 1, size)
    return members


def all_reduce_call_latency(gpu, ranks, members_per_node, ring_step_latency):
    """Seconds of latency of one all-reduce over ``ranks`` ranks, ``members_per_node`` of them in
    each node: the ring's 2(n − 1) steps, or across nodes NCCL's double binary tree where that is
    shorter (NCCL picks the faster by the same latency model: src/graph/tuning.cc), up and down a
    chain through the node's members and log2(nodes) network hops. Equal to the ring in one node."""
    k = np.minimum(np.maximum(members_per_node, 1), ranks)
    nodes = np.maximum(ranks / k, 1)
    ring = 2 * (ranks - 1) * ring_step_latency
    tree = 2 * (np.log2(nodes) * gpu.inter_node_latency_s + (k - 1) * gpu.intra_node_latency_s)
    return np.where(nodes > 1, np.minimum(ring, tree), ring)


def bucket_params(work: Workload, replicas):
    """Parameters in one gradient bucket: the workload's, or Megatron-Core's default for
    ``replicas`` ranks, max(40M, 1M × replicas)."""
    if work.bucket_params is not None:
        return work.bucket_params
    return np.maximum(BUCKET_PARAMS, BUCKET_PARAMS_PER_REPLICA * replicas)


def _data_parallel(numel, replicas, zero, m, stage_layers, work: Workload, bw, latency, backward_s, forward_s, mb_s,
                   drain_s, gpu, intra, wait=0.0, also: dict | None = None, root_numel=0, unit_numel=0,
                   head=True, embedding=True, members_per_node=1, between: dict | None = None) -> dict:
    """Bytes, seconds and exposed seconds of one stage's data-parallel traffic (and ZeRO's gathers).

    DDP and ZeRO-1/2 work in gradient buckets; ZeRO-3 gathers and reduce-scatters block by block
    (FSDP's unit). A reduction happens once per step, or per micro-batch (ZeRO-2/3). Overlap, as
    the engines run it: a reduction runs during the backward that produces it (and the pipeline
    drain after it), parameters gather during the first micro-batch's forward, except one bucket
    each; ZeRO-3 prefetches the next block while computing this one, so only what exceeds each
    micro-batch's compute is exposed, and what nothing computes behind (``zero3_unhidden``).

    ``also``: another group's result whose traffic shares the link and the same compute (an MoE
    model's expert states, reduced over their own replicas): bytes and seconds are the sum, and
    the exposure is that of both groups' reductions and gathers behind the one backward and forward.
    ``gpu``, ``intra``, ``wait``: the GPU, whether the group is inside a node, and each call's
    wait for members off their core (a GPU may time each kind of collective by its own measured
    line: ``_collective_time``). ``root_numel``: the stage's parameters outside its blocks (the
    embedding, the final norm and head), gathered as one unit; ``unit_numel``: one block's;
    ``head``, ``embedding``: whether the stage computes them. ``members_per_node``: the group's
    ranks in one node (DDP's all-reduce may take NCCL's tree across nodes: ``all_reduce_call_latency``).
    ``between``: hybrid sharding, where ``replicas`` is one shard group: ``groups`` of them hold the
    same shards, and each unit's reduced shard is all-reduced between them over their link
    (``bw``, ``latency``, ``members_per_node``, ``intra``, ``wait``), behind the backward as the
    reduce-scatters are; the last one after the last reduce-scatter."""
    share = (replicas - 1) / replicas
    sent = dp_bytes_per_step(numel, replicas, zero, m, work.grad_bytes, work.param_bytes)
    gather_bytes = np.where(zero == 0, 0, np.where(zero == 3, 2 * m, 1) * share * numel * work.param_bytes)
    buckets = np.where(zero == 3, stage_layers + 1, np.maximum(1, np.ceil(numel / bucket_params(work, replicas))))
    reductions = np.where(zero >= 2, m, 1) * buckets
    gathers = np.where(zero == 0, 0, np.where(zero == 3, 2 * m, 1) * buckets)
    # DDP all-reduces the gradients; ZeRO reduce-scatters them and all-gathers the parameters.
    grad_bytes = sent - gather_bytes
    grad_s = np.where(zero == 0,
                      _collective_time(gpu, ("all_reduce",), grad_bytes, reductions, 1, bw,
                                       all_reduce_call_latency(gpu, replicas, members_per_node, latency), intra, wait),
                      _collective_time(gpu, ("reduce_scatter",), grad_bytes, reductions, replicas - 1, bw, latency, intra,
                                       wait))
    gather_s = _collective_time(gpu, ("all_gather",), gather_bytes, gathers, replicas - 1, bw, latency, intra, wait)
    seconds = np.where(replicas > 1, grad_s + gather_s, 0)
    one_collective_s = grad_s / reductions
    active = replicas > 1
    # the calls this rank makes: this group's, and the other group's (``also``) beside them
    if between is not None:  # hybrid sharding: the reduced shards all-reduced between the groups
        groups = between["groups"]
        times = np.where(zero == 3, m, 1)  # ZeRO-3: each micro-batch's; ZeRO-1, 2: the step's, once
        between_bytes = np.where(zero >= 1, hsdp_all_reduce_bytes(numel, replicas, groups, times, work.grad_bytes), 0)
        between_calls = np.where((zero >= 1) & (groups > 1), times * buckets, 0)
        between_latency = all_reduce_call_latency(gpu, groups, between["members_per_node"], between["latency"])

        def between_time(nbytes, calls):
            return np.where(between_calls > 0, _collective_time(gpu, ("all_reduce",), nbytes, calls, 1, between["bw"],
                                                                between_latency, between["intra"], between["wait"]), 0)
        between_s = between_time(between_bytes, between_calls)
        # the last unit reduced: the root where the stage holds the embedding, else the first block;
        # ZeRO-1, 2: a bucket
        last_unit = np.where(zero == 3, np.where(embedding & (np.asarray(root_numel) > 0), root_numel, unit_numel),
                             numel / buckets)
        between_last_s = between_time(hsdp_all_reduce_bytes(last_unit, replicas, groups, 1, work.grad_bytes), 1)
        sent, seconds, grad_s = sent + between_bytes, seconds + between_s, grad_s + between_s
        reductions = reductions + between_calls
        # ZeRO-1, 2: the last bucket's all-reduce follows its reduce-scatter, behind nothing
        one_collective_s = np.where(zero == 3, one_collective_s, one_collective_s + between_last_s)
    calls = np.where(replicas > 1, reductions + gathers, 0) + (0 if also is None else also["calls"])
    parts = {"grad_s": grad_s, "gather_s": gather_s, "one_s": one_collective_s, "active": active, "calls": calls}
    if also is not None:  # a group without replicas sends nothing: its grad_s and gather_s are 0
        sent, seconds, active = sent + also["bytes"], seconds + also["seconds"], active | also["active"]
        grad_s, gather_s = grad_s + also["grad_s"], gather_s + also["gather_s"]
        one_collective_s = np.maximum(one_collective_s, also["one_s"])
    # Nothing is exposed beyond its own seconds: where the collectives outlast the compute, the
    # exposure is all of them, as without overlap.
    per_step = (np.minimum(grad_s, np.where(zero == 2, m * np.maximum(0, grad_s / m - backward_s) + one_collective_s,
                                            np.maximum(grad_s - backward_s - drain_s, one_collective_s)))
                + np.where(zero == 0, 0, np.minimum(gather_s, np.maximum(gather_s - forward_s, one_collective_s))))
    first_s, last_reduce_s = zero3_unhidden(root_numel, unit_numel, head, embedding, replicas, work, bw, latency, gpu,
                                            intra, wait)
    if between is not None:  # the last unit's all-reduce between the groups follows its reduce-scatter
        last_reduce_s = last_reduce_s + between_last_s
    if also is not None:
        first_s, last_reduce_s = first_s + also["first_s"], np.maximum(last_reduce_s, also["last_reduce_s"])
    # ZeRO-3, per micro-batch: the unhidden units' collectives, and what of the rest (the step's
    # seconds less those and the last reduce-scatter) outlasts the micro-batch's compute
    hideable_s = np.maximum(0, (seconds - last_reduce_s) / m - first_s)
    block_wise = np.minimum(seconds, m * (first_s + np.maximum(0, hideable_s - mb_s)) + last_reduce_s)
    return {"bytes": sent, "seconds": seconds, **parts, "first_s": first_s, "last_reduce_s": last_reduce_s,
            "exposed": np.where(active, np.where(zero == 3, block_wise, per_step), 0)}


def zero3_unhidden(root_numel, unit_numel, head, embedding, replicas, work: Workload, bw, latency, gpu, intra, wait=0.0):
    """ZeRO-3's collectives that nothing computes behind, as parallel/fsdp.py runs them: (seconds
    per micro-batch, seconds once per step). Per micro-batch, in the forward, the root unit's gather
    (the stage's embedding, final norm and head), then the first block's, started once the root is
    in and hidden by nothing but the embedding's lookup; in the backward the root's again and, on
    a stage without the head (whose backward hides the prefetch), the last block's; and where the
    stage holds the embedding, whose backward is a scatter-add of no weight, the first block's
    reduce-scatter, which the root's gradient waits for. Once per step: the last reduce-scatter
    (the root's where it holds the embedding, else the first block's), with nothing after it. A
    stage without a root has only its blocks: the first one's gather in the forward, the last one's
    in the backward."""
    share = (replicas - 1) / replicas
    root_numel, unit_numel = np.asarray(root_numel, dtype=float), np.asarray(unit_numel, dtype=float)

    def collective(kind, numel, nbytes):
        return np.where(numel > 0, _collective_time(gpu, (kind,), share * numel * nbytes, 1, replicas - 1, bw, latency,
                                                     intra, wait), 0)
    root_gather, unit_gather = (collective("all_gather", n, work.param_bytes) for n in (root_numel, unit_numel))
    root_reduce, unit_reduce = (collective("reduce_scatter", n, work.grad_bytes) for n in (root_numel, unit_numel))
    per_microbatch = 2 * root_gather + unit_gather + np.where(head, 0, unit_gather) + np.where(embedding, unit_reduce, 0)
    return per_microbatch, np.where(embedding & (root_numel > 0), root_reduce, unit_reduce)


def _ring_time(bytes_sent, steps, link_bw, latency):
    """Seconds for a ring collective: latency per step plus the bytes each rank sends over the link."""
    return steps * latency + bytes_sent / link_bw


def call_wait(gpu, runnable):
    """Seconds each collective call or pipeline message waits for members off their core, with
    ``runnable`` workers computing on the node: the GPU's measured points (a CPU's: more workers
    than cores wait for the scheduler), linear between them and beyond the last; 0 on a GPU."""
    return _between_points(gpu.collective_waits, runnable)


def call_cpu(gpu, runnable):
    """CPU seconds a collective call or pipeline message costs its process beyond the compute,
    with ``runnable`` workers computing (calibrate's points; before them, each kind's latency on
    an idle machine, the least a call costs); 0 on a GPU, whose calls run on its own engines."""
    if gpu.call_cpu:
        return _between_points(gpu.call_cpu, runnable)
    if gpu.collectives:
        return np.full(np.shape(runnable), float(np.mean([latency for latency, _ in gpu.collectives.values()])))
    return np.zeros(np.shape(runnable))


def _between_points(points, x):
    """Linear between measured (x, y) points (calibrate writes three or more) and beyond the
    last two; 0 without points."""
    if not points:
        return np.zeros(np.shape(x))
    (w0, s0), (w1, s1) = points[-2:]
    xs, ys = zip(*points)
    beyond = s1 + (s1 - s0) / (w1 - w0) * (np.asarray(x, dtype=float) - w1)
    return np.where(np.asarray(x) > w1, beyond, np.interp(x, xs, ys))


def _harmonic(x):
    """H(x) = 1 + 1/2 + … + 1/x, continued to real x ≥ 1 (its asymptotic series, within 0.7%)."""
    x = np.maximum(np.asarray(x, dtype=float), 1.0)
    return np.log(x) + 0.5772156649 + 1 / (2 * x) - 1 / (12 * x * x)


def call_pair_wait(gpu, runnable):
    """call_wait for calls each made in a pair while every worker computes (calibrate's pair
    points); None where calibrate did not time them (a profile from before 2026-12-05, a GPU)."""
    return _between_points(gpu.collective_pair_waits, runnable) if gpu.collective_pair_waits else None


def group_wait(wait, members, runnable, pair_wait=None):
    """``wait`` (call_wait: what a collective over all ``runnable`` workers waits each call) for
    a group of ``members``: the call waits for the last of its members to reach a core, and with
    each member's delay about exponential the last of n arrives after H(n) delays on average, so
    a group of n waits H(n)/H(runnable) of the whole machine's wait (a tp pair among 8 workers:
    0.55 of it). The calls calibrate times span every worker; the engine's groups do not.

    Where calibrate also timed the calls in pairs (``pair_wait``: call_pair_wait), a pair waits
    that, and a larger group in proportion to H between the pair's and the whole machine's: pairs
    among 8 workers waited 0.40 of the whole, not 0.55, and priced at 0.55 the demo's tp pairs
    came out 37-45% over what they waited in the recordings of 2026-12-04 23:46 and 12-05 04:52."""
    runnable = np.maximum(runnable, 1.0)
    members = np.minimum(np.asarray(members, dtype=float), runnable)
    if pair_wait is None:
        return wait * _harmonic(members) / _harmonic(runnable)
    span = _harmonic(runnable) - _harmonic(2.0)
    share = np.clip((_harmonic(np.maximum(members, 2.0)) - _harmonic(2.0)) / np.where(span > 0, span, 1.0), 0.0, 1.0)
    return np.where(span > 0, pair_wait + (wait - pair_wait) * share, wait)


def _collective_time(gpu, kinds, bytes_sent, calls, steps_per_call, link_bw, latency, intra, wait=0.0):
    """Seconds of ``calls`` collectives of ``kinds`` (one kind, or two in equal shares: SP's
    all-gathers and reduce-scatters) sending ``bytes_sent`` per rank: the ring's time, or inside
    a node whose GPU records a measured line per kind (gloo on a CPU), its latency per call and
    bandwidth, which differ by kind, and ``wait`` per call for members off their core
    (``call_wait``)."""
    ring = _ring_time(bytes_sent, calls * steps_per_call, link_bw, latency)
    if gpu.collectives is None or not all(kind in gpu.collectives for kind in kinds):
        return ring
    per_call = sum(gpu.collectives[kind][0] for kind in kinds) / len(kinds) + wait
    per_byte = sum(1 / gpu.collectives[kind][1] for kind in kinds) / len(kinds)
    return np.where(intra, calls * per_call + bytes_sent * per_byte, ring)


def pipeline_split_time(work: Workload, layout: Layout, stage_layers, stage_layers_modelled, head_s, mb_s,
                        compute_mb_s, p2p_s, m, bubble_speedup, shares=EQUAL_SHARES,
                        first_rank_speedup=None) -> dict:
    """The pipeline's time with the blocks split as ``stage_layers`` (one per model chunk), one
    layout (its costs may be arrays: many GPUs' rates). A block costs what the modelled stage's
    blocks cost each, ``(mb_s − head_s) / stage_layers_modelled`` per micro-batch (its products,
    memory-bound work and exposed tp/cp/ep traffic); the last stage adds the head and loss. A
    slot (one micro-batch through one chunk) also pays its two blocking p2p messages, as in the
    closed form, and its forward, input gradient and weight gradient take ``shares`` of it
    (``backward_shares``; F = B = W for a schedule whose closed form holds only there: DualPipeV).
    The schedule is played on these costs: the busiest rank's compute (``busy_s``) and its idle
    time over ``bubble_speedup``, rank 0's idle time over ``first_rank_speedup`` (None: the same),
    and the busiest rank's and the ranks' mean compute alone per micro-batch (``compute_mb_s``,
    ``mean_compute_mb_s``). At uniform costs this is
    the closed form (the simulated bubble equals the registry's)."""
    from threefold.parallel.pipeline.schedule import build_schedule
    from threefold.plan.simulate import play_costs

    spec = SCHEDULES[int(layout.schedule)]
    p, v = int(layout.pp), int(layout.virtual_stages)
    chunks = SCHEDULE_REGISTRY[spec].stages_per_rank or v
    schedule = build_schedule(spec, p, int(round(float(m))), chunks)
    split = [int(n) for n in stage_layers]
    if len(split) != schedule.num_stages or sum(split) != work.model.layers or min(split) < 1:
        raise ConfigError(f"stage_layers: {split} does not split {plural(work.model.layers, 'block')} over "
                          f"{plural(schedule.num_stages, 'stage')}, each at least one block")
    per_block = (mb_s - head_s) / stage_layers_modelled
    compute_block = (compute_mb_s - head_s) / stage_layers_modelled
    last = schedule.num_stages - 1
    slot = [n * per_block + (head_s if k == last else 0) + 2 * p2p_s for k, n in enumerate(split)]
    compute = [n * compute_block + (head_s if k == last else 0) for k, n in enumerate(split)]
    f, b, w = shares if SCHEDULE_REGISTRY[spec].bubble_at_shares or not schedule.split_backward else EQUAL_SHARES
    makespan, busy = play_costs(schedule, [f * c for c in slot], [(b + w) * c for c in slot], [w * c for c in slot])
    busiest = functools.reduce(np.maximum, busy)
    rank_compute = [sum(compute[k] for k in schedule.stages_of(r)) for r in range(p)]
    return {"busy_s": busiest, "bubble_s": (makespan - busiest) / bubble_speedup,
            "rank0_bubble_s": (makespan - busy[0]) / (bubble_speedup if first_rank_speedup is None
                                                      else first_rank_speedup),
            "compute_mb_s": functools.reduce(np.maximum, rank_compute), "mean_compute_mb_s": sum(rank_compute) / p}


@functools.lru_cache(maxsize=None)
def _expected_slowest(n: int) -> float:
    if n <= 1:
        return 0.0
    x = np.linspace(-9.0, 9.0, 18001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    with np.errstate(divide="ignore"):
        density = n * pdf * np.exp((n - 1) * np.log(cdf))  # the maximum's: n·φ(x)·Φ(x)^(n−1)
    return float(np.trapezoid(x * density, x))


def expected_slowest(num_gpus):
    """E[max of n standard normals] for each n of ``num_gpus``: how many standard deviations of
    one GPU's speed the slowest of n lags the mean (0 for one GPU; 1.42 for 8, 2.59 for 128,
    3.97 for 16,384). A synchronous step waits for its slowest rank (docs/planner.md §4)."""
    n = np.asarray(num_gpus)
    values = {int(k): _expected_slowest(int(k)) for k in np.unique(n)}
    return _scalar_or_array(np.vectorize(values.__getitem__, otypes=[float])(n)) if n.ndim else values[int(n)]


def estimate(work: Workload, layout: Layout, gpu, stage_split: tuple[int, ...] | None = None) -> dict:
    """Memory, communication and time of one training step, for one layout or arrays of them.

    Returns a flat dict of numbers (or arrays); ``report.result_json`` shapes it as JSON. The GPU reported is the one on the busiest pipeline stage (the last, which also
    computes the logits); memory is that of the fuller of the first and last stages.

    ``stage_split``: a pipeline's split as a run chose it (blocks per stage, every model chunk,
    one layout). Without it each stage is priced as the busiest, ceil(L/p) blocks and the head,
    and the bubble is the registry's closed form for uniform stages; with it the schedule is
    played on each stage's own cost (``simulate.play_costs``): the step, the busiest rank's
    compute and every rank's wait follow the split (``pipeline_split_time``), and the step's
    breakdown (compute_s, memory_bound_s, the exposed tp, cp and ep traffic) is the busiest rank's
    time apportioned as the modelled stage's is, so the parts still add up to the step. Memory
    keeps the modelled ceil(L/p) stage.
    """
    cfg = work.model
    L, h, s, V = cfg.layers, cfg.hidden, cfg.seq_len, _require_vocab(cfg)
    q, kv = attention_width(cfg)
    t, p, d, c = (np.asarray(x) for x in (layout.tp, layout.pp, layout.dp, layout.cp))
    zero, b, v = np.asarray(layout.zero), np.asarray(layout.micro_batch), np.asarray(layout.virtual_stages)
    # ZeRO-3 kept gathered through the step is priced as ZeRO-1: the full 16-bit weights and fp32
    # gradients, the states sharded, one reduce-scatter and one all-gather a step, the gathers behind
    # the first micro-batch's forward and the reductions behind the last one's backward
    zero = priced_zero(zero, layout.reshard_after_forward)
    sp, recompute, schedule = (np.asarray(layout.sequence_parallel, dtype=bool), np.asarray(layout.recompute),
                               np.asarray(layout.schedule))
    full = recompute == RECOMPUTE.index("full")
    op = recompute == RECOMPUTE.index("op")
    single_stage = p == 1
    # The registry's placement: DualPipeV's V fixes 2 stages per rank and puts both ends on rank 0.
    fixed_chunks = np.array([spec.stages_per_rank or 0 for spec in SCHEDULE_REGISTRY.values()])[schedule]
    v = np.where(fixed_chunks > 0, fixed_chunks, v)
    v_shape = np.array([spec.placement.ends_on_rank_0 for spec in SCHEDULE_REGISTRY.values()])[schedule] & ~single_stage
    num_gpus = t * p * d * c
    m = work.global_batch / (d * b)  # micro-batches per replica per step
    tokens = b * s / c  # tokens of one micro-batch on one rank, before TP
    stage_layers = np.ceil(L / p)
    seq_split = np.where(sp, t, 1)
    replicas = d * c  # ranks holding the same parameters: ZeRO and gradient reduction run over them
    # Hybrid sharding (--dp-shard): ZeRO shards over groups of dp_shard dp ranks (× cp), the
    # d / dp_shard groups holding the same shards; without it one group of all the replicas.
    shard_dp = np.where((zero >= 1) & (np.asarray(layout.dp_shard) > 0), layout.dp_shard, d)
    shards, groups = shard_dp * c, d / shard_dp
    # Mixture-of-Experts: the blocks with experts on stage 0 (blocks 0 … n−1) and on the last
    # stage (L−n … L−1). As the engine runs them (expert_tp 0) each rank holds E/ep whole experts,
    # the same on every tp rank, their states replicated on dp·cp/ep ranks. On Megatron-Core's
    # expert grid (expert_tp ≥ 1) the t·c·d ranks of a stage are expert_tp × ep × expert-dp, the
    # expert-tp ranks innermost: each holds 1/expert_tp of E/ep experts, their states replicated
    # on t·c·d/(expert_tp·ep) ranks (with expert_tp 1 the tp ranks among them).
    moe = cfg.moe_experts > 0
    e = np.asarray(layout.ep)
    expert_tp = np.asarray(layout.expert_tp)
    megatron_experts = moe & (expert_tp >= 1)
    etp = np.maximum(expert_tp, 1)
    moe_first = moe_blocks_on_rank_0(cfg, L, stage_layers, p, v, v_shape)
    moe_last = moe_layer_count(cfg) - moe_layers_below(cfg, L - stage_layers)
    # the experts' states shard over their own replicas (dp·cp/ep); under hybrid sharding over
    # the dp_shard/ep ranks of a shard group that hold the same experts, all-reduced between groups
    folded = np.where(megatron_experts, t / etp, 1)  # the tp ranks an expert's replicas span
    expert_replicas = np.where(shard_dp < d, shards, replicas) * folded / e
    expert_dp = np.where(shard_dp < d, shard_dp, d) / e  # dp ranks of that group, t·c·ep apart

    # ---- activations (Korthikanti et al. 2022, §4) -------------------------------------------
    coef = activation_coefficients(cfg, work.attention, work.activation_bytes)
    layer_all = block_activation_bytes(cfg, tokens, t, sp, "none", work.attention, work.activation_bytes)
    per_layer = block_activation_bytes(cfg, tokens, t, sp, recompute, work.attention, work.activation_bytes)
    # Micro-batches whose activations the first and the last stage hold at their peak: the
    # schedule's closed forms in the registry; one when there is no pipeline.
    in_flight_first = _per_schedule("in_flight_first", schedule, p, m, v, single=1.0)
    in_flight_last = _per_schedule("in_flight_last", schedule, p, m, v, single=1.0)
    # the block being recomputed during backward: all it saves without recomputation (op: its
    # saved outputs are among them, an upper bound); selective: the attention core it rebuilds,
    # live until that core's backward (eager attention's scores: the larger part at long sequences)
    selective = recompute == RECOMPUTE.index("selective")
    recompute_workspace = np.where(full | op, layer_all, np.where(selective, tokens * coef["core"] / t, 0))
    moe_all = moe_kept = 0  # what an MoE block saves beyond a dense one (moe_activation_bytes)
    load = 1.0  # the busiest ep rank's routed rows over a balanced share (routed_load)
    if moe:
        placed, load = np.where(megatron_experts, expert_tp, 0), routed_load(work, e)
        moe_all = moe_activation_bytes(cfg, tokens, t, sp, "none", work.activation_bytes, placed, load)
        moe_kept = moe_activation_bytes(cfg, tokens, t, sp, recompute, work.activation_bytes, placed, load)
        recompute_workspace = recompute_workspace + np.where(full, moe_all, 0)
    block_act_first = (stage_layers * per_layer + moe_first * moe_kept) * in_flight_first
    block_act_last = (stage_layers * per_layer + moe_last * moe_kept) * in_flight_last
    embedding_act = tokens * coef["embedding"] / seq_split * in_flight_first
    # the final norm's tensors and the fp32 log-probs of each micro-batch the head's stage holds
    # (GPipe: all m; ZB-H1: the norms until W, of min(p, m), the log-probs until B, of one)
    head_norms = _per_schedule("head_in_flight", schedule, p, m, v, single=1.0)
    split = np.array([spec.split_backward for spec in SCHEDULE_REGISTRY.values()])[schedule] & ~single_stage
    logits_act = tokens * (head_norms * coef["norm"] / seq_split + np.where(split, 1, head_norms) * 4 * V / t)
    # A split backward (ZB-H1, DualPipeV) keeps, from a micro-batch's B to its W, only what W reads
    # (weight_input_bytes: B releases the rest, parallel/pipeline/runtime.SavedForW) and the
    # gradients B captured for it (captured_gradient_bytes). Of the n micro-batches in flight at
    # the rank's peak the registry's captured_first/last, c, have run B; with S a micro-batch's
    # bytes before B and K after, the rank holds n·S + (c − 1)·(K − S) with one micro-batch whole
    # (the unit: a chunk under DualPipeV), then either that one past B too (K − S more) or, while
    # its B runs, one block's captured gradients before the block releases what only B reads.
    captured_first = _per_schedule("captured_first", schedule, p, m, v, single=0.0)
    captured_last = _per_schedule("captured_last", schedule, p, m, v, single=0.0)
    cap_dense, cap_moe, cap_head, cap_embedding = captured_gradient_bytes(
        cfg, tokens, t, sp, work.activation_bytes, work.activation_bytes, np.where(megatron_experts, expert_tp, 0), load)
    kept_layer = weight_input_bytes(cfg, tokens, t, sp, recompute, work.attention, work.activation_bytes) + cap_dense
    kept_moe = 0
    if moe:
        kept_moe = (moe_weight_input_bytes(cfg, tokens, t, sp, recompute, work.activation_bytes, placed, load)
                    + cap_moe - cap_dense)

    def split_peak(n, c, saved, kept, during_backward):
        one = np.minimum(c, 1)
        return n * saved + (c - one) * (kept - saved) + np.maximum(one * (kept - saved), during_backward)

    saved_first = stage_layers * per_layer + moe_first * moe_kept + tokens * coef["embedding"] / seq_split
    saved_last = stage_layers * per_layer + moe_last * moe_kept
    # one block's captured gradients while its B runs (an MoE block's where the stage has one), or
    # the head's on its stage: the larger
    in_backward = np.maximum(cap_dense, cap_moe) if moe else cap_dense
    head_first = single_stage | v_shape
    in_backward_first = np.maximum(np.where(moe_first > 0, in_backward, cap_dense), np.where(head_first, cap_head, 0))
    in_backward_last = np.maximum(np.where(moe_last > 0, in_backward, cap_dense), np.where(v_shape, 0, cap_head))
    # The loss's backward, while every block's activations are still held: beside the saved fp32
    # log-probs, their gradient and the logits' gradient (fp32, 8·V/t a token: PyTorch's
    # cross-entropy, log_softmax + nll_loss), and the 16-bit logits, which the training loop still
    # references or whose freed block the caching allocator cannot give to the larger fp32 tensors.
    # It and a recomputed block's workspace are never live at once: the larger counts. Both live
    # only during a backward: under a split one, not at a peak where every micro-batch in flight
    # is past its B (split_peak's other case).
    loss_workspace = tokens * (work.activation_bytes + 8) * V / t
    workspace_first = np.maximum(recompute_workspace, np.where(head_first, loss_workspace, 0))
    workspace_last = np.maximum(recompute_workspace, np.where(v_shape, 0, loss_workspace))
    block_act_first = np.where(split, split_peak(in_flight_first, captured_first, saved_first,
                                                 stage_layers * kept_layer + moe_first * kept_moe + cap_embedding,
                                                 in_backward_first + workspace_first),
                               block_act_first + embedding_act + workspace_first)
    block_act_last = np.where(split, split_peak(in_flight_last, captured_last, saved_last,
                                                stage_layers * kept_layer + moe_last * kept_moe,
                                                in_backward_last + workspace_last),
                              block_act_last + workspace_last)
    embedding_act = 0
    # the head's micro-batches held until W: the norm's output and x·rsqrt (llama; GPT's LayerNorm
    # keeps all) and the captured gradients after B; one whole, with its log-probs
    logits_act = np.where(split, split_peak(head_norms, head_norms, tokens * (coef["norm"] / seq_split + 4 * V / t),
                                            tokens * norm_weight_input_bytes(cfg, coef) / seq_split + cap_head, 0),
                          logits_act)
    act_first = block_act_first + embedding_act + np.where(head_first, logits_act, 0)
    act_last = np.where(single_stage, act_first, block_act_last + np.where(v_shape, 0, logits_act))

    # ---- model states ------------------------------------------------------------------------
    block_params = tp_block_param_count(cfg, t)  # one tp rank's: its norms whole (models/sizes.py)
    # What ZeRO-3 gathers of the largest block: one tp rank's share of it, and of an MoE block the
    # experts where the engine shards them: over more than one rank of their replicas (dp·cp/ep;
    # under hybrid sharding, of a shard group's). Over one rank it runs them as plain data
    # parallelism (engine._expert_sync), and gathers nothing.
    sharded = (zero == 3) & (shards > 1)
    largest_block = block_params
    final_norm = h if cfg.arch == "llama" else 2 * h
    block_numel = stage_layers * block_params
    expert_first = expert_last = 0
    if moe:  # per MoE block on one rank: the attention over tp; norms, router, shared and E/ep experts whole
        # (Megatron-Core: the shared experts over tp, as a dense MLP; the experts over expert_tp)
        shared_numel = 3 * h * cfg.moe_shared_experts * cfg.moe_ffn_hidden
        moe_block = tp_moe_block_param_count(cfg, t) - np.where(megatron_experts, shared_numel * (1 - 1 / t), 0)
        expert_block = rank_expert_param_count(cfg, e) / etp
        block_numel_last = block_numel + moe_last * (moe_block - block_params)
        block_numel = block_numel + moe_first * (moe_block - block_params)
        expert_first, expert_last = moe_first * expert_block, moe_last * expert_block
        largest_block = np.maximum(largest_block, moe_block + np.where(expert_replicas > 1, expert_block, 0))
    else:
        block_numel_last = block_numel
    table = padded_vocab(V, t) / t * h  # vocab-parallel: the vocabulary padded to a multiple of tp
    embedding_numel = table + (s * h if cfg.arch == "gpt" else 0)  # positions whole
    head_numel = table + final_norm  # a tied head keeps its own copy on the last stage
    whole_numel = block_numel + embedding_numel + final_norm + (0 if cfg.tie_embeddings else table)
    first_numel = np.where(single_stage, whole_numel, block_numel + embedding_numel + np.where(v_shape, head_numel, 0))
    last_numel = np.where(single_stage, whole_numel, block_numel_last + np.where(v_shape, 0, head_numel))
    # Megatron-Core's folded experts can be sharded over their replicas (tp·cp·dp/ep) where the
    # dense weights have one replica (cp·dp = 1): ZeRO-3 then gathers the experts' units alone
    experts_alone = np.zeros_like(sharded)
    if moe:
        experts_alone = (zero == 3) & ~sharded & (expert_replicas > 1) & (moe_first + moe_last > 0)
    gathered_unit = np.where(sharded, largest_block, np.where(experts_alone, expert_block if moe else 0, 0))
    gathered_grads = gathered_unit * work.grad_bytes
    # What a stage holds outside its blocks (embedding, final norm, head): ZeRO-3's root unit
    first_root, last_root = first_numel - block_numel, last_numel - block_numel_last

    def states(numel, expert_numel, outside_blocks, holds_head):
        """ZeRO-3 also holds gathered: the current and the prefetched block (a stage of one block
        has no next one), and the parameters outside the blocks (embedding, final norm, head),
        FSDP's root unit, which FSDP and FSDP2 never reshard after the forward (the backward needs
        them at once). Where it holds the head, the head's and the final norm's whole gradient too,
        in the weights' 16-bit dtype, from their backward at the start of the backward, where the
        activations peak, to the root unit's reduce-scatter at its end, after the embedding's
        (torchtitan's Llama 3.1 8B on 8 and 128 H100s: 0.9 and 1.3 GiB under its measured peak
        without it, the head's gradient 0.98 GiB)."""
        st = model_state_bytes(numel, shards, zero, work.param_bytes, work.grad_bytes, work.optimizer_bytes)
        if moe:  # the experts' states: ZeRO shards them over the ranks that hold the same experts
            ex = model_state_bytes(expert_numel, expert_replicas, zero, work.param_bytes, work.grad_bytes,
                                   work.optimizer_bytes)
            st = {key: st[key] + ex[key] for key in st}
        gathered_params = (np.minimum(2, stage_layers) * gathered_unit
                           + np.where(sharded, outside_blocks, 0)) * work.param_bytes
        head_grads = np.where(sharded & holds_head, head_numel * work.param_bytes, 0)
        return st["params"] + gathered_params, st["grads"] + gathered_grads + head_grads, st["optimizer"]

    first_states = states(first_numel, expert_first, first_root, single_stage | v_shape)
    last_states = states(last_numel, expert_last, last_root, ~v_shape)
    # 2bw, pipedream: whole copies of each stage's weights, one per version its batches use
    versions_first, staleness = weight_versions(schedule, p, 0)
    versions_last, _ = weight_versions(schedule, p, p - 1)
    versions_first_bytes = versions_first * (first_numel + expert_first) * work.param_bytes
    versions_last_bytes = versions_last * (last_numel + expert_last) * work.param_bytes
    block_states = sum(model_state_bytes(block_numel, shards, zero, work.param_bytes, work.grad_bytes,
                                         work.optimizer_bytes).values())
    if moe:
        block_states = block_states + sum(model_state_bytes(expert_first, expert_replicas, zero, work.param_bytes,
                                                            work.grad_bytes, work.optimizer_bytes).values())
    total_first = sum(first_states) + act_first + versions_first_bytes
    total_last = sum(last_states) + act_last + versions_last_bytes
    last_fuller = total_last > total_first
    params, grads, optimizer = (np.where(last_fuller, lst, fst) for fst, lst in zip(first_states, last_states))
    activations = np.where(last_fuller, act_last, act_first)
    versions_bytes = np.where(last_fuller, versions_last_bytes, versions_first_bytes)
    memory_total = np.maximum(total_first, total_last) + RESERVED_BYTES

    # ---- compute on the busiest stage, per micro-batch (each part's seconds: part_seconds) ----
    part = part_seconds(work, layout, gpu)
    block, head = part["block"], part["head"]
    math_s = stage_layers * block["math"] + head["math"]  # the last stage computes the logits
    gemm_mb_s = stage_layers * block["gemm"] + head["gemm"]
    memory_bound_s = stage_layers * block["memory"] + head["memory"]
    if moe:  # the MoE blocks of the last stage in place of dense ones
        moe_block = part["moe_block"]
        math_s = math_s + moe_last * (moe_block["math"] - block["math"])
        gemm_mb_s = gemm_mb_s + moe_last * (moe_block["gemm"] - block["gemm"])
        memory_bound_s = memory_bound_s + moe_last * (moe_block["memory"] - block["memory"])
    core_s = part["core"]

    nvlink_bw = gpu.intra_node_bw * gpu.intra_link_efficiency

    def link(group_span, members_per_node=1):
        """(bandwidth, latency) of a group whose ranks span ``group_span`` consecutive ranks,
        ``members_per_node`` of them in each node. Across nodes NCCL runs a ring per NIC, so a group
        with k members in a node sends over their k NICs at once: the node's network, not one
        GPU's, carries it, never faster than the members' own links (a DGX A100's all-reduce over
        nodes reaches 192 GB/s of bus bandwidth on its 8 × 25 GB/s HDR ports, NVIDIA's figure in
        NVIDIA/nccl#812). k = 1 (one member a node: tp fills it) is one NIC a GPU. Latency: a ring
        through k members a node crosses the network on one step in k and NVLink on the others
        (NCCL's own ring model counts its inter-node steps apart: src/graph/tuning.cc)."""
        intra = in_one_node(group_span, gpu.gpus_per_node)
        one_nic = gpu.inter_node_bw * gpu.inter_link_efficiency
        k = np.maximum(members_per_node, 1)
        nics = np.where(k > 1, np.minimum(k * one_nic, nvlink_bw), one_nic)
        across_latency = (gpu.inter_node_latency_s + (k - 1) * gpu.intra_node_latency_s) / k
        return (np.where(intra, nvlink_bw, nics), np.where(intra, gpu.intra_node_latency_s, across_latency))

    # Each collective call and pipeline message also waits for members off their core where more
    # workers than cores compute (a CPU; 0 on GPUs): the pipeline's waiting ranks do not compete.
    shares = backward_shares(gemm_mb_s, stage_layers * core_s, memory_bound_s, math_s + memory_bound_s)
    bubble = bubble_fraction(schedule, p, m, v, shares)
    runnable = np.minimum(num_gpus, gpu.gpus_per_node) * (1 - bubble)
    wait, pair_wait = call_wait(gpu, runnable), call_pair_wait(gpu, runnable)

    # ---- tensor parallel: the engine's collectives (tp_collectives_per_microbatch) on the last
    # stage's layers and head (and the embedding when it is the only stage), plus the loss's two
    # all-reduces. An all-reduce takes 2(t−1) ring steps, an all-gather or reduce-scatter t−1.
    moe_tp = dict(moe_layers=moe_last, expert_tp=np.where(megatron_experts, expert_tp, 0),
                  top_k=cfg.moe_top_k_experts if moe else 1, shared_experts=cfg.moe_shared_experts)
    tp_collectives = tp_collectives_per_microbatch(stage_layers, sp, recompute, cfg.arch, embedding=single_stage,
                                                   **moe_tp)
    if work.sequence_copies:  # two SP calls per all-reduce's worth, each a copy read and written
        full_tensor_bytes = tokens * h * work.activation_bytes
        memory_bound_s = memory_bound_s + np.where(sp & (t > 1) & (b > 1), 2 * tp_collectives * 2 * full_tensor_bytes
                                                   / gpu.elementwise_rate, 0)
    def tp_sent(top_k):
        return (tp_bytes_per_step(stage_layers, 1, b, s / c, h, t, sp, recompute, work.activation_bytes, cfg.arch,
                                  embedding=single_stage, **dict(moe_tp, top_k=top_k))
                + tp_loss_bytes_per_step(1, b, s / c, t))

    tp_sent_mb = tp_sent(moe_tp["top_k"])
    # split experts' gathers carry the busiest rank's rows (``load``), which every rank waits for;
    # the bytes per axis stay a balanced rank's
    busiest_mb = tp_sent(moe_tp["top_k"] * load) if moe else tp_sent_mb
    tp_bw, tp_lat = link(t, members_per_node=np.minimum(t, gpu.gpus_per_node))  # tp innermost: a node's worth
    # Calls: SP's ½-counted all-gathers and reduce-scatters are two calls per all-reduce's worth;
    # split experts' gathers and reduce-scatters of k rows a token are one call each (4 an MoE
    # block, full recomputation 2 more), not 2k
    tp_calls = np.where(sp, 2 * tp_collectives, tp_collectives) + 2
    if moe:
        split_units = np.where(megatron_experts & (expert_tp > 1), 2 * moe_tp["top_k"] * (1 + 0.5 * full), 0)
        tp_calls = tp_calls - moe_last * np.where(split_units > 0, 2 * split_units - (4 + 2 * full), 0)
    tp_wait = group_wait(wait, t, runnable, pair_wait)
    tp_mb_s = np.where(t > 1, np.where(sp, _collective_time(gpu, ("all_gather", "reduce_scatter"), busiest_mb, tp_calls,
                                                             t - 1, tp_bw, tp_lat, in_one_node(t, gpu.gpus_per_node), tp_wait),
                                       _collective_time(gpu, ("all_reduce",), busiest_mb, tp_calls, 2 * (t - 1),
                                                        tp_bw, tp_lat, in_one_node(t, gpu.gpus_per_node), tp_wait)), 0)
    tp_bytes = m * tp_sent_mb
    # Exposed: all of it, as plain Megatron and our engine run it (each collective sits between the
    # products that produce and consume it). With tp_comm_overlap (Megatron-Core's
    # --tp-comm-overlap, our parallel.tp_overlap; both need SP) the blocks' and the head's
    # all-gathers and reduce-scatters run as rings of t−1 transfers, each behind one chunk (1/t) of
    # the adjacent product: transfers of C seconds beside products of G leave max(0, C − (t−1)/t·G)
    # exposed. The embedding's pair and the loss's all-reduces have no product beside them, nor
    # have split experts' gathers of the dispatched rows (plain NCCL calls in Megatron-Core's
    # token dispatcher: priced as whole experts', expert_tp 1, which have none).
    ringed_mb_s = tp_mb_s * tp_bytes_per_step(stage_layers, 1, b, s / c, h, t, sp, recompute, work.activation_bytes,
                                              cfg.arch, embedding=False,
                                              **dict(moe_tp, expert_tp=np.where(megatron_experts, 1, 0))
                                              ) / np.maximum(busiest_mb, 1)
    tp_exposed_mb = np.where(work.tp_comm_overlap & sp,
                             tp_mb_s - ringed_mb_s + np.maximum(0, ringed_mb_s - (t - 1) / t * gemm_mb_s), tp_mb_s)

    # ---- context parallel: each method's bytes per layer and micro-batch (plan/context.py, what
    # the engine sends), B_q and B_kv of this rank's b·s/c tokens and heads/t heads. ring: each
    # next key/value block is in flight while the current block's products run, so its transfers
    # hide behind the attention core's forward and backward, all but the last hop of the gradient
    # home; allgather and ulysses: exposed (the gather or all-to-all precedes the core that needs it).
    method = np.asarray(layout.cp_method)
    b_q, b_kv = tokens * q / t * work.activation_bytes, 2 * tokens * kv / t * work.activation_bytes
    cp_sent_mb = stage_layers * (context.cp_bytes_per_layer(method, c, b_q, b_kv)
                                 + context.recompute_bytes_per_layer(method, recompute, c, b_q, b_kv))
    cp_bw, cp_lat = link(t * c)
    cp_messages = stage_layers * context.messages_per_layer(method, c, recompute)
    cp_mb_s = np.where(c > 1, _ring_time(cp_sent_mb, cp_messages, cp_bw, cp_lat), 0)
    attention_s = stage_layers * 3 * core_s
    last_hop = np.minimum(cp_mb_s, stage_layers * (cp_lat + b_kv / cp_bw))
    cp_exposed_mb = np.where(method == CP_METHODS.index("ring"),
                             np.maximum(0, cp_mb_s - last_hop - attention_s) + last_hop, cp_mb_s)
    cp_bytes = m * cp_sent_mb

    # ---- expert parallel: dispatch, combine, their gradients and the count exchange per MoE block
    # (ep_bytes_per_step), all exposed: each all-to-all sits between the products that produce and
    # consume it. The ep group is ep ranks t·c apart: those in this rank's node are reached over
    # NVLink, the others over the network, in parallel; an all-to-all takes ep − 1 pairwise rounds.
    ep_mb_s = ep_sent_mb = np.zeros(np.shape(num_gpus))
    if moe:
        ep_sent_mb = ep_bytes_per_step(tokens * moe_token_share(t, sp), cfg.moe_top_k_experts, h, e, moe_last, 1,
                                       cfg.moe_experts, recompute, work.activation_bytes)
        # ep ranks in one node, this one included
        in_node = members_in_node(gpu.gpus_per_node, (ep_stride(t, c, np.where(megatron_experts, expert_tp, 0)), e))
        peers = np.maximum(e - 1, 1)
        intra_s = ep_sent_mb * (in_node - 1) / peers / (gpu.intra_node_bw * gpu.intra_link_efficiency)
        inter_s = ep_sent_mb * (e - in_node) / peers / (gpu.inter_node_bw * gpu.inter_link_efficiency)
        ep_latency = np.where(in_node < e, gpu.inter_node_latency_s, gpu.intra_node_latency_s)
        all_to_alls = moe_last * np.where(full, 8, 5)
        # the busiest rank receives (dispatch) and sends back (combine) its load's rows: all wait for it
        transfer_s = np.maximum(intra_s, inter_s) * load
        ep_mb_s = np.where(e > 1, all_to_alls * (e - 1) * ep_latency + transfer_s, 0)

    # ---- pipeline: one activation forward, one gradient back, per micro-batch and chunk -----
    pp_message = tokens * h * work.activation_bytes / t  # Megatron's scatter/gather: each TP rank sends its slice
    pp_bw, pp_lat = link(num_gpus)
    p2p_s = np.where(single_stage, 0, pp_lat + group_wait(wait, 2, runnable, pair_wait) + pp_message / pp_bw)
    pp_bytes = np.where(single_stage, 0, 2 * m * v * pp_message)
    busy_slots = v * m  # a slot: one micro-batch through one model chunk
    mb_s = math_s + memory_bound_s + tp_exposed_mb + cp_exposed_mb + ep_mb_s
    slot_s = mb_s / v + 2 * p2p_s  # p2p is exposed: Megatron's sends and receives block the schedule
    busy_s = busy_slots * slot_s
    # Every rank's idle time, with uniform stages. Of an uneven split the bubble's slots take the
    # longest chunk, ceil(L/(p·v)) blocks, where the uniform chunk is stage_layers/v (61 layers
    # on 16 ranks × 3 chunks: 2 blocks against 4/3); 1 where the chunks divide the layers. An
    # upper bound: played with the longer chunks first (simulate.play_costs), 61 layers on 16 × 3
    # take 157.7 block-times against 158.0 priced, 20 on 8 × 2 take 57 against 62.
    longest_chunk = np.ceil(L / (p * v)) * v / stage_layers
    idle_s = busy_s * bubble / (1 - bubble) * longest_chunk
    bubble = idle_s / (busy_s + idle_s)
    bubble_s = idle_s / gpu.bubble_speedup
    # rank 0's wait for its neighbours: while it waits the pp − 1 ranks after it compute
    first_rank_speedup = gpu.first_rank_wait_speedup(p)
    rank0_bubble_s = idle_s / first_rank_speedup
    compute_mb_s = math_s + memory_bound_s  # the busiest rank's compute per micro-batch
    mean_compute_mb_s = compute_mb_s  # the ranks' mean: with uniform stages, every rank's
    per_mb_scale = 1.0  # the per-micro-batch parts of the breakdown, as the busiest rank's share
    if stage_split is not None:
        split = pipeline_split_time(work, layout, stage_split, stage_layers_modelled=stage_layers,
                                    head_s=head["math"] + head["memory"], mb_s=mb_s,
                                    compute_mb_s=compute_mb_s, p2p_s=p2p_s, m=m, bubble_speedup=gpu.bubble_speedup,
                                    shares=shares, first_rank_speedup=first_rank_speedup)
        busy_s, bubble_s, rank0_bubble_s, compute_mb_s, mean_compute_mb_s = (
            split[k] for k in ("busy_s", "bubble_s", "rank0_bubble_s", "compute_mb_s", "mean_compute_mb_s"))
        per_mb_scale = (busy_s - 2 * busy_slots * p2p_s) / (m * mb_s)
    pipeline_s = busy_s + bubble_s

    # ---- data parallel (and ZeRO) over the dp × cp replicas --------------------------------
    # The replicas are dp × cp ranks t apart (the mesh's grid: pp, edp, ep, cp, tp), so a node
    # holds its cp neighbours as well as its dp ones; the experts' replicas skip the ep ranks.
    dp_members_per_node = members_in_node(gpu.gpus_per_node, (t, c), (t * c, shard_dp))
    dp_bw, dp_lat = link(t * c * shard_dp, members_per_node=dp_members_per_node)
    backward_s, forward_s = mb_s * 2 / 3, mb_s / 3
    # A pipeline's last stage ends its backwards (p − 1) chunk backwards before stage 0 does:
    # its reduction runs behind that drain. Stage 0 has no drain but holds no head.
    drain_s = np.where(single_stage, 0, (p - 1) * backward_s / v)
    dp_kinds = dict(gpu=gpu, intra=in_one_node(t * c * shard_dp, gpu.gpus_per_node),
                    wait=group_wait(wait, shards, runnable, pair_wait), members_per_node=dp_members_per_node)
    if np.any(groups > 1):  # hybrid sharding's groups: ranks t·c·dp_shard apart, all-reducing the shards
        between_members = members_in_node(gpu.gpus_per_node, (t * c * shard_dp, groups))
        between_bw, between_lat = link(t * c * d, members_per_node=between_members)
        dp_kinds["between"] = dict(groups=groups, bw=between_bw, latency=between_lat, members_per_node=between_members,
                                   intra=in_one_node(t * c * d, gpu.gpus_per_node),
                                   wait=group_wait(wait, groups, runnable, pair_wait))
    # ZeRO-3's units (parallel/fsdp.py): the blocks and the root; DualPipeV's last stage has no head
    dp_last = _data_parallel(last_numel, shards, zero, m, stage_layers, work, dp_bw, dp_lat, backward_s, forward_s,
                             mb_s, drain_s, root_numel=last_root, unit_numel=block_params, head=~v_shape,
                             embedding=single_stage, **dp_kinds)
    dp_first = _data_parallel(first_numel, shards, zero, m, stage_layers, work, dp_bw, dp_lat, backward_s,
                              forward_s, mb_s, 0, root_numel=first_root, unit_numel=block_params,
                              head=single_stage | v_shape, embedding=True, **dp_kinds)
    if moe:  # the experts' states reduce (and gather) over their own replicas (dp·cp/ep), behind the
        # same backward as the rest: the two groups' exposure together. On Megatron-Core's grid
        # those are expert_tp·ep ranks apart.
        expert_members = np.where(megatron_experts, members_in_node(gpu.gpus_per_node, (etp * e, expert_replicas)),
                                  members_in_node(gpu.gpus_per_node, (t, c), (t * c * e, expert_dp)))
        expert_bw, expert_lat = link(np.where(megatron_experts, etp * e * expert_replicas, t * c * e * expert_dp),
                                     members_per_node=expert_members)
        expert_kinds = dict(dp_kinds, members_per_node=expert_members,  # "between": hybrid sharding's, as the rest's
                            wait=group_wait(wait, expert_replicas, runnable, pair_wait))
        expert_group, expert_zero = expert_replicas, zero
        # Hybrid sharding at dp_shard = ep (cp 1) leaves one rank of each expert in a shard group:
        # the engine runs them as plain data parallelism over the groups (one all-reduce a step,
        # on the link between the groups), not as ZeRO-3 over one rank
        replicated = (expert_replicas == 1) & (groups > 1)
        if np.any(replicated):
            between = dp_kinds["between"]
            expert_group, expert_zero = np.where(replicated, groups, expert_replicas), np.where(replicated, 0, zero)
            expert_bw = np.where(replicated, between["bw"], expert_bw)
            expert_lat = np.where(replicated, between["latency"], expert_lat)
            expert_kinds.update({key: np.where(replicated, between[key], expert_kinds[key])
                                 for key in ("members_per_node", "intra", "wait")},
                                between=dict(between, groups=np.where(replicated, 1, groups)))

        def experts(last: bool, also: dict | None) -> dict:
            blocks = moe_last if last else moe_first
            return _data_parallel(expert_last if last else expert_first, expert_group, expert_zero, m, blocks, work,
                                  expert_bw, expert_lat, backward_s, forward_s, mb_s, drain_s if last else 0,
                                  also=also, unit_numel=np.where(blocks > 0, expert_block, 0), head=False,
                                  embedding=False, **expert_kinds)

        with_dense = experts(True, dp_last), experts(False, dp_first)
        if np.any(replicated):
            # The two groups' exposure apart (_data_parallel prices one group's by its own ZeRO
            # stage): the dense ZeRO-3 units' inside a shard group, the experts' all-reduce on the
            # link between the groups, each behind the same backward; the longer is exposed
            def beside(dense_dp: dict, experts_dp: dict) -> dict:
                added = {key: dense_dp[key] + experts_dp[key] for key in ("bytes", "seconds", "calls")}
                return dict(dense_dp, **added, exposed=np.maximum(dense_dp["exposed"], experts_dp["exposed"]))

            apart = beside(dp_last, experts(True, None)), beside(dp_first, experts(False, None))
            with_dense = tuple({key: np.where(replicated, b[key], a[key]) for key in ("bytes", "seconds", "calls",
                                                                                      "exposed")}
                               for a, b in zip(with_dense, apart))
        dp_last, dp_first = with_dense
    dp_bytes, dp_s = dp_last["bytes"], dp_last["seconds"]
    dp_exposed_s = np.where(single_stage, dp_last["exposed"], np.maximum(dp_last["exposed"], dp_first["exposed"]))
    if not work.overlap_dp:  # --no-overlap-dp: every reduction and gather after (before) the compute
        dp_exposed_s = np.where(single_stage, dp_s, np.maximum(dp_s, dp_first["seconds"]))

    # ---- optimizer: memory-bound passes over this rank's share of the states: Adam's reads and
    # writes (PRECISIONS) and the gradient's; the gradient norm reads the gradients, zeroing writes them.
    optimizer_numel = last_numel / np.where(zero >= 1, shards, 1) + expert_last / np.where(zero >= 1, expert_replicas, 1)
    optimizer_s = optimizer_numel * (work.optimizer_pass_bytes + 3 * work.grad_bytes) / gpu.elementwise_rate

    # ---- tensor parallel, once a step: under SP each tp rank runs an MoE block's router, shared
    # experts and experts on its own positions, so their gradients are partial sums over tp,
    # all-reduced before the optimizer (placements.sum_partial_grads), this rank's reduced shards
    # of them where ZeRO shards the gradients; exposed (the norm gains' too, O(L·h): left out).
    tp_partial_bytes = tp_partial_s = tp_partial_calls = np.zeros(np.shape(num_gpus))
    if moe:
        dense_shards, expert_shards = np.where(zero >= 1, shards, 1), np.where(zero >= 1, expert_replicas, 1)
        partial_numel = moe_last * (moe_replicated_param_count(cfg) / dense_shards + expert_block / expert_shards)
        # Megatron-Core's grid: the experts reduce over their expert-dp group, the shared experts
        # are split over tp; only the router's gradient is summed over tp
        partial_numel = np.where(megatron_experts, moe_last * cfg.moe_experts * h / dense_shards, partial_numel)
        split = sp & (t > 1) & (moe_last > 0)
        tp_partial_bytes = np.where(split, 2 * (t - 1) / t * partial_numel * work.grad_bytes, 0)
        # one call for the small ones, flat, and one for each large tensor (the three stacked expert
        # matrices, the shared experts' three), as sum_partial_grads makes them
        shared_matrix = h * cfg.moe_shared_experts * cfg.moe_ffn_hidden
        large = np.where(megatron_experts, 0, 3 * (expert_block / 3 / expert_shards >= PARTIAL_IN_PLACE_NUMEL) + 3 * (
            (shared_matrix > 0) & (shared_matrix / dense_shards >= PARTIAL_IN_PLACE_NUMEL)))
        tp_partial_calls = np.where(split, 1 + moe_last * large, 0)
        tp_partial_s = np.where(split, _collective_time(gpu, ("all_reduce",), tp_partial_bytes, tp_partial_calls,
                                                        2 * (t - 1), tp_bw, tp_lat, in_one_node(t, gpu.gpus_per_node),
                                                        tp_wait), 0)

    # ---- contention: overlapped data-parallel traffic is not free. NCCL's kernels run on the SMs
    # of the compute they hide behind and stream their bytes through its HBM, which slows by
    # overlap_slowdown seconds per second of NVLink-rate traffic: the cost is per byte overlapped,
    # so a group moving its bytes slower (one NIC a GPU across nodes) costs no more per byte, and
    # the rings' latency, no traffic, costs nothing (docs/planner.md §5). On a CPU, whose
    # collectives are measured lines (gloo), the cores run the whole call: every overlapped
    # second of it costs.
    overlapped_share = np.maximum(0, dp_s - dp_exposed_s) / np.where(dp_s > 0, dp_s, 1)
    traffic_s = dp_s if gpu.collectives is not None else dp_bytes / nvlink_bw
    contention_s = gpu.overlap_slowdown * overlapped_share * traffic_s

    # ---- the collectives' own CPU (a CPU's gloo; 0 on a GPU): every call this rank makes in a
    # step (a pipeline's middle stage sends and receives both ways) and the bytes it sends
    calls = (np.where(t > 1, m * tp_calls, 0) + tp_partial_calls + np.where(single_stage, 0, np.where(p > 2, 4, 2) * m * v)
             + dp_last["calls"] + np.where(c > 1, m * cp_messages, 0) + (m * all_to_alls * (e > 1) if moe else 0))
    per_byte = float(np.mean([1 / bw for _, bw in gpu.collectives.values()])) if gpu.collectives else 0.0
    collective_cpu_s = (calls * call_cpu(gpu, runnable)
                        + (tp_bytes + tp_partial_bytes + pp_bytes + dp_bytes + cp_bytes + m * ep_sent_mb) * per_byte)

    step_s = pipeline_s + dp_exposed_s + tp_partial_s + optimizer_s + contention_s
    if gpu.core_share < 1:
        # More workers than cores (a CPU): a rank waiting in a collective or the bubble gives its
        # core to a rank that computes. Brent's bounds: the step takes at least the machine's CPU
        # work over its cores (``machine``: every rank's work at its fair share of a core, the
        # ranks' mean, so a light pipeline stage's idle core goes to a heavy one), and at least
        # the busiest rank's own path, its compute at a whole core's speed and its waits; the
        # larger holds. The CPU work is the compute and the collectives' own: each call's CPU
        # beyond the compute (gloo's threads waking, the socket's system calls: call_cpu) and
        # its bytes at gloo's rate. With every core busy (8 ranks on 2 cores: /proc/stat reads
        # 97% busy through the demo's step) the waits cost nothing but that CPU: another rank
        # computes meanwhile, so the step is the machine's work, not compute plus waits.
        overhead = tp_partial_s + optimizer_s + contention_s + collective_cpu_s / gpu.core_share
        machine = m * mean_compute_mb_s + overhead
        busiest = m * compute_mb_s + overhead
        step_s = np.maximum(machine, busiest * gpu.core_share + (step_s - busiest))
    # ---- stragglers: identical GPUs run at different speeds (power management and manufacturing:
    # Sinha et al. 2022), and every rank waits at each step's collectives for the slowest of them,
    # speed_spread standard deviations a GPU times the expected maximum of num_gpus draws behind
    # the mean (docs/planner.md §4). 0 on a CPU, whose closed loop measures its own waits.
    stragglers_s = gpu.speed_spread * expected_slowest(num_gpus) * step_s
    step_s = step_s + stragglers_s
    step_tokens = work.global_batch * s
    model_flops = work.model_flops_per_token * step_tokens
    hardware_flops = model_flops + np.choose(recompute, work.recompute_flops_per_token) * step_tokens
    result = dict(
        num_gpus=num_gpus, microbatches=m, params_total=np.full(np.shape(step_s), float(work.params_total)),
        params_active=np.full(np.shape(step_s), float(work.params_active)), step_time_s=step_s, tokens_per_s=step_tokens / step_s,
        tflops_per_gpu=model_flops / (step_s * num_gpus) / 1e12,
        mfu=model_flops / (step_s * num_gpus * gpu.peak_flops),
        hfu=hardware_flops / (step_s * num_gpus * gpu.peak_flops),
        bubble_fraction=bubble,
        params_bytes=params, grads_bytes=grads, optimizer_bytes=optimizer, activations_bytes=activations,
        weight_versions_bytes=versions_bytes, staleness=staleness,
        memory_bytes=memory_total, reserved_bytes=np.full(np.shape(memory_total), float(RESERVED_BYTES)),
        fits=memory_total <= gpu.hbm_bytes,
        block_states_bytes=block_states, block_activations_bytes=stage_layers * per_layer * in_flight_first,
        dp_bytes=dp_bytes, tp_bytes=tp_bytes + tp_partial_bytes, tp_partial_bytes=tp_partial_bytes,
        pp_bytes=pp_bytes, cp_bytes=cp_bytes,
        ep_bytes=m * ep_sent_mb, dp_s=dp_s, tp_s=m * tp_mb_s + tp_partial_s, pp_s=2 * busy_slots * p2p_s,
        cp_s=m * cp_mb_s, ep_s=m * ep_mb_s,
        compute_s=m * math_s * per_mb_scale, memory_bound_s=m * memory_bound_s * per_mb_scale,
        tp_exposed_s=m * tp_exposed_mb * per_mb_scale + tp_partial_s, cp_exposed_s=m * cp_exposed_mb * per_mb_scale,
        ep_exposed_s=m * ep_mb_s * per_mb_scale, pp_exposed_s=2 * busy_slots * p2p_s,
        bubble_s=bubble_s, rank0_bubble_s=rank0_bubble_s, dp_exposed_s=dp_exposed_s, optimizer_s=optimizer_s,
        contention_s=contention_s, stragglers_s=stragglers_s, collective_calls=calls, collective_cpu_s=collective_cpu_s,
    )
    result["exposed_s"] = (result["tp_exposed_s"] + result["cp_exposed_s"] + result["ep_exposed_s"]
                           + result["pp_exposed_s"] + dp_exposed_s)
    return {key: (bool(value) if np.ndim(value) == 0 else value) if key == "fits" else _scalar_or_array(value)
            for key, value in result.items()}
