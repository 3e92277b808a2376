"""Context-parallel attention: one layer's attention call, forward and backward, at cp = 2 and 4.

The tiny preset's attention (8 heads, 4 key/value heads, head dimension 32) over a sequence of
``--seq-len`` tokens, split in the zigzag layout over cp gloo processes of one thread each, for
each method of ``threefold.parallel.context_parallel`` (ring, allgather, ulysses). Reported per
method: the median time of a call (the slowest rank's), the bytes one rank sent on the cp axis
(against threefold/plan/context.py's formula), the time each rank was blocked waiting on those
transfers (what compute did not hide, and on an unbalanced split the wait for slower ranks),
and the attention blocks each rank computed. The ring runs on the plain contiguous split too,
to show what the zigzag buys.

References, on one process of one thread: PyTorch's scaled_dot_product_attention over the whole
sequence, and our own blocked kernel at cp=1 (the ring core with no ring: the same arithmetic
the cp ranks share out, so ``cp1_blocked / cp_time`` is the speed-up context parallelism gives
over that kernel on this machine).

    .venv/bin/python bench/cp_attention.py                # writes bench/results/cp_attention.json
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from common import join_gloo, save_and_print, spawn_ranks
from threefold.models.presets import get_preset

RESULTS = Path(__file__).parent / "results" / "cp_attention.json"
# name → (method, layout): the three methods on the zigzag split, and the ring on the plain split
VARIANTS = {"ring": ("ring", "zigzag"), "allgather": ("allgather", "zigzag"), "ulysses": ("ulysses", "zigzag"),
            "ring-contiguous": ("ring", "contiguous")}


def tensors(seq_len: int, micro_batch: int):
    """q, k, v and the output's weights of the tiny preset's attention, from one seed."""
    cfg = get_preset("tiny")
    gen = torch.Generator().manual_seed(0)
    q, weight = (torch.randn(micro_batch, cfg.heads, seq_len, cfg.head_dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(micro_batch, cfg.n_kv_heads, seq_len, cfg.head_dim, generator=gen) for _ in range(2))
    return q, k, v, weight


def timed_call(attend, q, k, v, weight) -> float:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    start = time.perf_counter()
    (attend(*leaves) * weight).sum().backward()
    return time.perf_counter() - start


def worker(rank: int, world: int, port: int, seq_len: int, micro_batch: int, warmup: int, repeats: int,
           queue) -> None:
    """One cp rank: every method, ``warmup + repeats`` calls each; rank 0 sends the results."""
    join_gloo(rank, world, port, threads=1, timeout_s=300)
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.context_parallel import CORES, split_positions, split_sequence

    mesh = ParallelMesh({"cp": world}, rank=rank, timeout_s=300)
    comm = Comm(mesh)
    whole = tensors(seq_len, micro_batch)
    results = {}
    for name, (method, layout) in VARIANTS.items():
        q, k, v, weight = (split_sequence(x, world, rank, dim=2, layout=layout) for x in whole)
        positions = split_positions(seq_len, world, rank, layout)
        core = CORES[method](comm, layout)
        times, waited, sent = [], [], []
        for call in range(warmup + repeats):
            dist.barrier()
            elapsed = torch.tensor([timed_call(lambda *x: core(*x, positions), q, k, v, weight)])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a call lasts until the slowest rank is done
            waited_here = sum(r.waited for r in comm.ledger.records)
            sent_here = comm.ledger.take().get("cp", 0)
            if call >= warmup:
                times.append(elapsed.item())
                waited.append(waited_here)
                sent.append(sent_here)
        blocks = [None] * world
        dist.all_gather_object(blocks, core.blocks // (warmup + repeats))
        waited_all = [None] * world
        dist.all_gather_object(waited_all, statistics.median(waited))
        results[name] = {"method": method, "layout": layout, "call_s": statistics.median(times),
                         "bytes_per_call": sent[0], "waited_s_per_rank": waited_all, "blocks_per_rank": blocks}
    if rank == 0:
        queue.put(results)
    mesh.shutdown()
    dist.destroy_process_group()


def single_process(seq_len: int, micro_batch: int, warmup: int, repeats: int) -> dict:
    """The references on one thread: PyTorch's SDPA and our blocked kernel (the ring core at cp=1)."""
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import attention_core
    from threefold.parallel.context_parallel import RingAttention

    torch.set_num_threads(1)
    q, k, v, weight = tensors(seq_len, micro_batch)
    ring = RingAttention(Comm(ParallelMesh({})))
    positions = torch.arange(seq_len)
    out = {}
    for name, attend in (("sdpa", attention_core), ("blocked", lambda *x: ring(*x, positions))):
        times = [timed_call(attend, q, k, v, weight) for _ in range(warmup + repeats)][warmup:]
        out[name] = statistics.median(times)
    return out


def results_table(results: dict) -> Table:
    table = Table(title=f"one attention call, forward + backward: tiny preset, {results['seq_len']} tokens × "
                        f"{results['micro_batch']}, 1 thread per rank; cp=1: SDPA {results['cp1']['sdpa']:.3f} s, "
                        f"blocked {results['cp1']['blocked']:.3f} s")
    for column in ("cp", "method", "call (s)", "cp1 blocked / call", "bytes sent", "formula", "waited (s) per rank",
                   "blocks per rank"):
        table.add_column(column, justify="right")
    for cp, variants in results["cp"].items():
        for name, run in variants.items():
            table.add_row(cp, name, f"{run['call_s']:.3f}", f"{results['cp1']['blocked'] / run['call_s']:.2f}",
                          f"{run['bytes_per_call']:,}", f"{run['formula_bytes']:,}",
                          " ".join(f"{w:.2f}" for w in run["waited_s_per_rank"]),
                          " ".join(map(str, run["blocks_per_rank"])))
    return table


@click.command()
@click.option("--seq-len", default=2048, show_default=True, help="Tokens per sequence (divisible by 2·cp).")
@click.option("--micro-batch", default=1, show_default=True, help="Sequences per call.")
@click.option("--warmup", default=1, show_default=True, help="Untimed calls of each method first.")
@click.option("--repeats", default=5, show_default=True, help="Timed calls of each method.")
@click.option("--cp", "cps", type=int, multiple=True, help="Context-parallel degrees (repeatable; default 2 and 4).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(seq_len, micro_batch, warmup, repeats, cps, out) -> None:
    """Time, bytes, exposed communication and load balance of ring / all-gather / Ulysses attention."""
    from threefold.plan.context import cp_bytes_per_layer, qkv_bytes

    console = Console()
    cfg = get_preset("tiny")
    results = {"preset": "tiny", "heads": cfg.heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
               "seq_len": seq_len, "micro_batch": micro_batch, "threads_per_rank": 1, "warmup": warmup,
               "repeats": repeats, "torch_version": torch.__version__, "cp": {}}
    with console.status("cp=1 references"):
        results["cp1"] = single_process(seq_len, micro_batch, warmup, repeats)
    for cp in cps or (2, 4):
        with console.status(f"cp={cp}: every method"):
            runs = spawn_ranks(cp, worker, seq_len, micro_batch, warmup, repeats)
        b_q, b_kv = qkv_bytes(micro_batch, seq_len, cfg.heads, cfg.n_kv_heads, cfg.head_dim, cp)
        for run in runs.values():
            run["formula_bytes"] = round(cp_bytes_per_layer(run["method"], cp, b_q, b_kv))
        results["cp"][str(cp)] = runs
    results["load_average_1min"] = os.getloadavg()[0]  # other processes on the machine, at the end
    save_and_print(results, out, results_table(results), console)


if __name__ == "__main__":
    main()
