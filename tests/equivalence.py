"""The layout matrix: every parallel layout against one process, through the public build_engine.

Every case trains the same tiny model from the same seed on the same global batches for a few
AdamW steps, and must reproduce the single-process run's losses, gradient norms and parameters,
and send exactly the bytes per mesh axis that the planner's formulas give. The strategy test
files (test_data_parallel, test_tensor_parallel, test_pipeline) run their layouts through the
same ``case`` and ``reference`` and compare them with the same ``assert_same_training``; what
they add are checks specific to their strategy (bytes, memory, overlap, activations).

Tolerances (fp32), in one place. A parallel layout computes the same sums in another order:
per-rank partial gradients then their reduction (dp), row-parallel partial products and
shard-by-shard softmax sums (tp), the tied weight's two parts added across stages (pp). That
changes results by rounding only. Losses and gradient norms agree to ~1e-7 relative
(asserted: ``LOSS_RTOL``). Parameters after the steps: Adam divides each gradient by its own
running RMS, which turns rounding noise on near-zero gradients into differences of up to lr per
step. Measured on this machine (AMD Zen 4), the per-tensor relative L2 error is ~1e-7–2e-5
(the largest: tp with full recomputation, whose recomputed forward runs other kernels); the
reference compared with itself under another micro-batch split shows the same floor. We assert
``PARAM_RTOL`` per tensor, and that the error stays under 1e-3 of the distance the parameters
travelled (a wrong gradient — a missing all-reduce, a gradient twice too large — gives errors of
the order of that distance). Ranks that hold the same tensor must agree on it bitwise.
"""
from __future__ import annotations

import functools

import pytest
import torch

LOSS_RTOL = 1e-6
PARAM_RTOL = 5e-5
STEPS = 5

# 8 heads and 4 kv heads split over tp 2 and 4; the vocabulary of 250 is padded under tp.
TINY = ["model.layers=4", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.vocab_size=250",
        "model.seq_len=32", "train.global_batch=16", "train.micro_batch=2", "train.lr=1e-3", "train.grad_clip=0.5",
        "parallel.bucket_mb=0.1", "parallel.timeout_s=60"]


def matrix_config(*overrides: str):
    from threefold.configure import load_config

    return load_config(None, TINY + list(overrides))


