"""The layout matrix: every parallel layout against one process, through the public build_engine.

Every case trains the same tiny model from the same seed on the same global batches for a few
AdamW steps, and must reproduce the single-process run's losses, gradient norms and parameters,
and send exactly the bytes per mesh axis that the planner's formulas give. The strategy test
files use the helpers here (``global_batches``, ``my_micro_batches``, ``train_steps``,
``train_reference``) for their own, strategy-specific checks.

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
        out["memory"] = engine.memory_bytes()
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


# --- the matrix ---------------------------------------------------------------------------------
# name → the layout's overrides. The single-process reference of a case drops its [parallel] keys.
CASES = {
    "dp2": ["parallel.dp=2"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
    "dp4-zero1": ["parallel.dp=4", "parallel.zero=1"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "dp2-tp2-zero1-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1", "parallel.sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2"],
    "dp2-pp2-zero2": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2"],
    "dp2-pp2-zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3"],
    "dp2-tp2-pp2-zero3-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=3",
                             "parallel.sequence_parallel=true"],
    "dp2-pp2-interleaved-zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1",
                                  "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
    "dp2-pp2-zb-h1-zero1": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=1", "parallel.schedule=zb-h1"],
    "dp2-pp2-zb-h1-zero2": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=2", "parallel.schedule=zb-h1"],
    "dp2-tp2-pp2-1f1b-zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1"],
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
    "cp2-ring-selective": ["parallel.cp=2", "parallel.cp_method=ring", "train.recompute=selective"],
    "cp2-ulysses-full": ["parallel.cp=2", "parallel.cp_method=ulysses", "train.recompute=full"],
})


def run_case(name: str) -> dict:
    """One rank's run of a matrix case (the workers call this)."""
    cfg = matrix_config(*CASES[name])
    engine = new_engine(cfg)
    out_initial = engine.model_state_dict()  # built on meta, materialised per rank
    engine.comm_bytes()  # the gathers of that state are not a step's
    out = train_steps(engine, cfg, global_batches(cfg, STEPS))
    out["initial"] = out_initial
    out["state"] = engine.model_state_dict()
    out["coords"] = dict(engine.mesh.coords)
    out["local_numel"] = sum(s.tensor.numel() for s in engine.weight_shards())  # the pieces this rank holds
    out["stage_numel"] = stage_numel(engine)
    out["layers_here"] = sum(len(part.blocks) for part in engine.parts.values())  # this rank's blocks
    engine.load_model_state_dict(out["state"])
    out["round_trip"] = all(torch.equal(engine.model_state_dict()[k], v) for k, v in out["state"].items())
    engine.comm_bytes()  # the gathers above
    engine.shutdown()
    return out


def stage_numel(engine) -> int:
    """Elements of this rank's stages' parameters as tp leaves them (the dp group replicates them):
    what ``costs.dp_bytes_per_step`` is given. Counted from the placements, so ZeRO-3 counts too."""
    import math

    keys = {key for sync in engine.syncs.values() for key in sync.keys}
    local = 0
    for key in keys:
        placement = engine.placements[key]
        shape = list(placement.full_shape)
        if placement.dim is not None:
            shape[placement.dim] = -(-shape[placement.dim] // engine.mesh.size("tp"))  # padded tp slice
        local += math.prod(shape)
    return local


@functools.lru_cache(maxsize=None)
def reference(name: str) -> dict:
    """One process, one thread like each worker (the same kernels), the case's batch split."""
    cfg = matrix_config(*CASES[name])
    single = [o for o in CASES[name] if not o.startswith("parallel.")]
    # The same micro-batches per replica as the case: global_batch / (dp · micro_batch) each.
    ref_cfg = matrix_config(*single)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, out = train_reference(ref_cfg, STEPS)
    finally:
        torch.set_num_threads(threads)
    out["cfg"] = cfg
    return out


def assert_same_training(results: list[dict], ref: dict, loss_rtol: float = LOSS_RTOL,
                         param_rtol: float = PARAM_RTOL) -> None:
    for r in results:
        if "initial" in r:  # every layout starts from exactly the single-process weights
            assert all(torch.equal(r["initial"][k], v) for k, v in ref["initial"].items())
        assert r["losses"] == pytest.approx(ref["losses"], rel=loss_rtol)
        assert r["norms"] == pytest.approx(ref["norms"], rel=10 * loss_rtol)
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
