"""Single-process training throughput and MFU of the `small` preset on this CPU.

One optimizer step is what the trainer does: ``forward_backward`` over the step's micro-batches,
gradient clipping, AdamW. Tokens are random, from a seeded generator (speed does not depend on
them). MFU = model FLOPs per token (``threefold.plan.costs.model_flops_per_token``: 6·N plus
attention, no recompute) × tokens/s ÷ the matmul peak of the same dtype, measured in this run
on the same threads — so MFU says how close training gets to the best this CPU does on one
large matrix product.

    .venv/bin/python bench/single_process.py                  # fp32 and bf16, writes bench/results/single_process.json
    .venv/bin/python bench/single_process.py --profile        # also: which operators take the time
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from threefold.config import Config
from threefold.plan.calibrate import cpu_cores, measure_matmul_flops
from threefold.plan.costs import model_flops_per_token
from threefold.train.engine import Engine
from threefold.train.trainer import split_micro_batches

from common import fresh_model, preset_config, train_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
RESULTS = Path(__file__).parent / "results" / "single_process.json"


def bench_config(dtype: str, micro_batch: int, microbatches: int) -> Config:
    cfg = preset_config("small")
    cfg.train.dtype = dtype
    cfg.train.micro_batch = micro_batch
    cfg.train.global_batch = micro_batch * microbatches
    return cfg.validate()


def random_batches(cfg: Config, steps: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``steps`` global batches of random tokens, split into the engine's micro-batches."""
    gen = torch.Generator().manual_seed(seed)
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(cfg.model.vocab_size, shape, generator=gen)
        batches.append(split_micro_batches(tokens[:, :-1], tokens[:, 1:], cfg.train.micro_batch))
    return batches


def build_engine(cfg: Config, compile_model: bool) -> Engine:
    model = fresh_model(cfg)
    engine = Engine(model, cfg)
    if compile_model:
        engine.model = torch.compile(model)  # the optimizer keeps the same parameters
    return engine


def time_training(cfg: Config, warmup: int, steps: int, compile_model: bool) -> dict:
    """Wall and CPU seconds of each of ``steps`` timed steps after ``warmup`` untimed ones."""
    engine = build_engine(cfg, compile_model)
    batches = random_batches(cfg, warmup + steps, cfg.train.seed)
    for micro_batches in batches[:warmup]:
        train_step(engine, micro_batches, cfg)
    wall, cpu, losses = [], [], []
    for micro_batches in batches[warmup:]:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(train_step(engine, micro_batches, cfg))
        wall.append(time.perf_counter() - wall_start)
        cpu.append(time.process_time() - cpu_start)
    return {"step_times_s": wall, "step_cpu_times_s": cpu, "final_loss": losses[-1]}


def matmul_peaks(dtype: torch.dtype, threads: int) -> dict:
    """Matmul FLOPs per wall second and per CPU second of this process."""
    return {"wall": measure_matmul_flops(dtype, threads, size=2048, seconds=1.0),
            "cpu": measure_matmul_flops(dtype, threads, size=2048, seconds=1.0, clock=time.process_time)}


def summarize(cfg: Config, timing: dict, peaks: dict, threads: int) -> dict:
    """MFU against the wall clock, and against CPU time.

    ``cpu_share`` = CPU time ÷ (wall time × threads): near 1 on an idle machine, lower when other
    processes took the cores. ``mfu_cpu_time`` = model FLOPs per CPU second of training ÷ matmul
    FLOPs per CPU second: what MFU would be if this process had the cores to itself, as far as
    time-sharing goes (caches and memory bandwidth are still shared).
    """
    step_time = statistics.median(timing["step_times_s"])
    step_cpu_time = statistics.median(timing["step_cpu_times_s"])
    flops_per_step = model_flops_per_token(cfg.model) * cfg.train.global_batch * cfg.model.seq_len
    return {**timing, "step_time_s": step_time,
            "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / step_time,
            "model_flops_per_s": flops_per_step / step_time, "matmul_peak_flops": peaks["wall"],
            "mfu": flops_per_step / step_time / peaks["wall"],
            "cpu_share": sum(timing["step_cpu_times_s"]) / (sum(timing["step_times_s"]) * threads),
            "matmul_flops_per_cpu_s": peaks["cpu"], "mfu_cpu_time": flops_per_step / step_cpu_time / peaks["cpu"]}


