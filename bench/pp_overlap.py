"""Data-parallel reduction overlapped with the pipeline's drain, against reducing after the
whole schedule, side by side in one run.

Four gloo processes (one thread each) run dp=2 × pp=2, 1F1B, 8 micro-batches per replica, twice
in the same processes: ``parallel.overlap_grad_reduce = true`` (each bucket reduced as soon as
its stage's last backward of the step has produced it, so the last stage's reductions run while
stage 0 still drains) and ``false`` (every reduction launched after the rank's whole schedule).
Same model, seed and batches; the steps alternate. Reported per side: the median step time (the
slowest rank), the median seconds each rank spent blocked waiting on dp reductions
(``CommRecord.waited``), and the ratios overlap / after-schedule. The bytes are the same (checked).

    .venv/bin/python bench/pp_overlap.py          # writes bench/results/pp_overlap.json
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console

from threefold.config import Config
from threefold.train.engine import build_engine

from common import alternate_steps, fresh_model, join_gloo, spawn_ranks, train_step

RESULTS = Path(__file__).parent / "results" / "pp_overlap.json"
WORLD = 4


def bench_config(overlap: bool, layers: int, hidden: int, micro_batch: int, microbatches: int) -> Config:
    cfg = Config()
    cfg.model.layers, cfg.model.hidden, cfg.model.heads = layers, hidden, 8
    cfg.model.vocab_size, cfg.model.seq_len = 4096, 128
    cfg.train.micro_batch, cfg.train.global_batch = micro_batch, 2 * micro_batch * microbatches
    cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.schedule = 2, 2, "1f1b"
    cfg.parallel.bucket_mb, cfg.parallel.overlap_grad_reduce = 2.0, overlap
    return cfg.validate()


def worker(rank, world, port, args, queue):
    join_gloo(rank, world, port, threads=1, timeout_s=300)
    layers, hidden, micro_batch, microbatches, warmup, steps = args
    engines = {name: build_engine(fresh_model(cfg), cfg) for name, cfg in
               (("overlap", bench_config(True, layers, hidden, micro_batch, microbatches)),
                ("after schedule", bench_config(False, layers, hidden, micro_batch, microbatches)))}
    waited = {name: [] for name in engines}
    sent = {name: [] for name in engines}

    def side(name):
        engine = engines[name]

        def step(inputs, targets):
            rows = inputs.shape[0] // engine.dp_size
            mine = slice(engine.dp_rank * rows, (engine.dp_rank + 1) * rows)
            micro = list(zip(inputs[mine].split(engine.cfg.train.micro_batch),
                             targets[mine].split(engine.cfg.train.micro_batch)))
            records_before = len(engine.comm.ledger.records)
            loss = train_step(engine, micro, engine.cfg)
            dp = [r for r in engine.comm.ledger.records[records_before:] if r.key == "dp"]
            waited[name].append(sum(r.waited for r in dp))
            sent[name].append(sum(r.bytes for r in dp))
            engine.comm.ledger.take()
            return loss
        return step

    cfg = engines["overlap"].cfg
    out = alternate_steps(cfg, {name: side(name) for name in engines}, warmup, steps)
    mine = {name: statistics.median(waited[name][warmup:]) for name in engines}
    everyone = [None] * world
    dist.all_gather_object(everyone, {"waited": mine, "bytes": {n: sent[n][-1] for n in engines}})
    if rank == 0:
        result = {name: {"step_time_s": statistics.median(out[name]["times"]),
                         "dp_waited_s_per_rank": [e["waited"][name] for e in everyone],
                         "dp_bytes_per_rank": [e["bytes"][name] for e in everyone],
                         "losses": out[name]["losses"]} for name in engines}
        queue.put(result)
    for engine in engines.values():
        engine.shutdown()
    dist.destroy_process_group()


@click.command()
@click.option("--layers", default=8, show_default=True)
@click.option("--hidden", default=256, show_default=True)
@click.option("--micro-batch", default=2, show_default=True)
@click.option("--microbatches", default=8, show_default=True)
@click.option("--warmup", default=2, show_default=True)
@click.option("--steps", default=6, show_default=True)
def main(layers, hidden, micro_batch, microbatches, warmup, steps):
    console = Console()
    result = spawn_ranks(WORLD, worker, (layers, hidden, micro_batch, microbatches, warmup, steps))
    on, off = result["overlap"], result["after schedule"]
    assert on["dp_bytes_per_rank"] == off["dp_bytes_per_rank"], "the two orders must send the same bytes"
    assert on["losses"] == off["losses"], "the two orders must compute the same losses"
    result["step_time_ratio"] = on["step_time_s"] / off["step_time_s"]
    result["waited_ratio"] = sum(on["dp_waited_s_per_rank"]) / max(sum(off["dp_waited_s_per_rank"]), 1e-12)
    result["setup"] = {"dp": 2, "pp": 2, "schedule": "1f1b", "layers": layers, "hidden": hidden,
                       "micro_batch": micro_batch, "microbatches": microbatches, "steps": steps}
    for name in ("overlap", "after schedule"):
        r = result[name]
        console.print(f"{name:>15}: step {r['step_time_s'] * 1e3:7.1f} ms, blocked on dp per rank "
                      + ", ".join(f"{w * 1e3:.1f}" for w in r["dp_waited_s_per_rank"]) + " ms")
    console.print(f"overlap / after schedule: step time ×{result['step_time_ratio']:.3f}, "
                  f"time blocked on dp ×{result['waited_ratio']:.3f}")
    for name in ("overlap", "after schedule"):
        del result[name]["losses"]
    RESULTS.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
