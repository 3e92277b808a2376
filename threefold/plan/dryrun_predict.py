"""The planner's figures for any one rank of a layout: what ``threefold dryrun --compare`` puts
beside each measured figure.

``threefold compare`` puts global rank 0's figures beside a real run's, and a dry run any
rank's beside its own, with the same formulas (threefold/plan/costs.py). The tp and dp
coordinates change nothing the planner counts: tp shards are equal (the vocabulary padded to a
multiple of tp) and every dp replica is the same.

  memory       costs.model_state_bytes of the rank's stages' parameters (its tp shard), ZeRO over
               dp × cp (the ranks that hold the same parameters; hybrid sharding: dp_shard × cp);
               activations, of its seq_len / cp tokens: costs.block_activation_bytes × the most
               blocks whose activations the rank holds at once (simulate.peak_in_flight over its
               schedule's actions), each context-parallel method's own saves, plus where it holds
               the head, the final norm and the logits as costs.estimate counts them; under a split
               backward played in bytes, a micro-batch holding from its B only what W reads
               (``split_activation_peak``);
  experts      an MoE block's routed experts (E/ep whole ones) apart, their states over the dp/ep
               ranks of the expert-data-parallel group (× cp; hybrid sharding: the dp_shard/ep
               of them in a shard group); their reduction under "dp" ("dp+cp"), the
               dispatch and combine under "ep" (costs.ep_bytes_per_step, round-robin routing as
               the dry run routes fake tokens); the activations an MoE block adds are estimated;
  comm_bytes   dp: costs.dp_bytes_per_step; tp: costs.tp_bytes_per_step of its blocks, with the
               embedding where it holds stage 0 and the head term only where it holds the last
               stage; tp.loss where it computes the loss; pp: costs.pp_bytes_per_step of its pp
               coordinate; tp.scatter_gather (tp without sequence parallelism, pp > 1).
Under context parallelism a rank holds seq_len / cp tokens of each sequence: its activations,
tp and pp messages are those of its tokens; cp: plan/context.cp_bytes_per_step of its blocks;
the gradients are reduced over dp × cp, counted under "dp+cp" ("cp" with the attention's bytes
when dp = 1; hybrid sharding's all-reduce between its shard groups, over dp ranks alone, under "dp"); an MoE block's routing statistics: plan/context.moe_bytes_per_step ("cp.routing").
tp.partial_grads under SP (the norm gains' and an MoE block's gradients summed over tp once a
step: costs.tp_partial_numel) where the rank holds them whole (ZeRO 0, or one replica).
Keys the planner does not model (scalars, the tied embedding, the timeline, and the partial
gradients where a ZeRO shard cuts them where its buckets fall) are left out, so a dry run
shows them as measured only.

A bf16 run is the engine's autocast (costs.ENGINE_BYTES): the products' outputs are bf16, the
residual stream fp32; pp and the residual's tp collectives carry 4 bytes an element, and the
activations add costs.autocast_activation_bytes (the fp32 stream, the weights' bf16 copies).
"""
from __future__ import annotations

from dataclasses import dataclass

from threefold.config import Config
from threefold.models.sizes import is_moe_layer, rank_expert_param_count, stage_param_count
from threefold.parallel.pipeline.schedule import (SCHEDULE_REGISTRY, build_run, build_schedule, partition,
                                                 stages_per_rank, steps_ahead)
from threefold.plan import context, costs
from threefold.plan.simulate import peak_in_flight
from threefold.plan.stage_costs import modelled_layer_costs


@dataclass(frozen=True)
class RankShare:
    """What one pipeline coordinate runs: its parameter elements (one tp shard; routed experts
    apart), its blocks, whether it holds the first and the last stage, the most blocks whose
    activations it holds at once, how many of its blocks hold experts, and how many
    (micro-batch, stage) pairs are in flight at that peak. On the stage with the head: the most
    micro-batches whose final-norm tensors it holds at once (until their weight gradients, W
    under a split backward) and whose log-probabilities it holds (until their backward)."""
    numel: int
    blocks: int
    first_stage: bool
    last_stage: bool
    blocks_in_flight: int
    moe_blocks: int = 0
    in_flight: int = 1
    head_norms_in_flight: int = 1
    head_logits_in_flight: int = 1
    embedding_in_flight: int = 1
    before_backward: int = 1  # (micro-batch, stage) pairs between F and B at most (= in_flight unless split)
    blocks_before_backward: int = 1  # blocks of those pairs (= blocks_in_flight unless split)


