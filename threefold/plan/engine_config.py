"""``threefold plan --config-out FILE.toml``: the fastest layout of a search that threefold's own
engine runs, written as a config for ``threefold dryrun`` and ``threefold train``.

The planner prices layouts the engine does not run (op-level checkpointing, GPT blocks, fp8,
interleaved chunks of unequal length); each candidate, fastest first, is turned into the
config's keys and checked by the engine's own loader (``configure.load_config``: the fields and
every strategy's layout check), and the first it accepts is written.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from threefold.config import ConfigError, ModelConfig, notes_after_checks
from threefold.plan import costs

TRIED = 500  # candidates checked, fastest first, before saying none runs
SHAPE = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab_size", "seq_len", "tie_embeddings")  # always written


OP = ("op-level checkpointing, which the engine does not run (its selective recomputation is the attention "
      "core at every ZeRO stage): plan with --recompute full or none, or a ZeRO stage below 3")
EXPERT_TP = ("each expert split over the tp ranks (Megatron-Core's --expert-tp = tp), which the engine does not run "
             "(it runs experts whole: --expert-tp 0, or 1 with ep a multiple of tp·cp)")


def config_keys(work: costs.Workload, layout: costs.Layout, i: int) -> dict:
    """{section: {key: value}} of the config that runs layout ``i`` of ``layout``."""
    model = work.model
    default = ModelConfig()
    shape = {f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)
             if getattr(model, f.name) is not None and f.name not in ("preset", "init_from")
             and (f.name in SHAPE or getattr(model, f.name) != getattr(default, f.name))
             and (model.moe_experts or not f.name.startswith("moe_"))}
    lay = {f.name: np.asarray(getattr(layout, f.name))[i].item() for f in dataclasses.fields(costs.Layout)}
    parallel = dict(tp=lay["tp"], pp=lay["pp"], dp=lay["dp"], cp=lay["cp"], ep=lay["ep"], zero=lay["zero"],
                    sequence_parallel=bool(lay["sequence_parallel"]), schedule=costs.SCHEDULES[lay["schedule"]],
                    virtual_stages=lay["virtual_stages"], cp_method=costs.CP_METHODS[lay["cp_method"]],
                    overlap_grad_reduce=work.overlap_dp)
    if model.moe_experts and lay["expert_tp"] == 1 and costs.expert_grid_differs(lay["tp"], lay["cp"], lay["dp"],
                                                                                lay["ep"]):
        parallel["expert_tp"] = 1  # the ep group folded over tp and cp (elsewhere the two placements are one)
    if lay["dp_shard"]:  # hybrid sharding: ZeRO-3 over groups of dp_shard dp ranks
        parallel["dp_shard"] = lay["dp_shard"]
    if lay["zero"] == 3:  # resharding or kept gathered through the step, said either way
        parallel["reshard_after_forward"] = lay["reshard_after_forward"]
    if lay["zero"] < 3 and lay["dp"] * lay["cp"] > 1:  # the gradient buckets the layout was priced with, of fp32
        parallel["bucket_mb"] = round(float(costs.bucket_params(work, lay["dp"] * lay["cp"])) * 4 / 2**20, 1)
    if work.tp_comm_overlap and parallel["sequence_parallel"]:  # the engine's overlap: SP's collectives as rings
        parallel["tp_overlap"] = True
    train = dict(global_batch=work.global_batch, micro_batch=lay["micro_batch"],
                 recompute=costs.RECOMPUTE[lay["recompute"]], dtype="float32" if work.precision == "fp32" else "bfloat16")
    return {"model": shape, "parallel": parallel, "train": train}


def _toml(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def overrides(keys: dict) -> list[str]:
    return [f"{section}.{key}={_toml(value)}" for section, values in keys.items() for key, value in values.items()]


def check_model(work: costs.Workload) -> None:
    """ConfigError, one line, for a model or precision the engine does not train at all: before the search."""
    if work.model.arch != "llama":
        raise ConfigError(f"--config-out: threefold's engine trains Llama-style blocks; this model is {work.model.arch}")
    if work.precision == "fp8":
        raise ConfigError("--config-out: threefold's engine does not train in float8; plan with --dtype bf16")


def first_runnable(work: costs.Workload, layouts: costs.Layout, order) -> tuple[int, dict, str]:
    """(rank in ``order``, config keys, why the fastest layout does not run, if it does not) of the
    fastest layout the engine's loader accepts; the model has passed ``check_model`` (before the search)."""
    from threefold.configure import load_config  # the engine's own checks, only when a config is written

    first = ""
    for rank, i in enumerate(order[:TRIED]):
        keys = config_keys(work, layouts, int(i))
        try:
            if keys["train"]["recompute"] == "op":
                raise ConfigError(OP)
            if work.model.moe_experts and int(np.asarray(layouts.expert_tp)[int(i)]) > 1:
                raise ConfigError(EXPERT_TP)
            with notes_after_checks():
                load_config(None, overrides(keys))
        except ConfigError as err:
            first = first or str(err)
            continue
        return rank, keys, first
    tried = min(len(order), TRIED)
    none = "the one layout that fits does not run" if tried == 1 else f"none of the {tried:,} fastest layouts runs"
    raise ConfigError(f"--config-out: {none} on threefold's engine; the fastest: {first}")


def not_carried(work: costs.Workload) -> list[str]:
    """What the plan assumed that the engine's config does not say (the engine runs its own way)."""
    return [line for line, differs in (
        ("eager attention (the engine runs PyTorch's fused attention)", work.attention != "flash"),
        ("bf16 gradients (the engine keeps fp32 gradients)", work.grad_bytes == 2)) if differs]


def write(path: str | Path, keys: dict, header: list[str]) -> Path:
    lines = [f"# {line}" for line in header]
    for section, values in keys.items():
        lines += ["", f"[{section}]", *(f"{key} = {_toml(value)}" for key, value in values.items())]
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    except OSError as err:  # a folder this process may not write to, a full disk, …
        raise ConfigError(f"--config-out: cannot write {path} ({err.strerror or err})") from None
    return path
