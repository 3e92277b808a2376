"""The experts' SwiGLU as grouped matrix products (``torch._grouped_mm``) against the per-expert
loop it is tested against, forward and forward + backward, on this CPU.

Shapes: the tiny MoE's (8 experts of 352 on hidden 256, top-2 over a micro-batch of 8 × 256
tokens: 4096 rows) with balanced and with skewed counts (half the rows to one expert, as an
untrained router does), and a fine-grained one (64 experts of 128, top-8 over 1024 tokens:
8192 rows, DeepSeek/Qwen3-style many small experts), where the loop's per-expert overhead
grows. The yardstick is one dense SwiGLU over the same rows and width (the same FLOPs with
no grouping at all). The sides alternate and each reports its median time.

    .venv/bin/python bench/moe_grouped_mm.py            # writes bench/results/moe_grouped_mm.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from threefold.models.moe import GroupedExperts

RESULTS = Path(__file__).parent / "results" / "moe_grouped_mm.json"
CASES = {  # name: (experts, hidden, expert width, rows, share of the rows on expert 0 or None for balanced)
    "tiny-moe, balanced": (8, 256, 352, 4096, None),
    "tiny-moe, skewed": (8, 256, 352, 4096, 0.5),
    "64 experts of 128": (64, 256, 128, 8192, None),
}


def split_counts(rows: int, experts: int, first_share: float | None) -> torch.Tensor:
    if first_share is None:
        return torch.full((experts,), rows // experts)
    first = int(rows * first_share)
    rest = torch.full((experts - 1,), (rows - first) // (experts - 1))
    return torch.cat([torch.tensor([rows - int(rest.sum())]), rest])


def timed(fn, backward: bool) -> float:
    start = time.perf_counter()
    y = fn()
    if backward:
        y.backward(torch.ones_like(y))
    return time.perf_counter() - start


def run_case(experts: int, hidden: int, width: int, rows: int, first_share, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    block = GroupedExperts(experts, hidden, width)
    for p in block.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    dense = [(torch.randn(shape, generator=gen) * 0.02).requires_grad_()
             for shape in ((width, hidden), (width, hidden), (hidden, width))]
    x = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    counts = split_counts(rows, experts, first_share)

    def experts_with(grouped: bool):
        block.grouped = grouped
        return block(x, counts)

    sides = {"grouped": lambda: experts_with(True), "loop": lambda: experts_with(False),
             "dense": lambda: F.linear(F.silu(F.linear(x, dense[0])) * F.linear(x, dense[1]), dense[2])}
    out = {}
    for backward in (False, True):
        times = {name: [] for name in sides}
        for step in range(repeats + 1):
            names = list(sides) if step % 2 == 0 else list(reversed(sides))
            for name in names:
                seconds = timed(sides[name], backward)
                if step:  # the first round warms up
                    times[name].append(seconds)
        key = "forward_backward" if backward else "forward"
        out[key] = {name: statistics.median(t) for name, t in times.items()}
    flops = 2 * 3 * rows * hidden * width
    out["gflop_forward"] = flops / 1e9
    return out


@click.command()
@click.option("--repeats", default=5, show_default=True, help="timed rounds per side and case")
def main(repeats: int) -> None:
    console = Console()
    torch.manual_seed(0)
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__, "cases": {}}
    table = Table(title=f"experts' SwiGLU, fp32, {torch.get_num_threads()} threads (median seconds)")
    for column in ("case", "pass", "grouped", "loop", "dense peer", "loop / grouped", "grouped GFLOP/s"):
        table.add_column(column)
    for name, case in CASES.items():
        numbers = run_case(*case, repeats)
        results["cases"][name] = numbers
        for key, label, factor in (("forward", "fwd", 1), ("forward_backward", "fwd+bwd", 3)):
            t = numbers[key]
            table.add_row(name, label, f"{t['grouped']:.4f}", f"{t['loop']:.4f}", f"{t['dense']:.4f}",
                          f"{t['loop'] / t['grouped']:.2f}", f"{factor * numbers['gflop_forward'] / t['grouped']:.0f}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    console.print(table)
    console.print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