def profile_training(cfg: Config, steps: int, compile_model: bool, console: Console) -> None:
    """Print the operators that take the most time over ``steps`` steps (after two warm-up steps)."""
    engine = build_engine(cfg, compile_model)
    batches = random_batches(cfg, steps + 2, cfg.train.seed)
    for micro_batches in batches[:2]:
        train_step(engine, micro_batches, cfg)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for micro_batches in batches[2:]:
            train_step(engine, micro_batches, cfg)
    console.print(f"[bold]{cfg.train.dtype}: operators by self CPU time over {steps} steps")
    console.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


def results_table(results: dict) -> Table:
    runs = results["runs"]
    table = Table(title=f"small preset, one process, {results['threads']} threads, "
                        f"{results['tokens_per_step']} tokens per step")
    table.add_column("")
    for dtype in runs:
        table.add_column(dtype, justify="right")
    rows = [("step time (median)", lambda r: f"{r['step_time_s']:.3f} s"),
            ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
            ("model FLOP/s", lambda r: f"{r['model_flops_per_s'] / 1e9:,.1f} G"),
            ("matmul peak FLOP/s", lambda r: f"{r['matmul_peak_flops'] / 1e9:,.1f} G"),
            ("MFU", lambda r: f"{r['mfu']:.1%}"),
            ("CPU share", lambda r: f"{r['cpu_share']:.0%}"),
            ("MFU per CPU second", lambda r: f"{r['mfu_cpu_time']:.1%}")]
    for name, cell in rows:
        table.add_row(name, *(cell(run) for run in runs.values()))
    return table


@click.command()
@click.option("--dtype", "dtypes", type=click.Choice(list(DTYPES)), multiple=True,
              help="Training dtype (repeatable; default: both). bfloat16 is autocast over fp32 weights.")
@click.option("--micro-batch", default=8, show_default=True, help="Sequences per forward/backward.")
@click.option("--microbatches", default=2, show_default=True, help="Micro-batches per optimizer step.")
@click.option("--warmup", default=3, show_default=True, help="Untimed steps first.")
@click.option("--steps", default=8, show_default=True, help="Timed steps.")
@click.option("--threads", type=int, default=None, help="Intra-op threads (default: this machine's cores).")
@click.option("--compile", "compile_model", is_flag=True, help="Train a torch.compile'd model (inductor).")
@click.option("--profile", is_flag=True, help="Also profile a few steps and print the top operators.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(dtypes, micro_batch, microbatches, warmup, steps, threads, compile_model, profile, out) -> None:
    """Tokens/s and MFU of the `small` preset training on one process."""
    console = Console()
    threads = threads or cpu_cores()
    torch.set_num_threads(threads)
    runs = {}
    for dtype in dtypes or DTYPES:
        cfg = bench_config(dtype, micro_batch, microbatches)
        with console.status(f"{dtype}: matmul peak, {warmup} + {steps} training steps, matmul peak"):
            # The peak is measured before and after training and the higher one kept: other
            # processes on the machine can only slow a measurement down.
            before = matmul_peaks(DTYPES[dtype], threads)
            timing = time_training(cfg, warmup, steps, compile_model)
            after = matmul_peaks(DTYPES[dtype], threads)
        peaks = {clock: max(before[clock], after[clock]) for clock in before}
        runs[dtype] = summarize(cfg, timing, peaks, threads)
        if profile:
            profile_training(cfg, 3, compile_model, console)
    results = {"preset": "small", "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len,
               "micro_batch": micro_batch, "microbatches": microbatches,
               "tokens_per_step": cfg.train.global_batch * cfg.model.seq_len,
               "model_flops_per_token": model_flops_per_token(cfg.model), "threads": threads,
               "compile": compile_model, "warmup_steps": warmup, "timed_steps": steps,
               "torch_version": torch.__version__, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")  # replaced in one step: no half-written results
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(out)
    console.print(results_table(results))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
