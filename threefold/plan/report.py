"""How the planner's numbers are shown: the JSON shape of one estimate, and rich tables."""
from __future__ import annotations

import numpy as np
from rich import box
from rich.table import Table

from threefold.plan.costs import CP_METHODS, RECOMPUTE, SCHEDULES, Layout

GiB = 2**30

# Seconds of one step, by where they go; they add up to step_time_s.
TIME_PARTS = ("compute", "memory_bound", "tp_exposed", "cp_exposed", "ep_exposed", "pp_exposed", "bubble", "dp_exposed", "optimizer",
              "contention", "stragglers")


def result_json(est: dict, layout: Layout, i: int | None = None) -> dict:
    """One layout's estimate (element ``i`` of array-valued ones) as the JSON DESIGN.md promises."""
    def get(key):
        value = est[key] if i is None or np.ndim(est[key]) == 0 else np.asarray(est[key])[i]
        return value.item() if isinstance(value, np.generic) else value

    def lay(name):
        value = getattr(layout, name)
        return (value if i is None else np.asarray(value)[i]).item() if hasattr(value, "item") else value

    memory = {part: get(f"{part}_bytes") / GiB for part in ("params", "grads", "optimizer", "activations")}
    if get("weight_versions_bytes"):  # 2bw, pipedream: the stored weight versions
        memory["weight_versions"] = get("weight_versions_bytes") / GiB
    memory["reserved"] = get("reserved_bytes") / GiB
    memory["total"] = get("memory_bytes") / GiB
    return {
        "layout": {"tp": int(lay("tp")), "pp": int(lay("pp")), "dp": int(lay("dp")), "cp": int(lay("cp")),
                   "zero": int(lay("zero")), "micro_batch": int(lay("micro_batch")),
                   "virtual_stages": int(lay("virtual_stages")), "sequence_parallel": bool(lay("sequence_parallel")),
                   "recompute": RECOMPUTE[int(lay("recompute"))], "schedule": SCHEDULES[int(lay("schedule"))],
                   "ep": int(lay("ep")), "cp_method": CP_METHODS[int(lay("cp_method"))],
                   "dp_shard": int(lay("dp_shard")),  # only ZeRO-3 keeps units gathered: true below it
                   "reshard_after_forward": bool(lay("reshard_after_forward")) or int(lay("zero")) != 3,
                   "expert_tp": int(lay("expert_tp"))},
        "parameters": {"total": int(get("params_total")), "active": int(get("params_active"))},
        "num_gpus": int(get("num_gpus")), "microbatches": int(get("microbatches")),
        "step_time_s": get("step_time_s"), "tokens_per_s": get("tokens_per_s"), "tflops_per_gpu": get("tflops_per_gpu"),
        "mfu": get("mfu"), "hfu": get("hfu"), "bubble_fraction": get("bubble_fraction"), "fits": bool(get("fits")),
        "memory_gib": memory, "staleness": get("staleness"),
        "comm": {key: get(key) for key in ("dp_bytes", "tp_bytes", "pp_bytes", "cp_bytes", "ep_bytes", "dp_s", "tp_s",
                                           "pp_s", "cp_s", "ep_s", "exposed_s")},
        "time_s": {part: get(f"{part}_s") for part in TIME_PARTS},
    }