def global_batches(cfg, steps: int) -> list[torch.Tensor]:
    """Random tokens from a fixed seed: the same global batches for every layout."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=gen)
            for _ in range(steps)]


def my_micro_batches(tokens: torch.Tensor, cfg, dp_rank: int, dp_size: int):
    """Rows [r·B/dp, (r+1)·B/dp) of the global batch, split into micro-batches, as the trainer does."""
    rows = tokens.shape[0] // dp_size
    mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
    return list(zip(mine[:, :-1].split(cfg.train.micro_batch), mine[:, 1:].split(cfg.train.micro_batch)))


def train_steps(engine, cfg, batches) -> dict:
    """Losses, gradient norms and bytes per step; model-state bytes after the last update."""
    out = {"losses": [], "norms": [], "comm": [], "memory": None}
    for tokens in batches:
        out["losses"].append(engine.forward_backward(my_micro_batches(tokens, cfg, engine.dp_rank, engine.dp_size)))
        out["norms"].append(engine.clip_grad_norm(cfg.train.grad_clip))
        engine.optimizer_step(cfg.train.lr)
        if cfg.model.moe_experts:  # the routing bias steps from the step's counts, summed over the ranks
            out.setdefault("moe", []).append(engine.end_moe_step())
        out["memory"] = engine.memory_bytes()
        # Gradient elements this rank sums over an axis (SP's norm gains over tp), as it holds them.
        out["partial_numel"] = sum(s.tensor.numel() for s in engine.grad_shards() if s.partial)
        engine.zero_grad()
        out["comm"].append(engine.comm_bytes())
    return out


def new_engine(cfg):
    """The plain model built on the meta device and transformed by the public ``build_engine``,
    which draws this rank's tensors from the run's seed, as the trainer does."""
    from threefold.models.llama import Llama
    from threefold.train.engine import build_engine

    with torch.device("meta"):
        model = Llama(cfg.model)
    model.set_recompute(cfg.train.recompute)
    return build_engine(model, cfg)


def train_reference(cfg, steps: int):
    """The single-process run every layout is compared with: (its engine, ``train_steps``'
    results plus the initial and final full states)."""
    from threefold.models.llama import Llama
    from threefold.train.engine import Engine

    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    model.set_recompute(cfg.train.recompute)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, cfg)
    out = train_steps(engine, cfg, global_batches(cfg, steps))
    out["state"], out["initial"] = engine.model_state_dict(), initial
    return engine, out


# --- running a layout, and its single-process reference -----------------------------------------
def run_layout(overrides: tuple[str, ...], steps: int = STEPS) -> dict:
    """One rank's run of the layout ``overrides`` (the workers call this): the steps, the states
    before and after, where the rank sits, and an evaluation after the steps."""
    from threefold.configure import load_config

    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    initial = engine.model_state_dict()  # built on meta, materialised per rank
    engine.comm_bytes()  # the gathers of that state are not a step's
    out = train_steps(engine, cfg, global_batches(cfg, steps))
    out["initial"], out["state"] = initial, engine.model_state_dict()
    out["timeline"] = engine.step_timeline()
    out["coords"], out["pp_rank"] = dict(engine.mesh.coords), engine.pp_rank
    out["stage_numel"] = stage_numel(engine)
    out["layers_here"] = sum(len(part.blocks) for part in engine.parts.values())  # this rank's blocks
    engine.load_model_state_dict(out["state"])
    again, plain = engine.model_state_dict(), engine.plain_model().state_dict()
    out["round_trip"] = all(torch.equal(again[k], v) and torch.equal(plain[k], v) for k, v in out["state"].items())
    engine.comm_bytes()  # the gathers above
    out["eval_loss"] = engine.eval_loss(my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:2])
    out["eval_comm"] = engine.comm_bytes()
    engine.shutdown()
    return out


def stage_numel(engine) -> int:
    """Elements of this rank's stages' parameters as tp leaves them (the dp group replicates them):
    what ``costs.dp_bytes_per_step`` is given. Counted from the placements, so ZeRO-3 counts too;
    per stage, so the two copies of a tied weight on DualPipeV's rank 0 count twice, as both are reduced."""
    import math

    local = 0
    for key in (key for sync in engine.syncs.values() for key in set(sync.keys)):
        placement = engine.placements[key]
        shape = list(placement.full_shape)
        if placement.dim is not None:
            shape[placement.dim] = -(-shape[placement.dim] // engine.mesh.size("tp"))  # padded tp slice
        local += math.prod(shape)
    return local


_cases: dict = {}


def case(distributed, overrides) -> list[dict]:
    """Every rank's ``run_layout`` of ``overrides``; each layout runs once per session."""
    from threefold.configure import load_config

    overrides = tuple(overrides)
    if overrides not in _cases:
        world = load_config(None, list(overrides)).parallel.world_size
        _cases[overrides] = distributed.run(world, run_layout, overrides)
    return _cases[overrides]


@functools.lru_cache(maxsize=None)
def _reference(overrides: tuple[str, ...]) -> dict:
    from threefold.configure import load_config

    cfg = load_config(None, [o for o in overrides if not o.startswith("parallel.")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread like each worker: the same kernels
    try:
        engine, out = train_reference(cfg, STEPS)
        out["eval_loss"] = engine.eval_loss(my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:2])
    finally:
        torch.set_num_threads(threads)
    return out


def reference(overrides) -> dict:
    """The layout's single-process run: the same overrides without the [parallel] keys (the same
    global batches, split into the micro-batches one process takes)."""
    return _reference(tuple(overrides))


def assert_same_training(results: list[dict], ref: dict, loss_rtol: float = LOSS_RTOL,
                         param_rtol: float = PARAM_RTOL) -> None:
    for r in results:
        if "initial" in r:  # every layout starts from exactly the single-process weights
            assert all(torch.equal(r["initial"][k], v) for k, v in ref["initial"].items())
        assert r["losses"] == pytest.approx(ref["losses"], rel=loss_rtol)
        assert r["norms"] == pytest.approx(ref["norms"], rel=10 * loss_rtol)
        if "eval_loss" in r and "eval_loss" in ref:
            assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=loss_rtol)
        assert r.get("round_trip", True)
    state = results[0]["state"]
    assert list(state) == list(ref["state"])  # the plain model's keys, in order, with its shapes
    for key, want in ref["state"].items():
        got = state[key]
        assert got.shape == want.shape, key
        error = (got - want).norm().item()
        assert error <= param_rtol * want.norm().item(), key
        assert error <= 1e-3 * (want - ref["initial"][key]).norm().item(), key
        for other in results[1:]:
            assert torch.equal(other["state"][key], got), f"ranks differ in {key}"


# --- the matrix ---------------------------------------------------------------------------------
# name → the layout's overrides (on TINY). Among them, the layouts the one engine made possible.
CASES = {
    "dp2": ["parallel.dp=2"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
    "dp4-zero1": ["parallel.dp=4", "parallel.zero=1"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2-tp2-zero1-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1", "parallel.sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2"],
    "dp2-pp2-zero2": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2"],
    # ZeRO-3 under a pipeline, resharding after each forward (the default keeps the units: below)
    "dp2-pp2-zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.reshard_after_forward=true"],
    "dp2-tp2-pp2-zero3-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=3",
                             "parallel.sequence_parallel=true", "parallel.reshard_after_forward=true"],
    "dp2-pp2-interleaved-zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1",
                                  "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
    # ZeRO-3 over two chunks a rank: one reduction in flight for both chunks' units (fsdp.Reductions)
    "dp2-pp2-interleaved-zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3",
                                  "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                  "parallel.reshard_after_forward=true"],
    "dp2-pp2-zb-h1-zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1", "parallel.schedule=zb-h1"],
    "dp2-pp2-zb-h1-zero2": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2", "parallel.schedule=zb-h1"],
    # ZeRO-3 under a split backward: B gathers each unit again, W reads no weight (fsdp.py)
    "dp2-pp2-zb-h1-zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=zb-h1",
                            "parallel.reshard_after_forward=true"],
    # DualPipeV's rank 0 holds both ends of the tied embedding, a copy each, their gradients added there
    "dp2-pp2-dualpipev-zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=dualpipev",
                                "parallel.reshard_after_forward=true"],
    # ZeRO-3 kept gathered through the step (torchtitan's FSDP under a pipeline, and the engine's
    # default there: the key left out): the gradients accumulate over the micro-batches in the full
    # buffers, one gather and one reduction a step
    "dp2-pp2-zero3-keep": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3"],
    "dp2-pp2-interleaved-zero3-keep": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3",
                                       "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
    "dp2-pp2-dualpipev-zero3-keep": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=dualpipev"],
    "dp2-pp2-zb-h1-zero3-keep": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=zb-h1",
                                 "parallel.reshard_after_forward=false"],
    "dp4-hsdp2-keep": ["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
    "dp2-tp2-pp2-1f1b-zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1"],
    "pp2-dualpipev": ["parallel.pp=2", "parallel.schedule=dualpipev"],
}
# Context parallelism: every method on cp2 and dp2·cp2, one method on each of the others.
for _method in ("ring", "allgather", "ulysses"):
    CASES[f"cp2-{_method}"] = ["parallel.cp=2", f"parallel.cp_method={_method}"]
    CASES[f"dp2-cp2-{_method}"] = ["parallel.dp=2", "parallel.cp=2", f"parallel.cp_method={_method}"]
