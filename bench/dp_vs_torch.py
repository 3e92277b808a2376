"""threefold's data parallelism against PyTorch's own, same model, batches and machine, one run.

    DDP    (dp=2)  threefold zero 0  vs  torch.nn.parallel.DistributedDataParallel
    ZeRO-1 (dp=2, 4)  threefold zero 1  vs  DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    ZeRO-1 (dp=4, dp_shard 2)  threefold zero 1 over pairs, all-reduced between them  vs  DDP over
                   all four + ZeroRedundancyOptimizer over the same pairs (torch's way to keep
                   each pair's optimizer states whole: all-reduce everything, shard the step)
    ZeRO-3 (dp=2)  threefold zero 3  vs  FSDP2 fully_shard per block (+ root)
    ZeRO-3 (dp=4)  threefold zero 3  vs  FSDP2
    HSDP   (dp=4)  threefold zero 3, dp_shard 2  vs  FSDP2 on a 2-D mesh (replicate 2 × shard 2):
                   both shard over dp ranks {0,1} and {2,3} and all-reduce between {0,2} and {1,3}

Each world of processes (gloo on 127.0.0.1, the cores split between ranks) builds both engines
from the same seed and alternates them step by step (the order flips every step), with a
barrier before each step, so machine noise hits both alike. A third contender, "compute only",
runs the same micro-batches on each rank with no communication at all: the floor that perfect
overlap would reach. Both sides do the same work per step: forward/backward over the rank's
micro-batches, the loss averaged for the log, clipping by the global norm, AdamW, zero grads.

Reported per layout: median step times, the ratio threefold / torch (target ≤ 1.0: the median
over steps of the two step times measured back to back, which cancels load that drifts between
steps; the ratio of the medians is kept too), the largest
relative difference between the two sides' losses, and from threefold's ledger the bytes sent
per step, the total time its collectives were in flight and the part of it that was exposed
(the time compute waited on them).

    .venv/bin/python bench/dp_vs_torch.py                 # writes bench/results/dp.json
    .venv/bin/python bench/dp_vs_torch.py --steps 4 --warmup 1
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from threefold.config import Config
from threefold.models.llama import Llama, cross_entropy
from threefold.train.engine import Engine, build_adamw
from threefold.train.trainer import split_micro_batches

from common import fresh_model, join_gloo, preset_config, spawn_ranks, step_at_lr, train_step

RESULTS = Path(__file__).parent / "results" / "dp.json"
LAYOUTS = [("ddp", 2), ("zero1", 2), ("zero1", 4), ("zero1-shard", 4), ("zero3", 2), ("zero3", 4), ("hsdp", 4)]
HSDP_SHARD = 2  # the hybrid layouts' shard groups: dp ranks {0, 1}, {2, 3}


def bench_config(kind: str, dp: int, bucket_mb: float) -> Config:
    cfg = preset_config("tiny")
    cfg.parallel.dp = dp
    cfg.parallel.zero = 3 if kind in ("zero3", "hsdp") else 1 if kind.startswith("zero1") else 0
    cfg.parallel.dp_shard = HSDP_SHARD if kind in ("hsdp", "zero1-shard") else 0
    cfg.parallel.bucket_mb = bucket_mb
    cfg.parallel.timeout_s = 120
    cfg.train.global_batch = 16
    cfg.train.micro_batch = 4
    cfg.train.lr = 1e-3
    return cfg.validate()


# --- PyTorch's own, driven like an Engine --------------------------------------------------------
class TorchPeer:
    """PyTorch's DDP (with ZeroRedundancyOptimizer for "zero1") or FSDP2 (HSDP for "hsdp") around
    the plain model, with the same optimizer and step."""

    def __init__(self, kind: str, model: Llama, cfg: Config):
        self.cfg, self.kind, self.mesh = cfg, kind, None
        if kind in ("ddp", "zero1", "zero1-shard"):
            from torch.nn.parallel import DistributedDataParallel

            self.module = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            if kind == "hsdp":  # a 2-D mesh is FSDP2's HSDP: replicate over dim 0, shard over dim 1; row-major,
                # so the shard groups are consecutive ranks, as threefold's "dps" groups are
                shard = cfg.parallel.dp_shard
                mesh = init_device_mesh("cpu", (cfg.parallel.dp // shard, shard),
                                        mesh_dim_names=("replicate", "shard"))
            else:
                mesh = init_device_mesh("cpu", (cfg.parallel.dp,))
            self.mesh = mesh
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            self.module = fully_shard(model, mesh=mesh)
        self.optimizer = build_adamw(model.named_parameters(), cfg)
        if kind.startswith("zero1"):
            from torch.distributed.optim import ZeroRedundancyOptimizer

            group = None  # the optimizer's states over every rank, or over consecutive pairs
            if kind == "zero1-shard":
                shard = cfg.parallel.dp_shard
                pairs = [dist.new_group(list(range(g, g + shard))) for g in range(0, cfg.parallel.dp, shard)]
                group = pairs[dist.get_rank() // shard]
            t = cfg.train
            self.optimizer = ZeroRedundancyOptimizer(
                [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in self.optimizer.param_groups],
                optimizer_class=torch.optim.AdamW, process_group=group, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)

    def forward_backward(self, micro_batches) -> float:
        total = torch.zeros(())
        for i, (inputs, targets) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # DDP: no all-reduce before the last micro-batch; FSDP2 reduce-scatters each one, as ours.
            skip_sync = (self.module.no_sync() if self.kind in ("ddp", "zero1", "zero1-shard") and not last
                         else contextlib.nullcontext())
            with skip_sync:
                loss = cross_entropy(self.module(inputs), targets)
                (loss / len(micro_batches)).backward()
            total += loss.detach()
        loss = (total / len(micro_batches)).double()
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def optimizer_step(self, lr: float) -> None:
        step_at_lr(self.optimizer, lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# --- one rank ----------------------------------------------------------------------------------
def compare(kind: str, cfg: Config, steps: int, warmup: int) -> dict:
    from threefold.train.engine import build_engine

    rank, world = dist.get_rank(), dist.get_world_size()
    contenders = {"threefold": build_engine(fresh_model(cfg), cfg), "torch": TorchPeer(kind, fresh_model(cfg), cfg),
                  "compute only": Engine(fresh_model(cfg), cfg)}
    ours = contenders["threefold"]
    if kind == "hsdp":  # both sides must shard over the same ranks and all-reduce over the same ranks
        mesh = contenders["torch"].mesh
        groups = {"threefold": (ours.mesh.ranks("dps"), ours.mesh.ranks("dpr")),
                  "torch": (mesh["shard"].mesh.tolist(), mesh["replicate"].mesh.tolist())}
        if groups["threefold"] != groups["torch"]:
            raise RuntimeError(f"rank {rank}: (shard, replicate) groups differ: {groups}")
    if kind == "zero1-shard":  # threefold's shard groups are the pairs torch's optimizer shards over
        shard = cfg.parallel.dp_shard
        if ours.mesh.ranks("dps") != list(range(rank // shard * shard, rank // shard * shard + shard)):
            raise RuntimeError(f"rank {rank}: threefold's shard group {ours.mesh.ranks('dps')} is not its pair")
    gen = torch.Generator().manual_seed(cfg.train.seed)
    times = {name: [] for name in contenders}
    losses = {name: [] for name in contenders}
    comm_total = comm_exposed = 0.0
    comm_bytes = {}
    for step in range(warmup + steps):
        tokens = torch.randint(cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=gen)
        rows = tokens[rank * cfg.train.global_batch // world:(rank + 1) * cfg.train.global_batch // world]
        micro_batches = split_micro_batches(rows[:, :-1], rows[:, 1:], cfg.train.micro_batch)
        names = list(contenders) if step % 2 == 0 else list(reversed(contenders))
        for name in names:
            dist.barrier()
            began = time.perf_counter()
            loss = train_step(contenders[name], micro_batches, cfg)
            elapsed = time.perf_counter() - began
            if step >= warmup:
                times[name].append(elapsed)
            losses[name].append(loss)
        records = list(ours.comm.ledger.records)
        comm_bytes = ours.comm_bytes()
        if step >= warmup:
            comm_total += sum(r.seconds or 0.0 for r in records)
            comm_exposed += sum(r.waited for r in records)
    ours.shutdown()
    if rank:
        return {}
    mine, theirs = losses["threefold"], losses["torch"]
    median = {name: statistics.median(t) for name, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["threefold"], times["torch"]))
    layout = f"{kind} dp={world}" + (f" shard={cfg.parallel.dp_shard}" if cfg.parallel.dp_shard else "")
    return {"layout": layout, "world": world, "threads_per_rank": torch.get_num_threads(),
            "steps": steps, "step_time_s": median, "step_times_s": times,
            "ratio_threefold_over_torch": paired, "ratio_of_medians": median["threefold"] / median["torch"],
            "load_average_after": os.getloadavg()[0],
            "losses": {"threefold": mine, "torch": theirs},
            "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(mine, theirs)),
            "comm_bytes_per_step": comm_bytes,
            "comm_in_flight_s_per_step": comm_total / steps, "comm_exposed_s_per_step": comm_exposed / steps}


def worker(rank: int, world: int, port: int, kinds: list[str], steps: int, warmup: int, bucket_mb: float,
           queue) -> None:
    """One rank of a world (spawn_ranks starts it): every layout of ``kinds``; rank 0 sends the results."""
    join_gloo(rank, world, port, threads=max(1, (os.cpu_count() or 1) // world), timeout_s=300)
    results = [compare(kind, bench_config(kind, world, bucket_mb), steps, warmup) for kind in kinds]
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def results_table(results: list[dict]) -> Table:
    table = Table(title="threefold vs PyTorch: tiny preset (4.0M params), 16 × 256 tokens per step, gloo, fp32; "
                        "median step time (s)")
    for column in ("layout", "threefold", "torch", "compute only", "ratio", "loss Δ rel",
                   "MB/step", "comm in flight", "exposed"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for r in results:
        t = r["step_time_s"]
        table.add_row(r["layout"], f"{t['threefold']:.3f}", f"{t['torch']:.3f}", f"{t['compute only']:.3f}",
                      f"{r['ratio_threefold_over_torch']:.2f}", f"{r['loss_max_rel_diff']:.1e}",
                      f"{r['comm_bytes_per_step'].get('dp', 0) / 1e6:.1f}",
                      f"{r['comm_in_flight_s_per_step']:.3f}", f"{r['comm_exposed_s_per_step']:.3f}")
    return table


@click.command()
@click.option("--steps", default=6, show_default=True, help="Timed steps per contender.")
@click.option("--warmup", default=2, show_default=True, help="Untimed steps first.")
@click.option("--bucket-mb", default=4.0, show_default=True, help="Gradient bucket size for both DDPs (MiB).")
def main(steps: int, warmup: int, bucket_mb: float) -> None:
    console = Console(width=150)
    results = []
    for world in sorted({w for _, w in LAYOUTS}):
        kinds = [k for k, w in LAYOUTS if w == world]
        console.print(f"world {world}: {', '.join(kinds)} …")
        results += spawn_ranks(world, worker, kinds, steps, warmup, bucket_mb)
    for r in results:
        if r["loss_max_rel_diff"] > 1e-4:
            raise SystemExit(f"{r['layout']}: losses disagree with PyTorch's by {r['loss_max_rel_diff']:.1e}")
    console.print(results_table(results))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine_cores": os.cpu_count(), "bucket_mb": bucket_mb, "results": results},
                                  indent=1))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