def _bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def estimate_tables(result: dict, title: str, capacity_bytes: float) -> list[Table]:
    """Throughput, where the step's time goes, memory per GPU (against the GPU's ``capacity_bytes``)
    and communication per GPU."""
    summary = Table(title=title, show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    for label, value in (("step time", f"{result['step_time_s']:.3f} s"),
                         ("tokens/s", f"{result['tokens_per_s']:,.0f}"),
                         ("TFLOP/s per GPU (model)", f"{result['tflops_per_gpu']:.1f}"),
                         ("MFU / HFU", f"{result['mfu']:.1%} / {result['hfu']:.1%}"),
                         ("micro-batches per replica", f"{result['microbatches']}"),
                         ("pipeline bubble", f"{result['bubble_fraction']:.1%}"),
                         ("fits in memory", f"{'yes' if result['fits'] else '[red]no[/red]'}: "
                                            f"{result['memory_gib']['total']:.1f} of {capacity_gib(capacity_bytes)} GiB")):
        summary.add_row(label, value)

    time = Table(title="Where the step's time goes")
    time.add_column("part")
    time.add_column("seconds", justify="right")
    time.add_column("share", justify="right")
    for part, seconds in result["time_s"].items():
        time.add_row(part.replace("_", " "), f"{seconds:.3f}", f"{seconds / result['step_time_s']:.1%}")

    memory = Table(title="Memory per GPU (fuller pipeline stage)")
    memory.add_column("part")
    memory.add_column("GiB", justify="right")
    for part, gib in result["memory_gib"].items():
        memory.add_row(part, f"{gib:.2f}")

    comm = Table(title="Communication per GPU per step")
    comm.add_column("axis")
    comm.add_column("bytes sent", justify="right")
    comm.add_column("seconds", justify="right")
    for axis in ("dp", "tp", "pp", "cp", "ep"):
        comm.add_row(axis.upper(), _bytes(result["comm"][f"{axis}_bytes"]), f"{result['comm'][f'{axis}_s']:.3f}")
    comm.add_row("exposed", "", f"{result['comm']['exposed_s']:.3f}")
    return [summary, time, memory, comm]


def capacity_gib(n_bytes: float) -> str:
    """A GPU's memory in GiB to a tenth, as its driver reports it (79.6 for an H100, 80 for an A100)."""
    return f"{n_bytes / GiB:.1f}".removesuffix(".0")


def _tflops(flops: float | None) -> str:
    """A FLOP/s figure in TFLOP/s with enough digits to read: a CPU's 0.0712 is not 0."""
    if flops is None:
        return "—"
    tflops = flops / 1e12
    return f"{tflops:,.0f}" if tflops >= 100 else f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.3g}"


def gpu_table(gpus, width: int = 200) -> Table:
    """The catalog as a table for a console ``width`` columns wide: below 130 the descriptions
    go under the table, one line each, so that the figures never wrap or lose digits."""
    wide = width >= 130
    table = Table(title="GPUs the planner knows (--gpu NAME)", box=box.SIMPLE_HEAD, padding=0,
                  pad_edge=False)
    table.add_column("name", no_wrap=True)
    for column in ("TFLOP/s", "fp32\nTFLOP/s", "fp8\nTFLOP/s", "HBM\nGiB", "HBM\nTB/s", "node\nGB/s", "net\nGB/s",
                   "per\nnode", "matmul\neff", "W"):
        table.add_column(column, justify="right", no_wrap=True)  # a header takes two lines; a figure one
    if wide:
        table.add_column("what", ratio=1)
    for gpu in gpus:
        table.add_row(gpu.name, _tflops(gpu.peak_flops), _tflops(gpu.peak_flops_fp32), _tflops(gpu.peak_flops_fp8),
                      capacity_gib(gpu.hbm_bytes),
                      f"{gpu.hbm_bw / 1e12:.3g}", f"{gpu.intra_node_bw / 1e9:,.3g}", f"{gpu.inter_node_bw / 1e9:,.3g}",
                      str(gpu.gpus_per_node), f"{gpu.matmul_efficiency:.2f}",
                      "—" if gpu.rated_power_w is None else f"{gpu.rated_power_w:.0f}",
                      *([gpu.description] if wide else []))
    lines = [] if wide else [f"{gpu.name}: {gpu.description}" for gpu in gpus]
    table.caption = "\n".join(lines + [
        "TFLOP/s: dense 16-bit peak (--dtype float32 and float8: their columns); node/net: bandwidth per GPU, one "
        "direction, within a node and across nodes; matmul eff: the fraction of peak large GEMMs reach on the mean GPU; W: the board "
        "power that fraction holds at (--power-limit-w below it slows the products)"])
    table.caption_justify = "left"
    return table


def plan_table(results: list[dict], reasons: list[str], title: str) -> Table:
    table = Table(title=title)
    for column, justify in (("#", "right"), ("layout", "left"), ("step s", "right"), ("MFU", "right"),
                            ("bubble", "right"), ("GiB/GPU", "right"), ("why", "left")):
        table.add_column(column, justify=justify)
    for rank, (result, reason) in enumerate(zip(results, reasons), 1):
        table.add_row(str(rank), result["describe"], f"{result['step_time_s']:.2f}", f"{result['mfu']:.1%}",
                      f"{result['bubble_fraction']:.0%}", f"{result['memory_gib']['total']:.1f}", reason)
    return table