CASES.update({
    "cp4-ring": ["parallel.cp=4", "parallel.cp_method=ring"],
    "tp2-cp2-sp-allgather": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                             "parallel.cp_method=allgather"],
    "tp2-cp2-ulysses": ["parallel.tp=2", "parallel.cp=2", "parallel.cp_method=ulysses"],  # without SP
    "pp2-cp2-ring": ["parallel.pp=2", "parallel.cp=2", "parallel.cp_method=ring"],
    "pp2-cp2-zb-h1-allgather": ["parallel.pp=2", "parallel.cp=2", "parallel.schedule=zb-h1",
                                "parallel.cp_method=allgather"],
    "dp2-cp2-zero3-ulysses": ["parallel.dp=2", "parallel.cp=2", "parallel.zero=3", "parallel.cp_method=ulysses"],
    # hybrid sharding: ZeRO-3 over pairs of dp ranks (with their cp ranks), the pairs all-reduced
    "dp4-hsdp2": ["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2"],
    "dp4-cp2-hsdp2-ring": ["parallel.dp=4", "parallel.cp=2", "parallel.zero=3", "parallel.dp_shard=2",
                           "parallel.cp_method=ring"],
    # and ZeRO-1, 2 over pairs (Megatron-Core's distributed optimizer instances), the step's shards all-reduced
    "dp4-zero1-shard2": ["parallel.dp=4", "parallel.zero=1", "parallel.dp_shard=2"],
    "dp4-zero2-shard2": ["parallel.dp=4", "parallel.zero=2", "parallel.dp_shard=2"],
    "dp4-cp2-zero1-shard2-ring": ["parallel.dp=4", "parallel.cp=2", "parallel.zero=1", "parallel.dp_shard=2",
                                  "parallel.cp_method=ring", "parallel.overlap_grad_reduce=false"],
    "dp4-pp2-zb-h1-zero2-shard2": ["parallel.dp=4", "parallel.pp=2", "parallel.zero=2", "parallel.dp_shard=2",
                                   "parallel.schedule=zb-h1"],
    # hybrid sharding over two chunks a rank: the chunks' one reduction in flight, then its
    # all-reduce between the groups, whichever chunk started it (fsdp.Reductions)
    "dp4-pp2-interleaved-hsdp2": ["parallel.dp=4", "parallel.pp=2", "parallel.zero=3", "parallel.dp_shard=2",
                                  "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                  "parallel.reshard_after_forward=true"],
    "cp2-ring-selective": ["parallel.cp=2", "parallel.cp_method=ring", "train.recompute=selective"],
    "cp2-ulysses-full": ["parallel.cp=2", "parallel.cp_method=ulysses", "train.recompute=full"],
})