def rank_share(cfg: Config, pp_rank: int) -> RankShare:
    """What pipeline rank ``pp_rank`` runs, torch-free: the engine's partition (the registry's
    stage placement), its tp shards (models/sizes.py's counts: the vocabulary padded to a
    multiple of tp, a tied table counted once where one rank holds both ends)."""
    p, model = cfg.parallel, cfg.model
    if p.pp == 1:
        moe = sum(is_moe_layer(model, i) for i in range(model.layers))
        numel = stage_param_count(model, model.layers, first=True, last=True, tp=p.tp, moe_blocks=moe,
                                  shared_split=p.experts_folded)
        return RankShare(numel, model.layers, True, True, model.layers, moe, blocks_before_backward=model.layers)
    spans, schedule = stages_and_schedule(cfg)
    held = [spans[s] for s in schedule.stages_of(pp_rank)]
    moe = [sum(is_moe_layer(model, i) for i in span.blocks) for span in held]
    numel = sum(stage_param_count(model, len(span.blocks), span.first, span.last, p.tp, moe_blocks=n,
                                  shared_split=p.experts_folded) for span, n in zip(held, moe))
    actions = schedule.actions[pp_rank]
    blocks = lambda a: len(spans[a.stage].blocks)  # noqa: E731
    blocks_in_flight = peak_in_flight(actions, schedule.split_backward, blocks)
    head = lambda a: int(spans[a.stage].last)  # noqa: E731  (the head's stage's actions alone)
    embedding = lambda a: int(spans[a.stage].first)  # noqa: E731
    return RankShare(numel, sum(len(span.blocks) for span in held), any(span.first for span in held),
                     any(span.last for span in held), blocks_in_flight, sum(moe),
                     peak_in_flight(actions, schedule.split_backward),
                     peak_in_flight(actions, schedule.split_backward, head), peak_in_flight(actions, False, head),
                     peak_in_flight(actions, False, embedding), peak_in_flight(actions, False),
                     peak_in_flight(actions, False, blocks))


def stages_and_schedule(cfg: Config):
    """The engine's stages (their spans of blocks: the registry's placement, split as a dry run
    splits them) and the schedule whose actions each pipeline rank runs, for ``cfg`` at pp > 1."""
    p = cfg.parallel
    spans = partition(cfg.model, p.pp, stages_per_rank(p.schedule, p.virtual_stages), p.stage_layers,
                      modelled_layer_costs(cfg))  # the engine's split (a dry run times nothing)
    schedule = build_schedule(p.schedule, p.pp, cfg.microbatches, p.virtual_stages)
    if SCHEDULE_REGISTRY[p.schedule].steady is not None:
        # 2bw, pipedream: 1F1B across steps, so a step in the middle of the run keeps what the run
        # keeps (pipedream's stage s, pp − s micro-batches of one each): its peak, drained at the end
        schedule = build_run(p.schedule, p.pp, cfg.microbatches, 2 * steps_ahead(p.pp, cfg.microbatches) + 1)
    return spans, schedule


def split_backward_bytes(cfg: Config, pp_rank: int, share: RankShare) -> float:
    """What a schedule that splits the backward (ZB-H1, DualPipeV) holds at the rank's fullest
    beyond the saved activations: the gradients B captures where each weight joins the input's
    path, kept until W (parallel/pipeline/runtime.backward_input; autograd does not save them, so
    the activation meter never sees them). Per micro-batch, ``captured_gradient_bytes``' for each
    block, the head and the embedding of the stage; the peak of saved and captured bytes together
    over the rank's actions (``split_activation_peak``), less the saved activations' own peak.
    While a B runs, the gradients it captures at a block's products arrive before that block's
    tensors only B reads are released: one block's (or the head's, the larger) beyond what was
    in flight when it began. ``share``: the rank's ``rank_share``."""
    p = cfg.parallel
    if p.pp == 1 or not SCHEDULE_REGISTRY[p.schedule].split_backward:
        return 0.0
    block, head, embedding = captured_gradient_bytes(cfg, share)
    return (split_activation_peak(cfg, pp_rank, share, (block, head, embedding), during_backward=True)
            - split_activation_peak(cfg, pp_rank, share))


