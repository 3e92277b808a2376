"""Can the strategies run this layout? One small check per strategy, run while the config is
read, before any process starts (torchtitan's ``ParallelDims`` plays this part). Torch-free.

Each check raises ``ConfigError`` with one line that names the key and the reason.
"""
from __future__ import annotations

from threefold.config import AUTO, Config, ConfigError, ModelConfig, ParallelConfig
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY, check_schedule, stage_counts
from threefold.words import plural


def check_layout(cfg: Config) -> None:
    p = cfg.parallel
    check_tensor_parallel(cfg.model, p)
    check_context_parallel(cfg.model, p)
    check_expert_parallel(cfg.model, p)
    if p.dp == AUTO:
        return  # what depends on dp waits for the world size (configure.resolve_world)
    if p.expert_tp == 1 and p.ep > 1:
        if p.dp % (p.ep // (p.tp * p.cp)):
            raise ConfigError(f"parallel.ep: folded over tp·cp = {p.tp * p.cp}, ep={p.ep} takes {p.ep // (p.tp * p.cp)} "
                              f"dp ranks, which does not divide parallel.dp={p.dp}")
    elif p.dp % p.ep:
        raise ConfigError(f"parallel.ep: {p.ep} does not divide parallel.dp={p.dp} (expert parallelism splits "
                          "the experts over data-parallel ranks; parallel.expert_tp = 1 folds them over tp and cp too)")
    check_hybrid_sharding(p)
    check_pipeline(cfg)


def check_hybrid_sharding(p: ParallelConfig) -> None:
    """ZeRO 1, 2 (data_parallel.py) and 3 (fsdp.py) shard their states over groups of dp_shard
    consecutive dp ranks (the experts over the dp_shard / ep of them that hold the same experts)
    and all-reduce each reduced shard over the dp / dp_shard groups that hold it."""
    if not p.dp_shard:
        return
    if p.zero == 0:
        raise ConfigError(f"parallel.dp_shard: hybrid sharding splits ZeRO's states over groups of "
                          f"{plural(p.dp_shard, 'dp rank')}; it needs parallel.zero 1, 2 or 3, got zero=0 "
                          "(DDP keeps every state whole)")
    if p.dp_shard < 2 or p.dp % p.dp_shard:
        raise ConfigError(f"parallel.dp_shard: must divide parallel.dp={p.dp} and be at least 2 (a group of one "
                          f"rank shards nothing), got {p.dp_shard}")
    if p.expert_tp == 1 and p.ep > 1:
        raise ConfigError("parallel.dp_shard: hybrid sharding with the ep group folded over tp and cp "
                          "(parallel.expert_tp = 1) is not supported; use expert_tp 0 or dp_shard 0")
    if p.dp_shard % p.ep:
        raise ConfigError(f"parallel.dp_shard: a shard group holds whole expert-parallel groups, so it must be a "
                          f"multiple of parallel.ep={p.ep}, got {p.dp_shard}")


def check_expert_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """expert_parallel.py gives each of the ep ranks E/ep whole experts; folded (expert_tp 1), the
    ep group is whole tp·cp blocks of ranks, and under tp each rank routes its own positions (SP)."""
    ep = parallel.ep
    if ep == 1:
        if parallel.expert_tp == 1:
            raise ConfigError("parallel.expert_tp: 1 folds the expert-parallel group over tp and cp; it needs "
                              "parallel.ep > 1")
        return
    if not model.moe_experts:
        raise ConfigError(f"parallel.ep: {ep} needs a Mixture-of-Experts model (model.moe_experts is 0)")
    if model.moe_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} does not divide model.moe_experts={model.moe_experts} "
                          "(each rank holds whole experts)")
    if parallel.expert_tp == 1:
        inside = parallel.tp * parallel.cp
        if ep % inside:
            raise ConfigError(f"parallel.ep: folded over tp and cp (parallel.expert_tp = 1), ep={ep} must be a multiple "
                              f"of tp·cp = {inside}")
        shared = model.moe_shared_experts * model.moe_ffn_hidden
        if shared % parallel.tp:
            raise ConfigError(f"model.moe_shared_experts: folded over tp (parallel.expert_tp = 1) the shared experts are "
                              f"split over tp={parallel.tp}, which does not divide their width {shared} "
                              "(moe_shared_experts · moe_ffn)")
        if parallel.tp > 1 and not parallel.sequence_parallel:
            raise ConfigError("parallel.expert_tp: folding the experts over tp routes each tp rank's own positions; "
                              "it needs parallel.sequence_parallel = true (as Megatron-Core's MoE under tp does)")


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """tensor_parallel.py splits heads, key/value heads, the FFN width and the vocabulary."""
    t = parallel.tp
    if t == 1:
        return
    if model.heads % t:
        raise ConfigError(f"parallel.tp: {t} does not divide model.heads={model.heads} "
                          "(each rank computes whole heads)")
    if model.n_kv_heads % t:
        raise ConfigError(f"parallel.tp: {t} does not divide the {plural(model.n_kv_heads, 'key/value head')} "
                          "(model.kv_heads); tensor parallelism splits them, it does not replicate them")
    if model.ffn_hidden % t:
        raise ConfigError(f"parallel.tp: {t} does not divide the FFN width {model.ffn_hidden} (model.ffn)")
    if model.vocab_size is not None and model.vocab_size < t:
        raise ConfigError(f"parallel.tp: {t} ranks cannot share a vocabulary of {plural(model.vocab_size, 'token')} "
                          "(model.vocab_size)")
    if parallel.sequence_parallel and model.seq_len % t:
        raise ConfigError(f"parallel.sequence_parallel: tp={t} does not divide model.seq_len={model.seq_len}")


