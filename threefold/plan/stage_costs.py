"""What a pipeline stage costs on a planned GPU: ``parallel.stage_costs = "planner"``.

The stage split (``schedule.balanced_split``) balances the seconds the planner itself counts
for the GPU named by ``parallel.stage_costs_gpu``: ``costs.part_seconds`` of the run's layout,
each part's products and attention core (recomputation as configured) plus its memory-bound
kernels, forward and backward of one micro-batch, the same figures ``costs.estimate`` adds up
into a stage's compute. The embedding, a lookup, costs nothing there; a Mixture-of-Experts
block costs its router, shared and local experts at balanced routing. Communication is left
out: tp's collectives grow with a stage's blocks as its compute does, and pp's messages are
the same for every stage.

Nothing is timed, so this is what splits a model that cannot run here: the dry run of a large
job (fake tensors), or a run meant for a GPU this machine is not.
"""
from __future__ import annotations

from threefold.config import Config, ConfigError
from threefold.models.sizes import is_moe_layer
from threefold.parallel.pipeline.schedule import LayerCosts
from threefold.plan import costs
from threefold.plan.hardware import CATALOG, GPU, catalog_name, unknown_gpu_hint


def planned_gpu(cfg: Config) -> GPU:
    """The catalog GPU of ``parallel.stage_costs_gpu`` computing in the run's ``train.dtype``;
    ConfigError (one line) for a name the catalog lacks or a dtype it has no peak for."""
    given, dtype = cfg.parallel.stage_costs_gpu, cfg.train.dtype
    name = catalog_name(given)
    if name is None:
        raise ConfigError(f"parallel.stage_costs_gpu: unknown GPU {given!r} (known: {', '.join(CATALOG)})"
                          + unknown_gpu_hint(given, list(CATALOG)))
    gpu = CATALOG[name]
    if dtype == "float32" and gpu.peak_flops_fp32 is None:
        raise ConfigError(f"parallel.stage_costs_gpu: the catalog has no float32 peak for {name} (train.dtype = "
                          "float32); plan it with train.dtype = bfloat16 or another GPU")
    return gpu.with_dtype(dtype)


def planner_layer_costs(cfg: Config) -> LayerCosts:
    """Seconds of one micro-batch's forward and backward through the embedding, each block and
    the head with the loss, on one rank of the run's layout (tp, cp, ep, sequence parallelism,
    recompute, micro-batch, dtype) on the planned GPU (see the module docstring)."""
    p, t, model = cfg.parallel, cfg.train, cfg.model
    gpu = planned_gpu(cfg)
    work = costs.Workload(model, t.global_batch, precision="fp32" if t.dtype == "float32" else "mixed")
    layout = costs.Layout.named(recompute=t.recompute, tp=p.tp, cp=p.cp, ep=p.ep, micro_batch=t.micro_batch,
                                sequence_parallel=p.sequence_parallel, expert_tp=int(p.experts_folded))
    parts = costs.part_seconds(work, layout, gpu)

    def seconds(part: dict) -> float:
        return float(part["math"] + part["memory"])

    block, moe_block = seconds(parts["block"]), seconds(parts["moe_block"]) if model.moe_experts else None
    blocks = tuple(moe_block if is_moe_layer(model, i) else block for i in range(model.layers))
    source = (f"planner, {gpu.name} {t.dtype}, micro-batch {t.micro_batch} × {model.seq_len // p.cp} tokens, "
              f"recompute {t.recompute}")
    return LayerCosts(0.0, blocks, seconds(parts["head"]), source=source)


def modelled_layer_costs(cfg: Config) -> LayerCosts | None:
    """The costs a pipeline split balances that are known before anything runs: the planner's
    when ``parallel.stage_costs = "planner"``; None otherwise (FLOPs, or measured by the engine)."""
    return planner_layer_costs(cfg) if cfg.parallel.stage_costs == "planner" else None


def check_stage_costs(cfg: Config) -> None:
    """What ``load_config`` checks before any process starts: the planned GPU exists."""
    if cfg.parallel.stage_costs == "planner":
        planned_gpu(cfg)