def split_activation_peak(cfg: Config, pp_rank: int, share: RankShare, captured=(0.0, 0.0, 0.0),
                          during_backward: bool = False) -> float:
    """The most bytes a rank of a split-backward schedule holds for its blocks and head, played
    over its actions (simulate.peak_in_flight): from a micro-batch's F to its B all the stage
    saves (``saved_block_bytes``, the head's norm and log-probabilities), from its B to its W only
    what W reads (``weight_input_block_bytes``, the head's norm output and x·rsqrt and its product's
    input: runtime.SavedForW releases the rest), plus ``captured`` (per block, head, embedding),
    and with ``during_backward`` one block's or the head's captured gradients while a B runs."""
    p, model = cfg.parallel, cfg.model
    spans, schedule = stages_and_schedule(cfg)
    act_bytes, residual_bytes = costs.ENGINE_BYTES[cfg.train.dtype]
    saved, kept = saved_block_bytes(cfg, share), weight_input_block_bytes(cfg, share)
    norm, log_probs, head_product = head_bytes_per_microbatch(cfg, act_bytes, residual_bytes)
    coef = costs.activation_coefficients(model, "flash", act_bytes)
    rank_tokens = cfg.train.micro_batch * model.seq_len // p.cp / (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    head_kept = rank_tokens * costs.norm_weight_input_bytes(model, coef) + head_product
    embedding = rank_tokens * coef["embedding"]  # what the embedding saves (0 for llama), read by B alone
    block_captured, head_captured, embedding_captured = captured

    def stage_saved(action):
        span = spans[action.stage]
        return len(span.blocks) * saved + span.last * (norm + log_probs + head_product) + span.first * embedding

    def stage_kept(action):
        span = spans[action.stage]
        return (len(span.blocks) * (kept + block_captured) + span.last * (head_kept + head_captured)
                + span.first * embedding_captured)

    def in_backward(action):
        span = spans[action.stage]
        return max(block_captured if span.blocks else 0.0, span.last * head_captured)

    return float(peak_in_flight(schedule.actions[pp_rank], True, stage_saved, stage_kept,
                                in_backward if during_backward else None))


