"""What ``threefold train`` checks before any process starts: every input it can refuse in one
line (a planner-only model, a checkpoint_dir that is one checkpoint, a damaged checkpoint to
resume, an init_from the run would move aside, a corpus that is not text, a file that is not a
tokenizer), and whether the run fits in this machine's memory, by the engine's memory model, with
a layout that would fit when it does not.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path

from threefold.config import Config, ConfigError
from threefold.parallel.layout import check_layout
from threefold.words import plural

GiB = 2**30
SLOW_STEP_S = 60.0  # warn up front when one step is predicted to take longer than this
# Peak RSS of one-process CPU runs of the tiny model over this model (whose live peak MemTracker
# confirms): 1.26–1.91× here (docs/training.md); glibc's heap keeps much of what a step frees
CPU_ALLOCATOR_SLACK = 2.0
INPUT_BYTES_PER_TOKEN = 3 * 8  # the sampler's int64 windows, inputs and targets of this rank's rows


def check_run(cfg: Config, warn=print) -> None:
    """Raise ConfigError for what would fail later; ``warn`` (one line each) what will be slow."""
    check_trainable(cfg)
    t = cfg.train
    if t.checkpoint_dir:
        from threefold.train import checkpoint

        checkpoint.check_root(t.checkpoint_dir)
        found = checkpoint.list_checkpoints(t.checkpoint_dir)
        if t.resume and found:
            checkpoint.check_resumable(found[-1], cfg)  # before the ranks start: one line, not one a rank
            problem = checkpoint.damage(found[-1])
            if problem:
                raise ConfigError(problem)
    check_init_from(cfg.model.init_from)
    if t.checkpoint_dir and not t.resume and found:
        check_init_from_stays(cfg.model.init_from, found)  # else every rank would start, and rank 0 refuse it
    cache = Path(cfg.data.cache_dir)
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"data.cache_dir: {str(cache)!r} is a file, not a folder")
    from threefold.data.corpus import find_corpus

    find_corpus(cfg.data.corpus, cfg.data.allow_binary)
    vocab = cfg.model.vocab_size or tokenizer_vocab(cfg)
    sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    check_memory(sized, warn)
    slow = slow_step_warning(sized)
    if slow:
        warn(slow)


def check_trainable(cfg: Config) -> None:
    """The engine trains Llama blocks; GPT-3 blocks are shapes for the planner."""
    if cfg.model.arch == "llama":
        return
    block = "LayerNorm, GELU, learned positions"
    if cfg.model.preset:
        what = f"model.preset: {cfg.model.preset!r} is a planner shape (arch 'gpt': {block})"
    else:
        what = f"model.arch: 'gpt' is the planner's block ({block})"
    raise ConfigError(f"{what}; the engine trains 'llama' blocks "
                      f"(threefold estimate --model {cfg.model.preset or 'gpt3-175b'} plans it)")


def check_init_from(source: str | None) -> None:
    """``model.init_from`` must be a threefold checkpoint, a folder of them, or a Hugging Face folder."""
    if source is None:
        return
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"model.init_from: {source!r} does not exist")
    if not path.is_dir():
        raise ConfigError(f"model.init_from: {source!r} is a file; expected a threefold checkpoint or a Hugging Face "
                          "folder (config.json, model.safetensors)")
    from threefold.train import checkpoint

    if not ((path / "trainer.json").is_file() or checkpoint.list_checkpoints(path) or (path / "config.json").is_file()):
        raise ConfigError(f"model.init_from: {source!r} holds neither a threefold checkpoint (trainer.json, step_*/) "
                          "nor a Hugging Face model (config.json)")


def check_init_from_stays(source: str | None, found: list[Path]) -> None:
    """Refuse a fresh run whose ``model.init_from`` is one of ``found``, the checkpoints of its own
    checkpoint_dir: a run that does not resume moves them aside (checkpoint.move_aside, rank 0)
    while its ranks would read it. Checked here before any rank starts, and by the trainer (under
    torchrun or SLURM no preflight runs)."""
    if source is None:
        return
    from threefold.interop.hf import init_from_checkpoint

    start = init_from_checkpoint(source)
    if start is not None and start.resolve() in {path.resolve() for path in found}:
        raise ConfigError(f"model.init_from: {str(start)!r} is a checkpoint of this run's train.checkpoint_dir, "
                          "which a run that does not resume moves aside before it starts; give the new run a "
                          "checkpoint_dir of its own (or set train.resume=true to continue that run)")


def tokenizer_vocab(cfg: Config) -> int:
    """The tokenizer's vocabulary, without training a BPE (its size is data.vocab_size at most)."""
    if cfg.data.tokenizer == "bpe":
        return cfg.data.vocab_size
    if cfg.data.tokenizer == "gpt2":
        return 50257
    from threefold.data.tokenizer import load_tokenizer

    return load_tokenizer(Path(cfg.data.tokenizer), "check").vocab_size


