"""Context parallelism in training, against PyTorch's own where it runs and against cp=1.

1. PyTorch's ``torch.distributed.tensor.experimental.context_parallel`` on this machine's CPUs
   with gloo: one causal scaled_dot_product_attention call, forward and backward, at cp=2 over
   two spawned ranks. It runs, or the exact error is recorded (torch 2.13 on CPU:
   ``NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
   not have a sharding strategy registered`` — its ring handles only the CUDA kernels' ops).
2. The comparison that does run here: ``threefold train`` of configs/long_context.toml at a
   sequence both fit, the same model, batch and steps, once at cp=4 (ring attention, 4 ranks) and
   once at cp=1 (one process). Reported: the median step time after the first step, the ratio,
   the peak activations a rank kept, and the losses (equal up to float rounding: the same
   global batch).

    .venv/bin/python bench/cp_training.py        # writes bench/results/cp_training.json
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import traceback
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from common import join_gloo, save_and_print, spawn_ranks

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "cp_training.json"
CONFIG = "configs/long_context.toml"


def torch_cp_worker(rank: int, world: int, port: int, seq_len: int, queue) -> None:
    """One rank of PyTorch's context parallelism over the tiny preset's attention shapes."""
    join_gloo(rank, world, port, threads=1, timeout_s=120)
    import time

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, seq_len, 32, generator=gen)
    k, v = (torch.randn(1, 4, seq_len, 32, generator=gen).repeat_interleave(2, dim=1) for _ in range(2))
    result = {"runs": False, "error": None, "call_s": None}
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
            leaves = [x.requires_grad_() for x in (q, k, v)]  # sharded in place first: leaves cannot be resized
            start = time.perf_counter()
            F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
            result.update(runs=True, call_s=time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - what failed is the result
        lines = str(err).strip().splitlines()
        result["error"] = f"{type(err).__name__}: {lines[0] if lines else ''}"
        result["raised_at"] = traceback.extract_tb(err.__traceback__)[-1].name
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def train_run(cp: int, seq_len: int, steps: int, out: Path) -> dict:
    """``threefold train`` of the long-context config at ``cp``; its metrics, summarized."""
    metrics = out / f"cp{cp}.jsonl"
    sets = [f"parallel.cp={cp}", f"model.seq_len={seq_len}", f"train.steps={steps}", "train.eval_every=0",
            "train.sample_tokens=0", 'train.checkpoint_dir=""']
    load_before = os.getloadavg()[0]
    done = subprocess.run([str(ROOT / ".venv" / "bin" / "threefold"), "train", "--config", CONFIG,
                           *(a for s in sets for a in ("--set", s)), "--metrics-file", str(metrics), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode:
        raise click.ClickException(f"cp={cp}: training failed: {done.stderr.strip().splitlines()[-1:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = records[1:] or records
    return {"cp": cp, "ranks": cp, "set": sets, "step_time_s": statistics.median(r["step_time_s"] for r in timed),
            "step_times_s": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records],
            "activations_peak_bytes": max(r["memory"]["activations"] for r in records),
            "cp_bytes_per_step": records[-1]["comm_bytes"].get("cp", 0),
            "cp_exposed_s": statistics.median(r.get("comm_exposed_s", {}).get("cp", 0.0) for r in timed),
            "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


@click.command()
@click.option("--seq-len", default=4096, show_default=True, help="Tokens per sequence (cp=1 must fit it).")
@click.option("--steps", default=3, show_default=True, help="Training steps of each run (the first is not timed).")
@click.option("--cp", "cp", default=4, show_default=True, help="The context-parallel degree compared with cp=1.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(seq_len, steps, cp, out) -> None:
    """Train the long-context config at cp and at cp=1; try PyTorch's context_parallel first."""
    console = Console()
    with console.status("PyTorch's context_parallel, cp=2 on gloo"):
        torch_cp = spawn_ranks(2, torch_cp_worker, 1024)
    results = {"torch_version": torch.__version__, "config": CONFIG, "seq_len": seq_len, "steps": steps,
               "torch_context_parallel": torch_cp,
               "compared_with": "torch context_parallel" if torch_cp["runs"] else "cp=1"}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for degree in (cp, 1):
            with console.status(f"threefold train, cp={degree}, {steps} steps of {seq_len} tokens"):
                runs[degree] = train_run(degree, seq_len, steps, Path(tmp))
    results["runs"] = {f"cp{d}": run for d, run in runs.items()}
    results["cp1_over_cp_step_time"] = runs[1]["step_time_s"] / runs[cp]["step_time_s"]
    results["activations_cp1_over_cp"] = runs[1]["activations_peak_bytes"] / runs[cp]["activations_peak_bytes"]
    results["max_loss_difference"] = max(abs(a - b) for a, b in zip(runs[1]["losses"], runs[cp]["losses"]))

    table = Table(title=f"{CONFIG} at {seq_len} tokens, {steps} steps: cp={cp} (ring) against cp=1; "
                        f"PyTorch's context_parallel: {'runs' if torch_cp['runs'] else torch_cp['error']}")
    for column in ("run", "ranks", "step s (median)", "peak activations / rank", "cp bytes / step", "cp exposed s",
                   "losses", "load 1 min"):
        table.add_column(column, justify="right")
    for run in runs.values():
        table.add_row(f"cp={run['cp']}", str(run["ranks"]), f"{run['step_time_s']:.2f}",
                      f"{run['activations_peak_bytes'] / 2**20:,.0f} MiB", f"{run['cp_bytes_per_step']:,}",
                      f"{run['cp_exposed_s']:.3f}", " ".join(f"{x:.4f}" for x in run["losses"]),
                      "{} → {}".format(*run["load_1min"]))
    table.caption = (f"step time cp=1 / cp={cp}: {results['cp1_over_cp_step_time']:.2f}; activations per rank "
                     f"cp=1 / cp={cp}: {results['activations_cp1_over_cp']:.2f}")
    save_and_print(results, out, table, console)


if __name__ == "__main__":
    main()