def captured_gradient_bytes(cfg: Config, share: RankShare) -> tuple[float, float, float]:
    """Bytes of the gradients a split backward's B keeps for W in one micro-batch
    (costs.captured_gradient_bytes, at the engine's dtypes): for one of the rank's blocks (its MoE
    blocks' share at theirs), for the head and for the embedding."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    act_bytes, residual_bytes = costs.ENGINE_BYTES[t.dtype]
    tokens = t.micro_batch * model.seq_len // p.cp
    dense, moe, head, embedding = costs.captured_gradient_bytes(model, tokens, p.tp, p.sequence_parallel and p.tp > 1,
                                                                act_bytes, residual_bytes)
    moe_share = share.moe_blocks / share.blocks
    return float((1 - moe_share) * dense + moe_share * moe), float(head), float(embedding)


def head_activation_bytes(cfg: Config, share: RankShare, act_bytes: int, residual_bytes: int) -> float:
    """What the stage with the head keeps for backward, as costs.estimate counts it (its
    ``logits_act``): per micro-batch the final norm's tensors, tokens · norm / seq_split, held
    until the norm's weight gradient, and the fp32 log-probabilities, tokens · 4·V/tp, until the
    backward; as many micro-batches as the schedule keeps of each (``RankShare``: GPipe all m,
    ZB-H1 the norms of min(pp, m) and one micro-batch's logits, 1F1B one of each); the
    embedding's output (llama: ``coef["embedding"]`` = 0) on the first stage. The estimate's
    expression, for this rank's dtype and tokens (``head_bytes_per_microbatch``)."""
    p, model = cfg.parallel, cfg.model
    sp = p.sequence_parallel and p.tp > 1  # the engine runs without it at tp 1 (configure.unused_settings)
    tokens = cfg.train.micro_batch * model.seq_len // p.cp
    coef = costs.activation_coefficients(model, "flash", act_bytes)
    embedding = tokens * coef["embedding"] / (p.tp if sp else 1) if share.first_stage else 0
    if not share.last_stage:
        return embedding
    norm, log_probs, head_product = head_bytes_per_microbatch(cfg, act_bytes, residual_bytes)
    return embedding + share.head_norms_in_flight * (norm + head_product) + share.head_logits_in_flight * log_probs


def head_bytes_per_microbatch(cfg: Config, act_bytes: int, residual_bytes: int) -> tuple[float, float, float]:
    """Per micro-batch on the stage with the head: the final norm's tensors, tokens · norm /
    seq_split; the fp32 log-probabilities, tokens · 4·V/tp; and under bf16 autocast (``residual_bytes``
    > ``act_bytes``) what the head saves as a block's products do (costs.autocast_activation_bytes):
    under SP the norm's fp32 shard, (r − d)·h/tp more; without SP its bf16 copy of the norm's
    output (as counted) and of its weight, V/tp·h·d (autocast casts it again in each micro-batch's
    forward)."""
    p, model = cfg.parallel, cfg.model
    sp = p.sequence_parallel and p.tp > 1
    tokens = cfg.train.micro_batch * model.seq_len // p.cp
    coef = costs.activation_coefficients(model, "flash", act_bytes)
    seq_split = p.tp if sp else 1
    product = 0.0
    if residual_bytes != act_bytes:
        product = (tokens * (residual_bytes - act_bytes) * model.hidden / p.tp if sp
                   else -(-model.vocab_size // p.tp) * model.hidden * act_bytes)
    return tokens * coef["norm"] / seq_split, tokens * 4 * model.vocab_size / p.tp, float(product)


def bookkeeping_activation_bytes(cfg: Config, share: RankShare) -> float:
    """The engine's own saved tensors that costs.activation_coefficients leaves out (bytes a
    token; on real models under 0.5% of the activations), int64 but for the masks, the loss's
    scalar and the rotary tables. The embedding saves its token ids and the loss its targets:
    views of the rank's whole batch of inputs and of targets (m·b sequences each, as
    data/sampler.py makes them; each counted once while any micro-batch is in flight, and on an
    asynchronous schedule's first stage the inputs of each later step it forwards), with
    PyTorch's nll_loss an fp32 scalar per micro-batch. Under tp the vocabulary-parallel
    embedding and loss save their own masked ids and a bool mask per micro-batch instead; under
    context parallelism the ids and targets are new tensors of the rank's b·seq/cp tokens per
    micro-batch, and each (micro-batch, stage) in flight holds the rotary tables gathered at its
    zigzag positions (fp32 cos and sin, seq/cp × head_dim each); under full recomputation the
    blocks save the step's positions as an input (one tensor for every micro-batch and stage);
    Ulysses saves two orderings of the whole sequence in each block it does not recompute whole
    (models/llama.py, parallel/tensor_parallel.py, parallel/context_parallel.py)."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    seq = model.seq_len // p.cp
    ends = share.embedding_in_flight * share.first_stage, share.head_logits_in_flight * share.last_stage
    scalars = 4 * ends[1] if p.tp == 1 else 0  # PyTorch's nll_loss: its fp32 total weight
    if p.cp == 1 and p.tp == 1:
        # an asynchronous schedule's first stage also holds the inputs of the later steps it forwards
        ahead = steps_ahead(p.pp, cfg.microbatches) if SCHEDULE_REGISTRY[p.schedule].steady is not None else 0
        batches = share.first_stage * (1 + ahead) + share.last_stage
        return scalars + batches * cfg.microbatches * t.micro_batch * seq * 8
    per_token = 8 + (1 if p.tp > 1 else 0)  # an int64 id, and under tp its bool mask
    ids_and_targets = sum(ends) * t.micro_batch * seq * per_token
    if p.cp == 1:
        return scalars + ids_and_targets
    tables = share.before_backward * seq * 2 * model.head_dim * 4  # read by rotary, which B runs
    positions = seq * 8 if t.recompute == "full" else 0  # one tensor, the step's, for every micro-batch and stage
    ulysses = 2 * model.seq_len * 8 if p.cp_method == "ulysses" and t.recompute != "full" else 0
    return scalars + ids_and_targets + tables + positions + share.blocks_before_backward * ulysses  # B reads them


def saved_block_bytes(cfg: Config, share: RankShare) -> float:
    """What one of the rank's blocks saves for backward in a micro-batch, its MoE blocks' share
    counted at theirs: costs.block_activation_bytes of the rank's seq_len / cp tokens, each
    context-parallel method's own saves, an MoE block's (costs.moe_activation_bytes) and bf16
    autocast's (costs.autocast_activation_bytes)."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    sp = p.sequence_parallel and p.tp > 1  # the engine runs without it at tp 1 (configure.unused_settings)
    act_bytes, residual_bytes = costs.ENGINE_BYTES[t.dtype]
    tokens = t.micro_batch * model.seq_len // p.cp
    block = costs.block_activation_bytes(model, tokens, p.tp, sp, t.recompute,
                                         dtype_bytes=act_bytes)
    q, kv = costs.attention_width(model)
    if p.cp > 1 and p.cp_method in ("ring", "allgather") and t.recompute == "none":
        # their attention function saves k and v as they come (parallel/context_parallel.py), not
        # the grouped-query repeats that scaled_dot_product_attention saves (the core's 2(q − kv))
        block -= tokens * act_bytes * 2 * (q - kv) / p.tp
    if p.cp > 1 and p.cp_method == "ulysses" and t.recompute == "none":
        # the attention's output twice: head-split where the core saves it, and back in sequence
        # order where the output projection saves its input (the all-to-all's result is a new tensor)
        block += tokens * act_bytes * q / p.tp
    moe_share = share.moe_blocks / share.blocks
    if share.moe_blocks:  # what an MoE block keeps beyond a dense one, for its share of the blocks
        block += moe_share * costs.moe_activation_bytes(model, tokens, p.tp, sp, t.recompute,
                                                        act_bytes, expert_tp=int(p.experts_folded))
    if residual_bytes != act_bytes:  # bf16 autocast: the fp32 stream, the weights' bf16 copies
        autocast = [costs.autocast_activation_bytes(model, tokens, p.tp, sp, t.recompute,
                                                    p.tp_overlap, moe, p.ep, act_bytes, residual_bytes,
                                                    expert_tp=int(p.experts_folded))
                    for moe in (False, True)]
        block += (1 - moe_share) * autocast[0] + moe_share * autocast[1]
    return float(block)


def weight_input_block_bytes(cfg: Config, share: RankShare) -> float:
    """Of ``saved_block_bytes``, what a split backward keeps from B to W (costs.weight_input_bytes
    at the engine's dtypes): the norms' x·rsqrt and outputs, the inputs of wo and w_down; under
    bf16 autocast all of costs.autocast_activation_bytes too (the products' bf16 copies of their
    inputs and weights, the fp32 shard under SP). Each context-parallel method's own saves are
    the attention core's, released at B."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    sp = p.sequence_parallel and p.tp > 1
    act_bytes, residual_bytes = costs.ENGINE_BYTES[t.dtype]
    tokens = t.micro_batch * model.seq_len // p.cp
    block = costs.weight_input_bytes(model, tokens, p.tp, sp, t.recompute, dtype_bytes=act_bytes)
    moe_share = share.moe_blocks / share.blocks
    if share.moe_blocks:
        block += moe_share * costs.moe_weight_input_bytes(model, tokens, p.tp, sp, t.recompute, act_bytes,
                                                          expert_tp=int(p.experts_folded))
    if residual_bytes != act_bytes:
        autocast = [costs.autocast_activation_bytes(model, tokens, p.tp, sp, t.recompute, p.tp_overlap, moe, p.ep,
                                                    act_bytes, residual_bytes, expert_tp=int(p.experts_folded))
                    for moe in (False, True)]
        # all but an MoE block's combine, whose fp32 rows only B reads (folded: this rank's positions'; the
        # SP block's counted for the whole sequence, within 0.3% of the meter on the tiny MoE under ZB-H1)
        rows = costs.moe_token_share(p.tp, sp) if p.experts_folded else 1
        combine = tokens * rows * model.moe_top_k_experts * model.hidden * (8 - 2 * act_bytes)
        block += (1 - moe_share) * autocast[0] + moe_share * (autocast[1] - combine)
    return float(block)


def predict_rank(cfg: Config, rank: int) -> dict:
    """``{"memory": {params, grads, optimizer, activations}, "comm_bytes": {key: bytes}}`` of
    global ``rank``, in bytes per step, for a concrete layout of ``cfg`` (no "auto")."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    sp = p.sequence_parallel and p.tp > 1  # the engine runs without it at tp 1 (configure.unused_settings)
    pp_rank = rank // (p.world_size // p.pp)  # pp is the mesh's outermost axis (distributed/mesh.py)
    share = rank_share(cfg, pp_rank)
    m = cfg.microbatches
    # a product's output and the residual stream (costs.ENGINE_BYTES); fp32 weights, grads, moments
    act_bytes, residual_bytes = costs.ENGINE_BYTES[t.dtype]
    replicas = p.dp * p.cp  # weight gradients are reduced over dp × cp together
    shard = p.dp_shard * p.cp if p.dp_shard else replicas  # ZeRO's shards: over dp_shard × cp under HSDP
    memory = dict(costs.model_state_bytes(share.numel, shard, p.zero))
    # Routed experts: E/ep of each MoE block, their states replicated (and ZeRO-sharded) over the
    # dp/ep ranks of the expert-data-parallel group (parallel/expert_parallel.py)
    experts = share.moe_blocks * rank_expert_param_count(model, p.ep) if share.moe_blocks else 0
    # folded over tp and cp (Megatron-Core's grid at ``Layout.expert_tp`` 1), dp·cp·tp / ep ranks
    fold = p.experts_folded
    expert_replicas = p.experts_copies(p.dp * p.cp)
    # hybrid sharding: the dp_shard / ep ranks of a shard group that hold the same experts (× cp);
    # where that is one rank, the engine runs them as plain data parallelism (engine._expert_sync)
    expert_shard = p.experts_copies(p.dp_shard * p.cp) if p.dp_shard else expert_replicas
    expert_zero = 0 if expert_shard == 1 else p.zero
    if experts:
        for key, value in costs.model_state_bytes(experts, expert_shard, p.zero).items():
            memory[key] += value
    seq = model.seq_len // p.cp  # the tokens of each sequence this rank holds
    tokens = t.micro_batch * seq
    block = saved_block_bytes(cfg, share)
    if p.pp > 1 and SCHEDULE_REGISTRY[p.schedule].split_backward:  # B releases what only it reads
        held = split_activation_peak(cfg, pp_rank, share)
    else:
        held = share.blocks_in_flight * block + head_activation_bytes(cfg, share, act_bytes, residual_bytes)
    memory["activations"] = held + bookkeeping_activation_bytes(cfg, share)
    # 2bw, pipedream: whole fp32 copies of this stage's weights, one per version its batches use
    versions, _ = costs.weight_versions(costs.SCHEDULES.index(p.schedule), p.pp, pp_rank)
    if versions:
        memory["weight_versions"] = float(versions) * (share.numel + experts) * 4

    comm = {}
    grad_key = "+".join(a for a in ("dp", "cp") if getattr(p, a) > 1)
    if replicas > 1:
        comm[grad_key] = costs.dp_bytes_per_step(share.numel, replicas, p.zero, m, shard=shard,
                                                 reshard_after_forward=p.resharding)
    # ZeRO-3 all-reduces each micro-batch's shards (kept gathered, the step's), ZeRO-1, 2 the step's
    between_times = m if costs.priced_zero(p.zero, p.resharding) == 3 else 1
    if p.dp_shard and p.cp > 1:  # hybrid sharding's all-reduce between the shard groups: dp ranks alone
        comm["dp"] = costs.hsdp_all_reduce_bytes(share.numel, shard, p.dp_replicate, between_times)
        comm[grad_key] -= comm["dp"]
    if p.cp > 1:
        comm["cp"] = comm.get("cp", 0.0) + context.cp_bytes_per_step(
            p.cp_method, p.cp, t.recompute, share.blocks, m, t.micro_batch, model.seq_len, model.heads // p.tp,
            model.n_kv_heads // p.tp, model.head_dim, act_bytes)
    expert_key = "dp" if fold else grad_key  # folded, edp holds no cp rank
    if experts and expert_replicas > 1:  # the expert-data-parallel group (× cp) counts as dp (× cp)
        comm[expert_key] = comm.get(expert_key, 0) + costs.dp_bytes_per_step(
            experts, expert_replicas, expert_zero, m, shard=expert_shard, reshard_after_forward=p.resharding)
        if p.dp_shard and p.cp > 1:
            between = costs.hsdp_all_reduce_bytes(experts, expert_shard, p.dp_replicate, between_times)
            comm["dp"], comm[grad_key] = comm["dp"] + between, comm[grad_key] - between
    # the routing statistics over the micro-batch (SplitMicroBatch): over cp, and folded over tp too
    shares = {"cp": p.cp, "tp": p.tp if fold else 1}
    if share.moe_blocks and shares["cp"] * shares["tp"] > 1:
        moe_split = context.moe_bytes_per_step(shares["cp"] * shares["tp"], t.recompute, share.moe_blocks, m,
                                               tokens // shares["tp"], model.moe_top_k_experts, model.moe_experts,
                                               model.moe_aux_loss_coef > 0, model.moe_capacity_factor > 0)
        if moe_split:
            comm["+".join(a for a, n in shares.items() if n > 1) + ".routing"] = moe_split
    if p.ep > 1 and share.moe_blocks:
        # Under bf16 autocast the engine sends the dispatched and the combined rows in bf16 alike
        # under SP each tp rank dispatches its own positions' rows (tensor_parallel.SequenceSplitMoE)
        comm["ep"] = costs.ep_bytes_per_step(t.micro_batch * seq * costs.moe_token_share(p.tp, sp),
                                             model.moe_top_k_experts, model.hidden, p.ep, share.moe_blocks, m,
                                             model.moe_experts, t.recompute, act_bytes)
    if p.tp > 1:
        tp_args = (m, t.micro_batch, seq, model.hidden, p.tp, sp, t.recompute, act_bytes,
                   model.arch)
        widths = dict(residual_bytes=residual_bytes, tp_overlap=p.tp_overlap)
        if fold:  # Megatron-Core's grid at expert-tp 1: no gather to route, the shared experts a tp MLP
            widths.update(expert_tp=1, top_k=model.moe_top_k_experts, shared_experts=model.moe_shared_experts)
        comm["tp"] = costs.tp_bytes_per_step(share.blocks, *tp_args, embedding=share.first_stage,
                                             moe_layers=share.moe_blocks, **widths)
        if not share.last_stage:  # the formula always counts the head: its zero-block, no-embedding value
            comm["tp"] -= costs.tp_bytes_per_step(0, *tp_args, embedding=False, **widths)
        if share.last_stage:
            comm["tp.loss"] = costs.tp_loss_bytes_per_step(m, t.micro_batch, seq, p.tp)
        if sp and (p.zero == 0 or replicas == 1):  # whole gradients: where ZeRO shards them, its buckets cut them
            partial = sum(costs.tp_partial_numel(model, share.blocks, share.moe_blocks, share.last_stage, p.ep,
                                                 folded=fold))
            comm["tp.partial_grads"] = 2 * (p.tp - 1) / p.tp * 4 * partial  # fp32 gradients
    if p.pp > 1:
        # a stage's output and its gradient are the residual stream
        comm["pp"] = costs.pp_bytes_per_step(pp_rank, p.pp, m, p.virtual_stages, t.micro_batch, seq,
                                             model.hidden, p.tp, sp, residual_bytes, p.schedule)
        if p.tp > 1 and not sp:
            comm["tp.scatter_gather"] = costs.scatter_gather_bytes_per_step(
                pp_rank, p.pp, m, p.virtual_stages, t.micro_batch, seq, model.hidden, p.tp, residual_bytes,
                p.schedule)
    return {"memory": {k: float(v) for k, v in memory.items()}, "comm_bytes": {k: float(v) for k, v in comm.items()}}