def check_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """context_parallel.py cuts every sequence into 2·cp equal chunks (the zigzag split), and
    Ulysses splits each rank's heads (after tp) over cp."""
    cp = parallel.cp
    if cp == 1:
        return
    if model.seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp: the zigzag split cuts model.seq_len={model.seq_len} into 2·cp = {2 * cp} "
                          f"equal chunks; {model.seq_len} is not divisible by {2 * cp}")
    if parallel.sequence_parallel and (model.seq_len // cp) % parallel.tp:
        raise ConfigError(f"parallel.sequence_parallel: tp={parallel.tp} does not divide the {model.seq_len // cp} "
                          f"tokens each cp rank holds (model.seq_len / parallel.cp)")
    heads, kv_heads = model.heads // parallel.tp, model.n_kv_heads // parallel.tp
    if parallel.cp_method == "ulysses" and (heads % cp or kv_heads % cp):
        raise ConfigError(f"parallel.cp_method: ulysses splits each rank's {plural(heads, 'head')} and "
                          f"{plural(kv_heads, 'key/value head')} (after tp={parallel.tp}) over cp={cp}; they are not "
                          f"divisible by {cp}")


def check_pipeline(cfg: Config) -> None:
    """The pipeline runtime needs the schedule's own conditions (the registry's constraints: a
    block per stage, interleaved's equal chunks and micro-batches, …), and what the runtime
    does not run: full recomputation under a split backward."""
    p = cfg.parallel
    if p.pp == 1:
        if p.stage_layers is not None:
            raise ConfigError("parallel.stage_layers: sets the blocks of each pipeline stage; it needs parallel.pp > 1")
        return
    check_schedule(p.schedule, p.pp, cfg.microbatches, p.virtual_stages, cfg.model.layers)
    if p.stage_layers is not None:
        stage_counts(p.stage_layers, cfg.model.layers, p.pp * p.virtual_stages)
    if p.schedule in ("2bw", "pipedream"):
        check_steps_back_to_back(cfg)
    if cfg.train.recompute == "full" and SCHEDULE_REGISTRY[p.schedule].split_backward:
        # B and W are separate autograd passes, and a checkpointed block recomputes its forward in
        # each pass that unpacks it: W's weight groups would run it again (3× the tp bytes measured)
        raise ConfigError(f"train.recompute: full recomputation with {p.schedule} is not supported: its weight "
                          "gradients (W) run apart from the input gradients (B), and each would recompute the "
                          f"blocks' forward again; use recompute selective or none with {p.schedule}, or "
                          "schedule 1f1b or interleaved with full")


def check_steps_back_to_back(cfg: Config) -> None:
    """What 2bw and pipedream need besides their micro-batches (the registry checks those): each
    stage computes on whole copies of its weights (so no ZeRO-3, which shards them), and a step
    forwards micro-batches of the next one, whose tokens and routing must not mix with this
    step's (so no context parallelism, whose split of the next step's batch is not made yet, and
    no Mixture of Experts, whose routing statistics are per step)."""
    p = cfg.parallel
    if p.zero == 3 and p.dp * p.cp > 1:
        raise ConfigError(f"parallel.zero: {p.schedule} keeps whole copies of each stage's weights (its weight "
                          "versions), which ZeRO-3 would shard; use zero 0, 1 or 2")
    if p.cp > 1:
        raise ConfigError(f"parallel.cp: {p.schedule} with context parallelism is not supported (a step forwards "
                          "micro-batches of the next one, whose sequences are not split yet)")
    if cfg.model.moe_experts:
        raise ConfigError(f"model.moe_experts: {p.schedule} with a Mixture-of-Experts model is not supported (a step "
                          "forwards micro-batches of the next one, whose routing would count in this step's statistics)")
