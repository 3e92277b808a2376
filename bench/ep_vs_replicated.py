"""Expert parallelism against replicated experts, side by side in one run.

Two gloo processes (one thread each) train the same MoE model on the same batches twice in the
same processes: dp=2 with every expert on both ranks (``parallel.ep = 1``), and dp=2 · ep=2, where
each rank holds half of every layer's experts and the tokens travel to them (all_to_all,
parallel/expert_parallel.py). Same seed, weights and batches; the steps alternate. Reported per
side: the median step time (the slowest rank), the bytes per step and rank by ledger key, the
model-state bytes per rank; and the ratios ep2 / replicated. The losses agree to rounding
(checked).

    .venv/bin/python bench/ep_vs_replicated.py    # writes bench/results/ep_vs_replicated.json
"""
from __future__ import annotations

import json
from pathlib import Path

import click
import torch
from rich.console import Console

from threefold.config import Config
from threefold.models.presets import get_preset
from threefold.train.engine import build_engine

from common import alternate_steps, dp_rows_step, fresh_model, join_gloo, report_sides, same_losses, spawn_ranks

RESULTS = Path(__file__).parent / "results" / "ep_vs_replicated.json"
WORLD = 2
SIDES = {"replicated": 1, "ep2": 2}  # name → parallel.ep


def bench_config(ep: int, micro_batch: int, microbatches: int) -> Config:
    cfg = Config()
    cfg.model = get_preset("tiny-moe")
    cfg.model.vocab_size, cfg.model.seq_len = 4096, 256
    cfg.train.micro_batch, cfg.train.global_batch = micro_batch, WORLD * micro_batch * microbatches
    cfg.parallel.dp, cfg.parallel.ep, cfg.parallel.bucket_mb = WORLD, ep, 25.0
    return cfg.validate()


def worker(rank, world, port, args, queue):
    join_gloo(rank, world, port, threads=1, timeout_s=600)
    micro_batch, microbatches, warmup, steps = args
    engines = {name: build_engine(fresh_model(cfg), cfg) for name, cfg in
               ((name, bench_config(ep, micro_batch, microbatches)) for name, ep in SIDES.items())}
    sent = {name: {} for name in engines}

    def side(name):
        engine = engines[name]

        def step(inputs, targets):
            loss = dp_rows_step(engine, inputs, targets)
            sent[name] = engine.comm_bytes()
            return loss
        return step

    out = alternate_steps(engines["ep2"].cfg, {name: side(name) for name in engines}, warmup, steps)
    memory = {name: engine.memory_bytes() for name, engine in engines.items()}
    report_sides(rank, queue, engines, out, {"bytes": sent, "memory": memory})


@click.command()
@click.option("--micro-batch", default=4, show_default=True)
@click.option("--microbatches", default=2, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--steps", default=6, show_default=True)
def main(micro_batch, microbatches, warmup, steps):
    console = Console()
    result = spawn_ranks(WORLD, worker, (micro_batch, microbatches, warmup, steps))
    replicated, ep2 = result["replicated"], result["ep2"]
    result["max_loss_difference"] = same_losses(replicated, ep2, 1e-4)
    result["step_time_ratio"] = ep2["step_time_s"] / replicated["step_time_s"]
    params = [side["memory_per_rank"][0]["params"] + side["memory_per_rank"][0]["optimizer"]
              for side in (ep2, replicated)]
    result["model_state_ratio"] = params[0] / params[1]
    cfg = bench_config(2, micro_batch, microbatches)
    result["setup"] = {"dp": WORLD, "model": "tiny-moe", "experts": cfg.model.moe_experts, "top_k": 2,
                       "hidden": cfg.model.hidden, "seq_len": cfg.model.seq_len, "micro_batch": micro_batch,
                       "microbatches": microbatches, "steps": steps, "threads_per_rank": 1}
    for name in SIDES:
        r = result[name]
        console.print(f"{name:>10}: step {r['step_time_s'] * 1e3:7.1f} ms, bytes/step on rank 0 "
                      f"{r['bytes_per_rank'][0]}, params+optimizer {r['memory_per_rank'][0]['params'] / 2**20:.1f}"
                      f"+{r['memory_per_rank'][0]['optimizer'] / 2**20:.1f} MiB")
    console.print(f"ep2 / replicated: step time ×{result['step_time_ratio']:.3f}, "
                  f"parameters + optimizer states ×{result['model_state_ratio']:.3f}")
    for name in SIDES:
        del result[name]["losses"]
    RESULTS.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