# --- memory ------------------------------------------------------------------------------------
def rank_memory(cfg: Config, process_bytes: float | None = None, cuda: bool | None = None) -> dict[str, float]:
    """Bytes the fullest rank needs at its peak: ``stage_memory`` of the pipeline coordinate that
    needs the most (under pp the stages differ), and the process itself (``process_bytes``;
    default: this process's resident memory, torch imported, on CPUs, and costs.RESERVED_BYTES on
    CUDA). ``cuda``: whether the ranks run on CUDA (default: whether this machine has it)."""
    cuda = on_cuda() if cuda is None else cuda
    parts = max((stage_memory(cfg, pp_rank, cuda) for pp_rank in range(cfg.parallel.pp)),
                key=lambda m: sum(m.values()))
    parts["process"] = process_memory() if process_bytes is None else process_bytes
    return parts


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_memory(cfg: Config, pp_rank: int, cuda: bool = False) -> dict[str, float]:
    """Bytes the ranks of pipeline coordinate ``pp_rank`` hold at their peak: what the engine keeps
    (plan/dryrun_predict.py, which ``threefold dryrun`` holds to the bytes the engine allocates:
    fp32 states, the saved activations of the run's dtype and schedule), what its step holds
    beside them at its fullest (``working_bytes``) and the sampler's batch of token ids. A dry
    run's live peak, every tensor counted, is held to their sum (tests/test_dryrun_live_peak.py)."""
    from threefold.plan.dryrun_predict import predict_rank, rank_share, split_backward_bytes

    p, t = cfg.parallel, cfg.train
    memory = predict_rank(cfg, pp_rank * (p.world_size // p.pp))["memory"]
    share = rank_share(cfg, pp_rank)
    memory["working"] = working_bytes(cfg, share, memory["activations"], cuda, split_backward_bytes(cfg, pp_rank, share))
    memory["batch"] = t.global_batch // p.dp * cfg.model.seq_len * INPUT_BYTES_PER_TOKEN
    return {k: float(v) for k, v in memory.items()}


def working_bytes(cfg: Config, share, activations: float, cuda: bool = False, captured: float = 0.0) -> float:
    """What a rank holds beside its states and saved activations at its fullest, the larger of
    two moments of the step: its backward (``backward_working_bytes``, and under a split backward
    the gradients B keeps for W, ``captured``: plan/dryrun_predict.split_backward_bytes) and its
    optimizer step (``optimizer_working_bytes``), which runs once the backward has freed the
    ``activations``. ``share``: the rank's plan/dryrun_predict.RankShare."""
    return float(max(backward_working_bytes(cfg, share) + captured,
                     optimizer_working_bytes(cfg, share, cuda) - activations))


def backward_working_bytes(cfg: Config, share) -> float:
    """What the backward holds beside the saved activations at its peak, for one micro-batch.

    - On the stage with the head, the loss's fp32 softmax and its gradient, each the size of
      the logits, as the backward starts; under full recomputation the block it rebuilds (its
      activations, whose gradients then take their place), if larger. Elsewhere a block's
      gradients take the place of the activations its backward frees. PyTorch's MemTracker on
      one-process runs of the tiny model (seq 1,024–4,096, vocabulary 64–16,384; none,
      selective and full) put the live tensors' peak within 0.03 GiB of states + saved
      activations + this (docs/training.md).
    - bf16 autocast under sequence parallelism: the column-parallel products save their fp32
      weights (parameters), yet autocast casts them for the product and caches the casts until
      the micro-batch's forward ends: at its loss, one bf16 copy of each (wq, wk, wv, w_gate,
      w_up and the head's shard) per block of the rank (a dry run of llama3-8b at tp2 showed
      4.5 GiB a rank of them, the activation meter none, as nothing saves them).
    - ZeRO-2 (over more than one rank): the gradient buffers of ``zero2_gradient_buffers``.
    - ZeRO-3 (over more than one rank), fp32: the gathered units, the root (embedding, final norm,
      head: gathered for the whole step, as FSDP's root) and a block with the next one prefetched
      (an MoE block's routed experts likewise, a unit of their own); and their full gradients,
      the root's (from the head's backward to the embedding's) and a block's. On a last stage
      that is not also the first, the root (final norm, head) is gathered by the logits' gradient
      and reduced and freed before the blocks' backward: the step's fullest moment is the head's
      (the loss's tensors above, the root, its gradient and the prefetched block) or a block's
      (the block rebuilt under full recomputation, a block, the next and a gradient). Adding the
      two over-counted Llama 3 8B's last rank at dp4·pp2 by 6 GB (the dry run's live peak 0.94
      of it). DualPipeV's rank 0 holds the first stage too: its blocks' moment is the first
      stage's B, with the embedding's root gathered and its gradient (the tiny model's live peak
      read 0.84 of the model that added both ends' roots and the loss at once, 0.94 now). Where
      the stage holds the embedding, its unit's reduction, the micro-batch's last, is still in
      flight in the next micro-batch: its sharded output too (Llama 3 8B's first rank at
      dp2·tp2·pp2 under full recomputation read 1.022 of the model without it).
      Kept gathered through the step (``parallel.reshard_after_forward = false``, or unset under
      a pipeline): every unit's
      weights, and with more than one micro-batch every unit's full gradient, accumulated over
      them until the last backward reduces it, beside the gradient a unit's backward makes before
      autograd adds it in (under a split backward W adds one weight's at a time). Llama 3 8B at
      dp4·pp2 reads 0.97-1.00 of this under 1F1B, interleaving and ZB-H1 (docs/scale.md); the tiny
      model 0.92-0.98, but under ZB-H1 0.87-0.90, where its first W, which makes the gradients,
      comes after the last stage's fullest moment."""
    from threefold.plan import costs

    p, t, model = cfg.parallel, cfg.train, cfg.model
    tokens = t.micro_batch * model.seq_len // p.cp
    act_bytes, residual_bytes = costs.ENGINE_BYTES[t.dtype]
    sp = p.sequence_parallel and p.tp > 1
    working = 2 * tokens * 4 * -(-model.vocab_size // p.tp) if share.last_stage else 0
    rebuilt = 0
    if t.recompute == "full":
        block = costs.block_activation_bytes(model, tokens, p.tp, sp, "none", dtype_bytes=act_bytes)
        if model.moe_experts:
            block += costs.moe_activation_bytes(model, tokens, p.tp, sp, "none", act_bytes,
                                                 expert_tp=int(p.experts_folded))
        if act_bytes != residual_bytes:  # bf16 autocast casts the rebuilt block's weights again
            block += act_bytes * largest_block(cfg, share)
        rebuilt, working = block, max(block, working)
    if act_bytes != residual_bytes and sp:
        working += act_bytes * column_parallel_weights(cfg, share)
    shards = p.dp_shard * p.cp if p.dp_shard else p.dp * p.cp
    if p.zero == 2 and shards > 1:
        working += 4 * zero2_gradient_buffers(cfg, share, shards)
    if p.zero == 3 and shards > 1 and not p.resharding:
        from threefold.models.sizes import rank_expert_param_count
        from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY

        root, block = zero3_units(cfg, share)
        units = share.numel + (share.moe_blocks * rank_expert_param_count(model, p.ep) if share.moe_blocks else 0)
        accumulated = units if cfg.microbatches > 1 else root + block
        split = p.pp > 1 and SCHEDULE_REGISTRY[p.schedule].split_backward  # W adds one weight's at a time
        working += 4 * (units + accumulated + (0 if split else max(root, block)))
    elif p.zero == 3 and shards > 1:
        root, block = zero3_units(cfg, share)
        if share.last_stage and p.pp > 1:
            # the head's moment apart from the blocks'; on DualPipeV's rank 0, which also holds the
            # first stage, the blocks' moment is the first stage's B, with the embedding's root
            embedding_root, head_root = zero3_roots(cfg, share)
            blocks = rebuilt + 4 * (min(2, share.blocks) + 1) * block + 4 * 2 * embedding_root
            working = max(working + 4 * (2 * head_root + block), blocks)
        else:
            working += 4 * (root + min(2, share.blocks) * block) + 4 * (root + block)
        if share.first_stage and cfg.microbatches > 1:
            # the embedding's unit is the micro-batch's last to reduce, and its reduction stays in
            # flight until the next micro-batch's first (parallel/fsdp.py): its sharded output beside
            # the full gradient counted above
            embedding_unit = zero3_roots(cfg, share)[0] if p.pp > 1 else root
            working += 4 * embedding_unit / shards
        if share.moe_blocks and p.experts_copies(shards) > 1:  # a block's routed experts: a unit of their own
            from threefold.models.sizes import rank_expert_param_count

            experts = rank_expert_param_count(model, p.ep)
            working += 4 * (min(2, share.moe_blocks) * experts + experts)
    return float(working)


def column_parallel_weights(cfg: Config, share) -> int:
    """Elements of the column-parallel weights of the rank's blocks (wq, wk, wv, and a dense
    block's w_gate and w_up), one tp shard, and of the head's shard where it holds the head."""
    from threefold.models.sizes import attention_width, padded_vocab

    p, model = cfg.parallel, cfg.model
    h = model.hidden
    q, kv = attention_width(model)
    dense = share.blocks - share.moe_blocks
    numel = (share.blocks * (q + 2 * kv) * h + dense * 2 * h * model.ffn_hidden) // p.tp
    if share.last_stage:
        numel += padded_vocab(model.vocab_size, p.tp) // p.tp * h
    return numel


def zero3_roots(cfg: Config, share) -> tuple[int, int]:
    """Elements of what this rank's first and last stage hold outside their blocks, one tp shard
    each (0 where it holds no such stage): the embedding's table, and the final norm and head."""
    from threefold.models.sizes import padded_vocab

    table = padded_vocab(cfg.model.vocab_size, cfg.parallel.tp) // cfg.parallel.tp * cfg.model.hidden
    return (table if share.first_stage else 0), (cfg.model.hidden + table if share.last_stage else 0)


def zero3_units(cfg: Config, share) -> tuple[int, int]:
    """Elements of ZeRO-3's units on this rank (parallel/fsdp.py), one tp shard: the root (what the
    stage holds outside its blocks: the vocabulary tables, the final norm) and the largest block."""
    embedding_root, head_root = zero3_roots(cfg, share)
    root = embedding_root + head_root
    if cfg.model.tie_embeddings and cfg.parallel.pp == 1:
        root -= embedding_root  # one table for both ends (a pipeline's ends hold a copy each, DualPipeV's rank 0 both)
    return root, largest_block(cfg, share)


def largest_block(cfg: Config, share) -> int:
    """Elements of this rank's largest block, one tp shard (an MoE block's routed experts apart)."""
    from threefold.models.sizes import tp_block_param_count, tp_moe_block_param_count

    block = tp_block_param_count(cfg.model, cfg.parallel.tp)
    if share.moe_blocks:
        block = max(block, tp_moe_block_param_count(cfg.model, cfg.parallel.tp, cfg.parallel.experts_folded))
    return block


def zero2_gradient_buffers(cfg: Config, share, shards: int) -> float:
    """Elements of ZeRO-2's gradients in flight at once (parallel/data_parallel.py): autograd's
    gradient of the largest parameter, the bucket it is copied into (its own, if larger than
    ``parallel.bucket_mb``), and the reductions still running beside it (REDUCTIONS_IN_FLIGHT
    counts the one this bucket's will start), each a bucket's full gradient and the chunk it
    receives (buckets of at most bucket_mb, or of the stage). The tiny model's dry runs: within
    1% (one bucket for the whole model), llama3-8b's within 3%."""
    from threefold.models.sizes import rank_expert_param_count
    from threefold.parallel.data_parallel import REDUCTIONS_IN_FLIGHT

    def buffers(largest, numel, shards):
        bucket = min(cfg.parallel.bucket_mb * 2**20 / 4, numel)
        return largest + max(largest, bucket) + (REDUCTIONS_IN_FLIGHT - 1) * bucket * (1 + 1 / shards)

    p, model = cfg.parallel, cfg.model
    found = buffers(largest_parameter(cfg, share, experts=False), share.numel, shards)
    if share.moe_blocks:  # the routed experts' own synchronisation, over the ranks holding the same experts
        experts = share.moe_blocks * rank_expert_param_count(model, p.ep)
        expert_shards = shards // p.ep
        if expert_shards > 1:
            found += buffers(model.moe_experts // p.ep * model.hidden * model.moe_ffn_hidden, experts, expert_shards)
    return found


def largest_parameter(cfg: Config, share, experts: bool = True) -> int:
    """Elements of the largest parameter this rank holds: the vocabulary table's tp shard where it
    holds an end of the model, a block's largest matrix shard, an MoE block's experts of one
    matrix (E/ep of them, one tensor; left out without ``experts``)."""
    from threefold.models.sizes import attention_width, padded_vocab

    p, model = cfg.parallel, cfg.model
    h = model.hidden
    q, _ = attention_width(model)
    largest = max(h * model.ffn_hidden, h * q) // p.tp
    if share.first_stage or share.last_stage:
        largest = max(largest, padded_vocab(model.vocab_size, p.tp) // p.tp * h)
    if share.moe_blocks and experts:
        largest = max(largest, model.moe_experts // p.ep * h * model.moe_ffn_hidden)
    return largest


def optimizer_working_bytes(cfg: Config, share, cuda: bool) -> float:
    """AdamW's temporaries in its step, fp32. torch's AdamW on CPUs updates one tensor at a time,
    making the square root of its second moment and that divided by the bias correction: twice
    the largest tensor it updates (a parameter; under ZeRO-1/2 a bucket's chunk, under ZeRO-3 a
    unit's). On CUDA its foreach form makes the square roots of all of them at once: once every
    parameter element this rank updates."""
    from threefold.models.sizes import rank_expert_param_count

    p = cfg.parallel
    shards = p.dp_shard * p.cp if p.dp_shard else p.dp * p.cp
    zero = p.zero if shards > 1 else 0
    if cuda:
        experts = share.moe_blocks * rank_expert_param_count(cfg.model, p.ep) if share.moe_blocks else 0
        expert_shards = max(1, shards // p.ep)
        return 4.0 * (share.numel / (shards if zero else 1) + experts / (expert_shards if zero else 1))
    largest = largest_parameter(cfg, share)
    if zero in (1, 2):  # buckets of up to bucket_mb (or the stage's), a larger parameter alone in its own
        largest = max(largest, min(int(p.bucket_mb * 2**20 / 4), share.numel))
    if zero == 3:  # a unit: the root or a block
        largest = max(zero3_units(cfg, share))
    return 2 * 4.0 * (largest / shards if zero else largest)


def process_memory() -> float:
    """What a rank's process holds before the model: on CUDA the planner's reserve (context,
    NCCL and cuBLAS workspaces), on CPUs this process's resident memory, torch imported, as
    a rank's will be."""
    import torch

    from threefold.plan import costs

    if torch.cuda.is_available():
        return float(costs.RESERVED_BYTES)
    try:
        return float(int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0


def available_memory() -> tuple[float, int, str] | None:
    """(bytes one rank may use, ranks sharing them, what they are): a CUDA device's free memory, or
    this machine's available RAM, which all its ranks share. None when it cannot be read."""
    import torch

    if torch.cuda.is_available():  # nvidia-smi: no CUDA context in this process, which lives on as torchrun
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        try:
            out = subprocess.run([smi, "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
            return float(min(int(x) for x in out)) * 2**20, 1, "free on the fullest GPU"
        except (OSError, ValueError, subprocess.SubprocessError):
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024, 0, "available on this machine"
    except OSError:
        pass
    return None


def check_memory(cfg: Config, warn=print) -> None:
    """Refuse, in one line with the numbers, a run whose ranks would not fit in memory; ``warn``
    when they fit by the model but not with the slack CPU runs showed beyond it."""
    found = available_memory()
    if found is None:
        return
    available, sharing, where = found
    world = cfg.parallel.world_size
    ranks = world if sharing == 0 else sharing  # on one machine's RAM, every rank of it counts
    slack = CPU_ALLOCATOR_SLACK if sharing == 0 else 1.0  # on CUDA costs.RESERVED_BYTES is the slack
    process = process_memory()
    need = rank_memory(cfg, process)
    together = ranks * sum(need.values())
    total = f", {ranks} ranks {together / GiB:,.1f} GiB together" if ranks > 1 else ""
    if together <= available:
        if together * slack > available:
            warn(f"warning: memory: each rank needs about {sum(need.values()) / GiB:,.1f} GiB by the engine's memory "
                 f"model{total}, and runs on CPUs have peaked up to {slack}× their model: {available / GiB:.1f} GiB "
                 f"are {where}, so the run may be stopped for memory")
        return
    parts = ", ".join(f"{k} {v / GiB:,.1f}" for k, v in need.items())
    fit = fitting_layout(cfg, available / ranks / slack, process)
    advice = (f"a layout that fits: --set {fit}" if fit else
              f"no layout on {plural(world, 'rank')} fits, not even with ZeRO-3, full recomputation "
              "and micro_batch 1: use a smaller model or more memory")
    raise ConfigError(f"memory: each rank needs about {sum(need.values()) / GiB:,.1f} GiB ({parts} GiB, by the "
                      f"engine's memory model){total}, but {available / GiB:.1f} GiB are {where}; {advice}")


def fitting_layout(cfg: Config, budget: float, process_bytes: float = 0.0) -> str | None:
    """The layout of the same number of ranks that fits in ``budget`` bytes a rank (its process
    ``process_bytes`` of them) and changes the fewest keys of the run's (then needs the least
    memory), as ``key=value`` overrides."""
    p, t = cfg.parallel, cfg.train
    world = p.world_size // p.cp  # the run's cp stays: the search spreads the other ranks
    current = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "recompute": t.recompute, "micro_batch": t.micro_batch,
               "reshard_after_forward": p.reshard_after_forward, "dp_shard": p.dp_shard}
    best = None
    for dp, tp in itertools.product(_divisors(world), _divisors(world)):
        if world % (dp * tp):
            continue
        pp = world // (dp * tp)
        for zero, recompute, micro_batch, reshard in itertools.product(
                (0, 1, 2, 3), ("none", "selective", "full"), sorted({t.micro_batch, 1}), dict.fromkeys((p.reshard_after_forward, True))):
            if reshard is False and zero != 3:
                continue  # ZeRO-3's units kept gathered through the step: only at ZeRO-3
            change = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "recompute": recompute, "micro_batch": micro_batch,
                      "reshard_after_forward": reshard}
            candidate = _with(cfg, change)
            if candidate is None:
                continue
            change["dp_shard"] = candidate.parallel.dp_shard
            need = sum(rank_memory(candidate, process_bytes).values())
            if need > budget:
                continue
            key = (sum(change[k] != current[k] for k in change), need)
            if best is None or key < best[0]:
                best = (key, change)
    if best is None:
        return None
    section = {"recompute": "train", "micro_batch": "train"}
    return " --set ".join(f"{section.get(k, 'parallel')}.{k}={str(v).lower() if isinstance(v, bool) else v}"
                          for k, v in best[1].items() if v != current[k]) \
        + f" (about {best[0][1] / GiB:.1f} GiB a rank)"


def _with(cfg: Config, change: dict) -> Config | None:
    """``cfg`` with the layout keys changed, or None when that layout is not valid for the run."""
    dp_shard = cfg.parallel.dp_shard  # kept only where the candidate can shard that way (ZeRO 1-3, a dp it divides)
    dp_shard = dp_shard if change["zero"] >= 1 and change["dp"] % max(dp_shard, 1) == 0 and change["dp"] > dp_shard else 0
    parallel = dataclasses.replace(cfg.parallel, dp=change["dp"], tp=change["tp"], pp=change["pp"], zero=change["zero"],
                                   microbatches=None, sequence_parallel=cfg.parallel.sequence_parallel and change["tp"] > 1,
                                   dp_shard=dp_shard, reshard_after_forward=change["reshard_after_forward"])
    train = dataclasses.replace(cfg.train, recompute=change["recompute"], micro_batch=change["micro_batch"])
    candidate = dataclasses.replace(cfg, parallel=parallel, train=train)
    try:
        candidate = candidate.validate()
        check_layout(candidate)  # what the strategies refuse (ep that does not divide dp, a pp the layers cannot fill)
        return candidate
    except ConfigError:
        return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# --- time ----------------------------------------------------------------------------------------
def slow_step_warning(cfg: Config) -> str | None:
    """One line when a step will take longer than SLOW_STEP_S, from the model's FLOPs per step and
    the rate of this machine's fp32 matrix multiplications, measured here in a fraction of a second
    (its ranks share its cores). On CUDA a generous 1 PFLOP/s a GPU (measuring would open a CUDA
    context in this process, which lives on as torchrun's)."""
    import torch

    from threefold.plan import costs

    tokens = cfg.train.global_batch * cfg.model.seq_len
    flops = costs.model_flops_per_token(cfg.model) * tokens
    if torch.cuda.is_available():
        rate, how = 1e15 * cfg.parallel.world_size, "at least"
    else:
        rate, how = matmul_rate(), "about"
    seconds = flops / rate
    if seconds < SLOW_STEP_S:
        return None
    return (f"warning: one step ({tokens:,} tokens: train.global_batch={cfg.train.global_batch:,} × "
            f"model.seq_len={cfg.model.seq_len}) will take {how} {_duration(seconds)} at {rate / 1e12:,.2f} TFLOP/s; "
            "the progress bar moves once a step")


def matmul_rate() -> float:
    """FLOP/s of fp32 matrix multiplications on this machine's CPU (the best of a few)."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - began)
    return 2 * 512**3 / best


def _duration(seconds: float) -> str:
    for unit, size in (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.0f} s"