def matrix_case(name: str) -> tuple[str, ...]:
    return tuple(TINY + CASES[name])


# --- dry runs of the matrix's layouts -----------------------------------------------------------
def dry_run_case(name: str):
    """The layout ``name`` as a dry run (threefold/train/dryrun.py: one step of one rank on fake
    tensors) takes it: 2 micro-batches a replica, 2 × pp with a pipeline (a warm-up, a steady
    state and a cool-down on every stage), where the matrix trains on 2 to 8. A dry run's time
    goes as its micro-batches (cp2-ring: 6.8 s on 8, 1.7 s on 2), and predict_rank, which it is
    held to, counts them."""
    from threefold.train.dryrun import dry_run_config

    cfg = matrix_config(*CASES[name])
    return dry_run_config(matrix_config(*CASES[name], few_micro_batches(cfg)), cfg.parallel.world_size)


def few_micro_batches(cfg) -> str:
    """The ``train.global_batch`` override that gives ``cfg`` 2 micro-batches a replica, 2 × pp
    with a pipeline (dry_run_case's)."""
    p = cfg.parallel
    return f"train.global_batch={p.dp * cfg.train.micro_batch * (2 * p.pp if p.pp > 1 else 2)}"


_dry_runs: dict = {}


def dry_run(cfg, rank: int) -> dict:
    """``dry_run_rank(cfg, rank)`` (on CPU fake tensors), once per session for each config and
    rank: the tests that check other figures of the same rank's step share it (they read it; none
    changes it)."""
    from threefold.train.dryrun import dry_run_rank

    key = (repr(cfg), rank)
    if key not in _dry_runs:
        _dry_runs[key] = dry_run_rank(cfg, rank)
    return _dry_runs[key]
