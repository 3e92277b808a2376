"""Measure this machine so the planner can predict runs on it: ``threefold calibrate``.

The profile describes one *worker*, the way a GPU catalog entry describes one GPU: the machine
is assumed to run one worker process per core (``gpus_per_node``), each with
``threads = cores // gpus_per_node`` intra-op threads, and the compute and memory figures are
measured at that thread count. ``intra_node_bw`` is the all-reduce bus bandwidth between those
workers over gloo on loopback (the NCCL-tests convention: algorithm bandwidth × 2(n−1)/n), and
``inter_node_bw`` is the same figure, since a calibrated CPU has no second tier of links.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import multiprocessing
import os
import queue
import resource
import statistics
import time
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from threefold.config import ConfigError, check_output_path
from threefold.distributed.launch import keep_large_blocks_in_the_heap
from threefold.plan.profile import FITTED_KEYS, PROFILE_KEYS, load_profile, profile_path, save_profile  # noqa: F401
from threefold.words import plural

# CPU seconds each shared-core worker computes, untimed, before the phases are timed. One warm
# micro-batch is not its steady state: timed from there, the first two phases of 8 workers on 2
# cores (each worker's first 0.5 and 1 s of CPU) took 124-137 ms a micro-batch and the four after
# them 82-91, the first of 4 workers 125 ms and then 80-85, against 76-80 for 2 workers
# (2026-12-05); the median of three rounds read 1.44-1.65× at 8 workers where the steady phases
# say 1.08-1.14×, while training ran as fast as on the day its profile read 1.15×.
WARM_CPU_S = 1.0


@dataclasses.dataclass(frozen=True)
class Settings:
    """How hard each measurement works; larger sizes and longer runs give steadier numbers."""
    matmul_size: int
    matmul_seconds: float
    copy_bytes: int
    copy_seconds: float
    gloo_bytes: int
    gloo_reps: int
    gloo_timeout_s: float
    wait_calls: int = 50
    curve_calls: int = 20  # each size of each kind in _measure_collective_curves, each round
    curve_rounds: int = 9  # _measure_collective_curves' passes, the median of them kept
    shared_core_seconds: float = 2.0  # each phase of measure_shared_core_slowdown
    shared_core_rounds: int = 2
    shared_core_warm_cpu_s: float = WARM_CPU_S  # measure_shared_core_slowdown's untimed start
    concurrent_rounds: int = 3  # measure_shared_core_slowdown's phases of a worker on every core


# Three rounds of the shared-core phases: the median of two is their mean, which one slow phase
# moves (a demo's profile read 1.33× at 8 workers where nine before it read 1.14-1.24×).
FULL = Settings(matmul_size=2048, matmul_seconds=2.0, copy_bytes=512 << 20, copy_seconds=1.5,
                gloo_bytes=64 << 20, gloo_reps=5, gloo_timeout_s=120.0, shared_core_rounds=3)
QUICK = Settings(matmul_size=1024, matmul_seconds=0.6, copy_bytes=128 << 20, copy_seconds=0.4,
                 gloo_bytes=16 << 20, gloo_reps=3, gloo_timeout_s=60.0, wait_calls=20, curve_calls=8,
                 shared_core_seconds=0.6, shared_core_rounds=1, concurrent_rounds=1)


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset and container CPU sets)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ram_bytes() -> int:
    """Physical memory, or the container's cgroup limit when that is lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, ValueError):
        return min(physical, int(Path("/sys/fs/cgroup/memory.max").read_text()))  # "max" → ValueError
    return physical


@contextlib.contextmanager
def intra_op_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _typical_rate(work, units_per_call: float, seconds: float, trials: int = 5, clock=time.perf_counter) -> float:
    """The median units/s of ``work()`` over ``trials`` timed trials that together last about ``seconds``.

    The first call is a warm-up (library initialisation, page faults, weight packing) and also
    sizes the trials. The median, not the best: a training run lasts minutes and runs at its
    typical speed, not at its fastest burst. On this 2-core VM the best of twelve trials was
    3% above their median for 2048-wide products and 5% for the reference model, and a
    one-process run's median step was 4-9% slower than its best (docs/planner.md).
    """
    work()
    start = time.perf_counter()
    work()
    one_call = max(time.perf_counter() - start, 1e-9)
    calls = max(1, round(seconds / trials / one_call))
    rates = []
    for _ in range(trials):
        start = clock()
        for _ in range(calls):
            work()
        rates.append(calls * units_per_call / max(clock() - start, 1e-9))
    return statistics.median(rates)


def measure_matmul_flops(dtype: torch.dtype, threads: int, size: int = 2048, seconds: float = 1.0,
                         clock=time.perf_counter) -> float:
    """FLOP/s of ``size``×``size`` matrix products in ``dtype`` on ``threads`` threads (the median trial).

    With ``clock=time.process_time`` it is FLOPs per second of this process's CPU time instead:
    what the cores do while they run this process, whatever else the machine is running.
    """
    gen = torch.Generator().manual_seed(0)
    with intra_op_threads(threads):
        probe = torch.randn(PROBE_SIZE, PROBE_SIZE, generator=gen).to(dtype)
        torch.mm(probe, probe)
        start = time.perf_counter()
        torch.mm(probe, probe)
        size = product_size(2.0 * PROBE_SIZE**3 / max(time.perf_counter() - start, 1e-9), size, seconds)
        a = torch.randn(size, size, generator=gen).to(dtype)
        b = torch.randn(size, size, generator=gen).to(dtype)
        out = torch.empty(size, size, dtype=dtype)
        return _typical_rate(lambda: torch.mm(a, b, out=out), 2.0 * size**3, seconds, clock=clock)


PROBE_SIZE = 256


def product_size(probe_flops: float, size: int, seconds: float) -> int:
    """The matmul size to time: ``size``, halved while one product at the probe's rate would
    take over half of ``seconds``. A dtype without a fast kernel on this CPU (bf16 without
    AVX-512 BF16 or AMX runs a reference loop, 1.2 GFLOP/s on an AVX2 VM here) would otherwise
    spend minutes on the seven 2048-wide products a measurement takes; a fast kernel (45 GFLOP/s
    at 256 wide there, a quarter of its large-product rate) keeps 2048 unless it is under 17."""
    while size > PROBE_SIZE and 2.0 * size**3 / probe_flops > seconds / 2:
        size //= 2
    return size


def measure_memory_bandwidth(threads: int | None = None, size_bytes: int = 512 << 20, seconds: float = 1.0) -> float:
    """Bytes/s of a large tensor copy, counting the read and the write (STREAM's convention)."""
    src = torch.ones(size_bytes // 4)
    dst = torch.empty_like(src)
    with intra_op_threads(threads or cpu_cores()):
        return _typical_rate(lambda: dst.copy_(src), 2.0 * size_bytes, seconds)


def measure_attention_flops(dtype: torch.dtype, threads: int, batch: int = 4, heads: int = 8, seq: int = 512,
                            head_dim: int = 64, seconds: float = 1.0) -> float:
    """FLOP/s of causal ``scaled_dot_product_attention``, forward and backward, counted as the
    planner counts the attention core: 2·b·s²·heads·head_dim executed in the forward (the causal
    half of q·kᵀ and scores·v) and twice that in the backward."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, generator=gen).to(dtype)

    def forward_backward():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    with intra_op_threads(threads):
        return _typical_rate(forward_backward, 3 * 2.0 * batch * seq * seq * heads * head_dim, seconds)


# The reference model calibrate times a block's fixed cost on (dispatch_seconds_per_block):
# threefold's own blocks, small enough for a CPU, large enough that each activation (4 MB) is
# the size a CPU run streams.
REFERENCE_MODEL = dict(layers=2, hidden=512, heads=8, kv_heads=4, ffn=1408, vocab_size=4096, seq_len=256)
# The narrow model the memory-bound rate is fitted on (memory_bound_rounds), at micro-batches of
# MEMORY_BOUND_MICRO_BATCHES × 64 tokens: 1-4 MB activations, as a CPU run's. A product's
# FLOPs grow as the width squared and the memory-bound bytes as the width, so at 64 wide the
# norms, rotary, SwiGLU and residuals take about a third of the step (counted at 13 GB/s) where
# at REFERENCE_MODEL's 512 they took a twentieth, and the rate was the small difference of two
# large timings: fitted from it, rounds seconds apart gave 5.7-46 GB/s, and three profiles of
# 2026-12-04 fell back to the copy's bandwidth (a round's products came out longer than the
# whole). Its products run at the 2048-wide products' rate on this CPU (93 GFLOP/s at 4096 × 64
# × 64 against 93); one head of 64 keeps the attention core at the head size calibrate times.
MEMORY_BOUND_MODEL = dict(layers=2, hidden=64, heads=1, kv_heads=1, ffn=None, vocab_size=256, seq_len=64)
MEMORY_BOUND_MICRO_BATCHES = (16, 32, 64)


def reference_step(micro_batch: int = 4, optimizer_every: int = 0, **overrides):
    """The forward and backward, with its loss, of one fp32 micro-batch of REFERENCE_MODEL (its
    sizes changed by ``overrides``), as a function to time; with ``optimizer_every``, the
    gradients accumulate and an AdamW step follows every that many micro-batches, as in training."""
    from threefold.config import ModelConfig
    from threefold.models.llama import Llama, cross_entropy

    model_cfg = ModelConfig(**dict(REFERENCE_MODEL, **overrides))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_cfg.vocab_size, (micro_batch, model_cfg.seq_len + 1), generator=gen)
    model = Llama(model_cfg)
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer_every else None
    calls = 0

    def forward_backward():
        nonlocal calls
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        calls += 1
        if optimizer is None:
            model.zero_grad(set_to_none=True)
        elif calls % optimizer_every == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return forward_backward


def _reference_gpu(matmul_flops: float, attention_flops: float, copy_bw: float):
    """A GPU of the measured rates whose memory-bound work runs at 1 B/s (its seconds are bytes)."""
    from threefold.plan.hardware import GPU

    return GPU("reference", matmul_flops, 0, copy_bw, 1.0, 1.0, 0.0, 0.0, 1, matmul_efficiency=1.0,
               hbm_efficiency=1.0, intra_link_efficiency=1.0, inter_link_efficiency=1.0,
               attention_efficiency=min(1.0, attention_flops / matmul_flops), elementwise_bw=1.0)


def dispatch_seconds_per_block(threads: int, matmul_flops: float, attention_flops: float, copy_bw: float,
                               seconds: float = 0.4, rounds: int = 3) -> float:
    """The cost of a block's forward and backward that does not grow with its tokens (each
    eager operator's dispatch, autograd's bookkeeping), measured directly: the reference block
    on 16 tokens, where its products take a tenth of the time, as the difference between 6 and
    2 blocks over 4 (the embedding, head and loss cancel), the median of ``rounds`` interleaved
    rounds, less the products' seconds at the measured rates."""
    from threefold.config import ModelConfig
    from threefold.plan import costs

    reference = _reference_gpu(matmul_flops, attention_flops, copy_bw)
    steps, products = {}, {}
    with intra_op_threads(threads):
        for layers in (2, 6):
            cfg = ModelConfig(**dict(REFERENCE_MODEL, layers=layers, seq_len=16))
            products[layers] = float(costs.estimate(costs.Workload(cfg, 1, precision="fp32"),
                                                    costs.Layout.named(), reference)["compute_s"])
            steps[layers] = reference_step(1, layers=layers, seq_len=16)
        per_block = [(1.0 / _typical_rate(steps[6], 1.0, seconds, trials=3)
                      - 1.0 / _typical_rate(steps[2], 1.0, seconds, trials=3)) / 4
                     for _ in range(rounds)]
    return max(0.0, statistics.median(per_block) - (products[6] - products[2]) / 4)


def memory_bound_rounds(threads: int, matmul_size: int, attention_flops: float, matmul_flops: float, copy_bw: float,
                        rounds: int = 3, seconds: float = 0.3) -> tuple[float, float, dict[int, float]]:
    """``memory_bound_rates`` measured in ``rounds`` interleaved rounds, with the fixed cost per
    block measured apart (``dispatch_seconds_per_block``): each round times the matmul peak and
    MEMORY_BOUND_MODEL at MEMORY_BOUND_MICRO_BATCHES within a few seconds of each other and fits
    the rate; the round with the median rate gives (bytes/s, fixed seconds per block), with each
    micro-batch's median seconds. A shared machine's speed drifts by 20% over a minute (a VM's
    neighbours): timed one after another, with a line's intercept for the fixed cost, four
    profiles of one idle machine fitted 4 to 20 GB/s and 0 to 11 ms per block. The attention
    rate is scaled by each round's peak over ``matmul_flops``."""
    gen = torch.Generator().manual_seed(0)
    size = matmul_size
    a, b, out = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen), torch.empty(size, size)
    fixed = dispatch_seconds_per_block(threads, matmul_flops, attention_flops, copy_bw)
    fits, times = [], {mb: [] for mb in MEMORY_BOUND_MICRO_BATCHES}
    with intra_op_threads(threads):
        steps = {mb: reference_step(mb, **MEMORY_BOUND_MODEL) for mb in times}
        for _ in range(rounds):
            peak = _typical_rate(lambda: torch.mm(a, b, out=out), 2.0 * size**3, seconds, trials=2)
            measured = {mb: 1.0 / _typical_rate(steps[mb], 1.0, seconds, trials=2) for mb in times}
            for mb, s in measured.items():
                times[mb].append(s)
            fits.append(memory_bound_rates(measured, peak, attention_flops * peak / matmul_flops, copy_bw, fixed,
                                           MEMORY_BOUND_MODEL))
    rate, fixed = sorted(fits)[len(fits) // 2]
    return rate, fixed, {mb: statistics.median(s) for mb, s in times.items()}


def memory_bound_rates(measured: dict[int, float], matmul_flops: float, attention_flops: float,
                       copy_bw: float, fixed_per_block: float | None = None,
                       model: dict = REFERENCE_MODEL) -> tuple[float, float]:
    """(bytes/s of the memory-bound work, seconds of fixed cost per block and micro-batch) of
    threefold's own model, as the planner counts them.

    ``measured``: ``model``'s forward and backward (REFERENCE_MODEL's keys; reference_step),
    micro-batch size → seconds, at two sizes or more. From each, the matrix products and the attention
    core, timed by the planner at the rates measured, are taken off; what is left is a line in
    the planner's count of memory-bound bytes (norms, rotary, SwiGLU, residuals, the loss): its
    slope is the rate those bytes stream at, its intercept the cost that does not grow with the
    micro-batch (each operator's dispatch, autograd's bookkeeping: eager PyTorch on a CPU pays
    several microseconds per operator), spread over the blocks. Eager PyTorch also runs more
    passes than the fused kernels the byte count describes; the rate takes that in, as a GPU's
    hbm_efficiency does for its kernels. Falls back to ``copy_bw`` and no fixed cost where the
    products took as long as the whole (a machine too busy to measure). With ``fixed_per_block``
    measured apart (``dispatch_seconds_per_block``) only the slope is fitted, through the points
    less that cost: an intercept fitted from three sizes is the difference of noisy timings."""
    from threefold.config import ModelConfig
    from threefold.plan import costs

    reference = _reference_gpu(matmul_flops, attention_flops, copy_bw)
    points = []
    for micro_batch, seconds in sorted(measured.items()):
        work = costs.Workload(ModelConfig(**dict(REFERENCE_MODEL, **model)), micro_batch, precision="fp32")
        predicted = costs.estimate(work, costs.Layout.named(micro_batch=micro_batch), reference)
        # memory_bound_s is in bytes at 1 B/s
        points.append((float(predicted["memory_bound_s"]), seconds - float(predicted["compute_s"])))
    if fixed_per_block is not None:  # left − fixed = bytes / bandwidth, least squares through 0
        fixed = fixed_per_block * model["layers"]
        slope = sum(b * (t - fixed) for b, t in points) / sum(b * b for b, _ in points)
        return (1.0 / slope if slope > 0 else copy_bw), fixed_per_block
    # The least-squares line through the points: left = fixed + bytes / bandwidth
    mean_b = sum(b for b, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / spread if spread > 0 else 0.0
    fixed = mean_t - slope * mean_b
    if slope <= 0 or fixed < 0:  # noise beyond what the line can say: one rate, no fixed cost
        bytes_large, left_large = points[-1]
        return (bytes_large / left_large if left_large > 0 else copy_bw), 0.0
    return 1.0 / slope, fixed / model["layers"]


def _free_store() -> dist.TCPStore:
    """A rendezvous store on a port the OS picks, so no other process can take it in between."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _gloo_worker(rank: int, world: int, port: int, message_bytes: int, reps: int, curve_calls: int,
                 curve_rounds: int, timeout_s: float, results) -> None:
    torch.set_num_threads(max(1, cpu_cores() // world))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        tiny = torch.zeros(1)
        for _ in range(20):  # warm up connections
            dist.all_reduce(tiny)
        latency = float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(50):
                dist.all_reduce(tiny)
            latency = min(latency, (time.perf_counter() - start) / 50)
        big = torch.ones(message_bytes // 4)
        dist.all_reduce(big)
        seconds = float("inf")
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(big)
            seconds = min(seconds, time.perf_counter() - start)
        collectives = _measure_collective_curves(world, curve_calls, curve_rounds)
        if rank == 0:
            algorithm_bw = message_bytes / seconds
            results.put({"bus_bw": algorithm_bw * 2 * (world - 1) / world, "latency_s": latency,
                         "collectives": collectives})
    finally:
        dist.destroy_process_group()


# Per-rank chunk sizes at which each kind of collective is timed: the tensor-parallel activations,
# ZeRO-3's blocks and DDP's buckets of a model that trains on a CPU.
CURVE_CHUNK_BYTES = (64 << 10, 512 << 10, 4 << 20)
# torch 2.13 names them *_single; the *_tensor names before it.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _measure_collective_curves(world: int, calls: int, rounds: int) -> dict:
    """Per kind (all_reduce, all_gather, reduce_scatter): the least-squares line through each
    size's call time against the bytes a rank sends in it (a ring's 2(n−1)/n of the tensor
    for an all-reduce, (n−1) chunks for the others), as ``{"latency_s": intercept, "bus_bw": 1/slope}``.
    gloo's three differ at these sizes (its reduce-scatter runs slower than its all-reduce).

    A size's time is the mean of ``calls`` calls, each after a barrier (so the ranks' skew is
    left out, as the engine's least-waiting rank leaves it out), not the best: a step pays every
    call, and on a shared machine their times have a long tail. Timed here at 1 MB a rank, the
    median all-gather took 1.5-1.7× the best and one call in five over 1.6-3.7 ms (a wake-up
    missed, a scheduler tick waited for); the mean, 1.6-1.9 ms for an all-gather and 3.2-3.6 ms
    for a reduce-scatter, is what the tp benchmark's calls of that size waited in training (2.66
    ms the pair, the least-waiting rank's, 94 calls a step), where the best (0.6 and 1.3 ms) said
    half of it. The ``rounds`` pass over every kind and size in turn, and each size keeps the
    median of its rounds' means: a slow spell of the machine lands in one round, not in the
    line (one pass's 4 MB reduce-scatter once read 49 ms against 11-13 in the others). Through
    the calls' long tail the lines are noisy even in quiet minutes, and the number of calls, not
    their spread in time, steadies them: 3 rounds of 20 read the reduce-scatter at 0.36-0.61 GB/s
    in six measurements in a row, 9 rounds of 20 at 0.57-0.64 (docs/planner.md, "The closed
    loop", has every figure)."""
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    means: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for kind in kinds:
            for chunk in CURVE_CHUNK_BYTES:
                numel = chunk // 4
                whole, part = torch.ones(numel * world), torch.ones(numel)
                call = {"all_reduce": lambda: dist.all_reduce(part),
                        "all_gather": lambda: ALL_GATHER(whole, part),
                        "reduce_scatter": lambda: REDUCE_SCATTER(part, whole)}[kind]
                call()
                total = 0.0
                for _ in range(calls):
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    total += time.perf_counter() - start
                means.setdefault((kind, chunk), []).append(total / calls)
    return collective_lines(means, world)


def collective_lines(means: dict[tuple[str, int], list[float]], world: int) -> dict:
    """Each kind's line (see _measure_collective_curves) through the median of each size's round
    means, ``means[kind, chunk bytes]``, against the bytes a rank sends at that size."""
    curves = {}
    for kind in dict.fromkeys(kind for kind, _ in means):
        chunks = sorted(chunk for k, chunk in means if k == kind)
        sent = [chunk * (2 * (world - 1) / world if kind == "all_reduce" else world - 1) for chunk in chunks]
        seconds = [statistics.median(means[kind, chunk]) for chunk in chunks]
        mean_x, mean_y = sum(sent) / len(sent), sum(seconds) / len(seconds)
        slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(sent, seconds))
                 / sum((x - mean_x) ** 2 for x in sent))
        slope = max(slope, 1e-15)
        curves[kind] = {"latency_s": max(0.0, mean_y - slope * mean_x), "bus_bw": 1.0 / slope}
    return curves


def worker_context():
    """How the measuring workers start: spawned, fresh interpreters as torchrun's ranks are (a
    fork of this process could also hang once it has run OpenMP work). Forked instead from a
    server that had imported torch, which saves 2 s of CPU a worker, the workers measured a few
    points less slowdown at 4 workers a core (1.04-1.06× against 1.08-1.11×, two rounds each)
    and 0.4 ms more wait at one a core: they are not the runs being predicted."""
    return multiprocessing.get_context("spawn")


def _run_gloo_workers(world: int, target, args: tuple, timeout_s: float, what: str):
    """Spawn ``world`` processes running ``target(rank, world, port, *args, results)`` over gloo
    on 127.0.0.1 and return the first result one of them puts. RuntimeError if a worker fails
    or nothing arrives within ``timeout_s``."""
    ctx = worker_context()
    store = _free_store()
    results = ctx.Queue()
    workers = [ctx.Process(target=target, daemon=True, args=(rank, world, store.port, *args, results))
               for rank in range(world)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                result = results.get(timeout=0.2)
                break
            except queue.Empty:
                failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"{what}: a worker exited with code {failed[0]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what}: no result within {timeout_s:.0f} s") from None
        for worker in workers:
            worker.join(timeout=max(1.0, deadline - time.monotonic()))
        return result
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()


def measure_gloo(world: int, message_bytes: int = 64 << 20, reps: int = 5, timeout_s: float = 120.0,
                 curve_calls: int = Settings.curve_calls, curve_rounds: int = Settings.curve_rounds) -> dict:
    """All-reduce over gloo between ``world`` spawned local processes on 127.0.0.1.

    Returns ``{"bus_bw": bytes/s at ``message_bytes``, "latency_s": s of a one-float all-reduce,
    "collectives": each kind's line (_measure_collective_curves)}``.
    Raises RuntimeError if a worker fails or the whole measurement takes longer than ``timeout_s``.
    """
    if world < 2:
        raise ValueError(f"measure_gloo: world must be at least 2, got {world}")
    return _run_gloo_workers(world, _gloo_worker, (message_bytes, reps, curve_calls, curve_rounds, timeout_s), timeout_s,
                             "gloo measurement")


def _wait_worker(rank: int, world: int, port: int, calls: int, timeout_s: float, results) -> None:
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        work, tiny = torch.randn(256, 256), torch.zeros(1)
        # every rank makes every pair's group, in one order (new_group's rule); of 2, the world is the pair
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)] if world > 2 else []
        pair = pairs[rank // 2] if rank // 2 < len(pairs) else None

        def timed_calls(group) -> tuple[float, float, float]:
            """(seconds waited, process CPU, compute CPU) over ``calls`` calls on ``group``."""
            waited = compute_cpu = 0.0
            process_cpu = time.process_time()  # every thread of the process: gloo's own included
            for _ in range(calls):
                began = time.thread_time()
                for _ in range(10):  # a few milliseconds of compute between collectives, as a step has
                    work @ work
                compute_cpu += time.thread_time() - began
                start = time.perf_counter()
                dist.all_reduce(tiny, group=group)
                waited += time.perf_counter() - start
            return waited, time.process_time() - process_cpu, compute_cpu

        for _ in range(5):
            dist.all_reduce(tiny)
        waited, process_cpu, compute_cpu = timed_calls(None)
        # the same calls, each rank's in its pair (the engine's tp, dp and pp groups on a CPU)
        pair_waited = timed_calls(pair)[0] if pair is not None else waited
        mean = torch.tensor([waited, process_cpu - compute_cpu, pair_waited]) / calls
        dist.all_reduce(mean)
        if rank == 0:
            results.put([float(x) / world for x in mean])
    finally:
        dist.destroy_process_group()


def measure_oversubscribed_waits(cores: int, calls: int = 50, timeout_s: float = 120.0) -> dict[str, dict]:
    """What a small collective costs when workers compute between calls, at 1, 2 and 4 workers
    per core, each ``{"2": …, "4": …, "8": …}`` on 2 cores:

    - ``wait_s``: the seconds a call takes. At one worker per core it is the collective's
      latency and the ranks' jitter (one arrives a little after the other). A collective
      finishes only when every member has reached it, and with more workers than cores some
      member is usually off its core, waiting for the scheduler; a GPU planner never sees this,
      a CPU run of 8 ranks on 2 cores pays it on every tp, dp and pp call.
    - ``pair_wait_s``: the same calls, each worker's in a group of two (every worker computing
      and calling at once): what the engine's pairs wait. Timed so, pairs among 8 workers waited
      4.6 ms a call where all 8 together waited 11.3 ms, 0.40 of it, where costs.group_wait's
      model of independent delays says H(2)/H(8) = 0.55 (docs/planner.md).
    - ``call_cpu_s``: the CPU seconds a call costs its process beyond the compute (gloo's
      threads waking and the socket's system calls; about half a millisecond here, several
      times the call's latency on an idle machine). With every core busy, that CPU is taken
      from the ranks that compute: costs.estimate counts it in the machine's work.

    (The compute's own slowdown is measure_shared_core_slowdown's: these workers' bursts of
    256-wide products fit a core's cache and slow 1.00-1.04×, a training step's operators
    1.1-1.2× at 4 workers a core.)
    """
    measured = {str(world): _run_gloo_workers(world, _wait_worker, (calls, timeout_s), timeout_s,
                                              f"oversubscribed collectives ({world} processes)")
                for world in oversubscribed_worlds(cores)}
    return {"wait_s": {w: m[0] for w, m in measured.items()}, "call_cpu_s": {w: m[1] for w, m in measured.items()},
            "pair_wait_s": {w: m[2] for w, m in measured.items()}}


def oversubscribed_worlds(cores: int) -> list[int]:
    """The workers the oversubscribed measurements run: 1, 2 and 4 a core (at least 2)."""
    return sorted({max(2, cores), 2 * cores, 4 * cores})


# A CPU training step's compute, for measure_shared_core_slowdown: REFERENCE_MODEL changed to the
# tiny preset's block (256 wide, Llama's FFN) three deep on 2 × 128 tokens, and an AdamW step
# every fourth micro-batch. Its operators are small and many (dispatch, norms, thin products),
# as a CPU run's are.
SHARED_CORE_MODEL = dict(layers=3, hidden=256, ffn=None, seq_len=128)


def _shared_core_worker(commands, results) -> None:
    torch.set_num_threads(1)
    keep_large_blocks_in_the_heap()  # as the engine's ranks do
    micro_batch = reference_step(2, optimizer_every=4, **SHARED_CORE_MODEL)
    micro_batch()
    results.put(None)  # built and warm
    while (command := commands.get()) is not None:
        start, end = command  # time.monotonic() is the machine's clock: every worker starts together
        time.sleep(max(0.0, start - time.monotonic()))
        began, done = time.thread_time(), 0
        while time.monotonic() < end or done == 0:
            micro_batch()
            done += 1
        results.put((time.thread_time() - began) / done)


def measure_shared_core_slowdown(cores: int, seconds: float = 2.0, rounds: int = 2, concurrent_rounds: int = 3,
                                 timeout_s: float = 120.0,
                                 warm_cpu_s: float = WARM_CPU_S) -> tuple[float, dict[str, float]]:
    """How much more CPU a training step's compute takes with more workers than one, as
    ``(concurrent, beyond)``:

    - ``concurrent``: a worker on every core against one alone (≥ 1): the cores share the
      caches and the memory bus, and clock lower when all are busy. A run with a worker per
      core sees this; a single process does not.
    - ``beyond``: 2 and 4 workers a core against one a core, ``{"2": 1.0, "4": …, "8": …}`` on
      2 cores (keyed as measure_oversubscribed_waits): the workers switched in and out refill
      the caches and branch predictors the others left.

    The compute is SHARED_CORE_MODEL's micro-batches, each worker's CPU clock per micro-batch,
    on workers built and brought to their steady state first (``warm_cpu_s`` of CPU each, all at
    once, untimed: WARM_CPU_S). The phases alternate, the base count (one worker; one a
    core) between each crowded one, and each crowded phase is taken against the mean of its two
    neighbours (the machine's speed drifts over minutes), the median over the rounds. Timed
    instead as the reference model on every core against its time alone a minute before, five
    profiles of this idle machine said 1.00-1.12×, and the runs with a worker per core were
    predicted 8-30% short when it said 1.00; interleaved, 2-second phases of this model gave
    0.97-1.08× and the tiny preset's whole step 1.02-1.15×, medians of 1.03-1.07."""
    worlds = oversubscribed_worlds(cores)
    ctx = worker_context()
    results = ctx.Queue()
    commands = [ctx.Queue() for _ in range(worlds[-1])]
    procs = [ctx.Process(target=_shared_core_worker, args=(queue_, results), daemon=True) for queue_ in commands]
    for proc in procs:
        proc.start()

    def phase(workers: int, length: float) -> float:
        start = time.monotonic() + 0.2
        for queue_ in commands[:workers]:
            queue_.put((start, start + length))
        return statistics.mean(results.get(timeout=timeout_s) for _ in range(workers))

    try:
        for _ in procs:
            results.get(timeout=timeout_s)
        return shared_core_phases(phase, cores, seconds, rounds, concurrent_rounds, warm_cpu_s)
    except queue.Empty:
        raise RuntimeError(f"shared-core slowdown: no result within {timeout_s:.0f} s") from None
    finally:
        for queue_ in commands:
            queue_.put(None)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()


def shared_core_phases(phase, cores: int, seconds: float, rounds: int, concurrent_rounds: int,
                       warm_cpu_s: float) -> tuple[float, dict[str, float]]:
    """measure_shared_core_slowdown's phases, in order, on ``phase(workers, seconds)`` (the
    first ``workers`` compute for that long and it returns their CPU seconds per micro-batch):
    first every worker at once for ``warm_cpu_s`` of CPU each, untimed, then the alternating
    rounds, as ``(concurrent, beyond)``."""
    worlds = oversubscribed_worlds(cores)

    def alternating(base: int, crowded: list[int], rounds: int) -> list[tuple[int, float]]:
        phases = [(base, phase(base, seconds))]
        for _ in range(rounds):
            for workers in crowded:
                phases += [(workers, phase(workers, seconds)), (base, phase(base, seconds))]
        return phases

    phase(worlds[-1], warm_cpu_s * worlds[-1] / cores)  # untimed: every worker to its steady state
    concurrent = (1.0 if cores < 2 else
                  slowdown_from_phases(alternating(1, [cores], concurrent_rounds))[str(cores)])
    return concurrent, slowdown_from_phases(alternating(worlds[0], worlds[1:], rounds))


def slowdown_from_phases(phases: list[tuple[int, float]]) -> dict[str, float]:
    """``phases``: (workers, CPU seconds per micro-batch) in the order measured, the base count
    (the first) before and after every crowded phase. Each crowded phase over the mean of its two
    neighbours (so a drift of the machine's speed cancels to first order), the median per count
    of workers, at least 1; the base's is 1."""
    base = phases[0][0]
    ratios: dict[int, list[float]] = {}
    for (before_w, before), (workers, during), (after_w, after) in zip(phases, phases[1:], phases[2:]):
        if workers != base:
            if before_w != base or after_w != base:
                raise ValueError(f"slowdown_from_phases: phase of {workers} workers lacks a base phase on each side")
            ratios.setdefault(workers, []).append(during / ((before + after) / 2))
    return {str(base): 1.0, **{str(w): max(1.0, statistics.median(r)) for w, r in sorted(ratios.items())}}


def measure_profile(settings: Settings, on_step=lambda description: None) -> dict:
    """Run every measurement and return the profile (keys ``PROFILE_KEYS``).

    ``on_step(description)`` is called before each measurement, for a progress display.
    """
    workers = cpu_cores()
    threads = cpu_cores() // workers
    threads_text = plural(threads, "thread")  # one, with a worker per core
    cores_text = plural(workers, "core")
    keep_large_blocks_in_the_heap()  # the engine's ranks do: time the work as they will run it
    on_step(f"fp32 matmul, {threads_text}")
    fp32 = measure_matmul_flops(torch.float32, threads, settings.matmul_size, settings.matmul_seconds)
    on_step(f"bf16 matmul, {threads_text}")
    bf16 = measure_matmul_flops(torch.bfloat16, threads, settings.matmul_size, settings.matmul_seconds)
    on_step("memory copy")
    memory_bw = measure_memory_bandwidth(threads, settings.copy_bytes, settings.copy_seconds)
    on_step(f"attention (fp32 and bf16), {threads_text}")
    attention_fp32 = measure_attention_flops(torch.float32, threads, seconds=settings.copy_seconds)
    attention_bf16 = measure_attention_flops(torch.bfloat16, threads, seconds=settings.copy_seconds)
    on_step(f"memory-bound work of a 64-wide model, {threads_text}")
    # Interleaved rounds, quick or not: the fixed cost is the difference of timings, and short
    # or drifting ones leave it to noise (memory_bound_rounds).
    elementwise_bw, block_overhead, _ = memory_bound_rounds(threads, settings.matmul_size, attention_fp32, fp32,
                                                            memory_bw)
    on_step(f"gloo all-reduce, {max(2, workers)} processes")
    gloo = measure_gloo(max(2, workers), settings.gloo_bytes, settings.gloo_reps, settings.gloo_timeout_s,
                        settings.curve_calls, settings.curve_rounds)
    on_step(f"gloo collectives with 1, 2 and 4 processes per core, {cores_text}")
    waits = measure_oversubscribed_waits(workers, settings.wait_calls, settings.gloo_timeout_s)
    on_step(f"a training step's compute alone, on every core, and with 2 and 4 processes per core, {cores_text}")
    slowdown, shared_core = measure_shared_core_slowdown(workers, settings.shared_core_seconds,
                                                         settings.shared_core_rounds, settings.concurrent_rounds,
                                                         settings.gloo_timeout_s, settings.shared_core_warm_cpu_s)
    on_step(f"fp32 matmul again, {threads_text}: did the machine's speed drift?")
    fp32_at_end = measure_matmul_flops(torch.float32, threads, settings.matmul_size, settings.matmul_seconds / 2)
    return {
        "name": "local",
        "peak_flops_fp32": fp32,
        "peak_flops_bf16": bf16,
        "peak_flops_fp32_at_end": fp32_at_end,
        "hbm_bytes": ram_bytes(),
        "hbm_bw": memory_bw,
        "attention_flops_fp32": attention_fp32,
        "attention_flops_bf16": attention_bf16,
        "elementwise_bw": elementwise_bw,
        "block_overhead_s": block_overhead,
        "concurrent_slowdown": slowdown,
        "intra_node_bw": gloo["bus_bw"],
        "inter_node_bw": gloo["bus_bw"],
        "latency_s": gloo["latency_s"],
        "collectives": gloo["collectives"],
        "oversubscribed_wait_s": waits["wait_s"],
        "oversubscribed_call_cpu_s": waits["call_cpu_s"],
        "oversubscribed_pair_wait_s": waits["pair_wait_s"],
        "oversubscribed_compute_slowdown": shared_core,
        "gpus_per_node": workers,
        "threads": threads,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
    }


class OtherProcesses:
    """Context manager: ``cores``, how many cores other processes kept busy while the block ran
    (the machine's busy CPU time from /proc/stat, less this process's and its finished
    children's, over the wall time), or None where there is no /proc/stat. A measurement taken
    beside them describes the neighbours as much as the machine."""

    def __enter__(self):
        self.cores = None
        self._began, self._busy, self._own = time.perf_counter(), machine_busy_seconds(), own_cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        busy, seconds = machine_busy_seconds(), time.perf_counter() - self._began
        if busy is not None and self._busy is not None and seconds > 0:
            self.cores = max(0.0, busy - self._busy - (own_cpu_seconds() - self._own)) / seconds


def machine_busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy since boot (/proc/stat: all but idle and
    iowait), or None where there is no /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have finished (spawned workers)."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


BUSY_CORES = 0.25  # above this share of the cores used by others, a profile is flagged
# Above this change of the fp32 matmul rate between calibrate's first and last measurement, a
# profile is flagged: on this VM two calibrations ten minutes apart measured 85.0 and 99.8
# GFLOP/s, and the demo's predicted step moved from +19% to +9% of the measured one.
DRIFT_WARNING = 0.10


# --- the command ----------------------------------------------------------------------------
def profile_table(profile: dict, path: Path) -> Table:
    table = Table(title=f"Machine profile ({path})")
    table.add_column("measurement")
    table.add_column("value", justify="right")
    rows = [
        ("fp32 matmul peak", f"{profile['peak_flops_fp32'] / 1e9:,.1f} GFLOP/s"),
        ("bf16 matmul peak", f"{profile['peak_flops_bf16'] / 1e9:,.1f} GFLOP/s"),
        ("fp32 matmul again, at the end", f"{profile.get('peak_flops_fp32_at_end', float('nan')) / 1e9:,.1f} GFLOP/s"),
        ("memory", f"{profile['hbm_bytes'] / 2**30:,.1f} GiB"),
        ("memory bandwidth (copy)", f"{profile['hbm_bw'] / 1e9:,.1f} GB/s"),
        ("fp32 attention (causal SDPA, fwd+bwd)", f"{profile.get('attention_flops_fp32', float('nan')) / 1e9:,.1f} GFLOP/s"),
        ("bf16 attention (causal SDPA, fwd+bwd)", f"{profile.get('attention_flops_bf16', float('nan')) / 1e9:,.1f} GFLOP/s"),
        ("memory-bound work (64-wide reference model)", f"{profile.get('elementwise_bw', float('nan')) / 1e9:,.1f} GB/s"),
        ("fixed cost per block and micro-batch (reference model)",
         f"{profile.get('block_overhead_s', float('nan')) * 1e3:,.2f} ms"),
        ("slowdown with every core busy", f"{profile.get('concurrent_slowdown', float('nan')):.2f}×"),
        ("gloo all-reduce bus bandwidth", f"{profile['intra_node_bw'] / 1e9:,.2f} GB/s"),
        ("gloo all-reduce latency", f"{profile['latency_s'] * 1e3:,.3f} ms"),
        *((f"gloo {kind.replace('_', '-')} at 64 KB-4 MB", f"{c['latency_s'] * 1e3:,.3f} ms + bytes at {c['bus_bw'] / 1e9:,.2f} GB/s")
          for kind, c in profile.get("collectives", {}).items()),
        *((f"a small collective, {w} processes computing", f"{t * 1e3:,.2f} ms"
           + (f", {profile['oversubscribed_call_cpu_s'][w] * 1e3:,.2f} ms of CPU"
              if w in profile.get("oversubscribed_call_cpu_s", {}) else ""))
          for w, t in profile.get("oversubscribed_wait_s", {}).items()),
        *((f"a small collective in pairs, {w} processes computing", f"{t * 1e3:,.2f} ms")
          for w, t in profile.get("oversubscribed_pair_wait_s", {}).items() if int(w) > 2),
        *((f"a training step's compute, {w} processes", f"{x:.2f}× its time at one process a core")
          for w, x in profile.get("oversubscribed_compute_slowdown", {}).items()),
        ("workers × threads", f"{profile['gpus_per_node']} × {profile['threads']}"),
        *((("other processes meanwhile", f"{profile['other_processes_cores']:.2f} cores"),)
          if "other_processes_cores" in profile else ()),
        ("torch", profile["torch_version"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


@click.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the profile (default: $THREEFOLD_HOME/local.json or ~/.cache/threefold/local.json).")
@click.option("--quick", is_flag=True,
              help="Smaller, shorter measurements (about 60-70 s against 115-120); noisier numbers, the fixed cost per block "
                   "and the collectives' latencies above all.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON instead of a table.")
@click.option("--from-runs", "from_runs", is_flag=True,
              help="Fit the profile's efficiencies to the measured RUNs instead of measuring: each RUN a "
                   "CONFIG.toml:METRICS.jsonl pair, or a manifest .json listing runs (docs/planner.md).")
@click.argument("runs", nargs=-1, metavar="[RUN]...")
def calibrate(out: Path | None, quick: bool, as_json: bool, from_runs: bool, runs: tuple[str, ...]) -> None:
    """Measure matmul throughput, memory bandwidth and gloo all-reduce; save the `local` profile.
    With --from-runs RUN…, fit its efficiencies to measured runs and report the error before and after."""
    if runs and not from_runs:
        raise ConfigError(f"calibrate: {runs[0]!r}: runs are given with --from-runs RUN…")
    if from_runs:
        from threefold.plan.fit import calibrate_from_runs

        calibrate_from_runs(runs, out, as_json)
        return
    check_output_path("--out", out or profile_path())  # before two minutes of measuring, not after
    settings = QUICK if quick else FULL
    progress = Progress(SpinnerColumn(), TextColumn("measuring {task.description}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress, OtherProcesses() as others:
        task = progress.add_task("", total=None)
        try:
            profile = measure_profile(settings, lambda description: progress.update(task, description=description))
        except RuntimeError as err:
            raise click.ClickException(str(err)) from None
    if others.cores is not None:
        profile["other_processes_cores"] = round(others.cores, 2)
    path = save_profile(profile, out)
    if as_json:
        click.echo(json.dumps(profile))
    else:
        Console().print(profile_table(profile, path))
    drift = profile.get("peak_flops_fp32_at_end", profile["peak_flops_fp32"]) / profile["peak_flops_fp32"] - 1
    if abs(drift) > DRIFT_WARNING:  # a VM's speed moves by itself; every rate above moved with it
        click.echo(f"warning: the machine's speed drifted while calibrate measured (fp32 matmul "
                   f"{profile['peak_flops_fp32'] / 1e9:,.1f} GFLOP/s at the start, "
                   f"{profile['peak_flops_fp32_at_end'] / 1e9:,.1f} at the end, {drift:+.0%}): predictions from "
                   "this profile may be off by as much; run `threefold calibrate` again", err=True)
    if others.cores is not None and others.cores > BUSY_CORES * profile["gpus_per_node"]:
        cores = profile["gpus_per_node"]
        click.echo(f"warning: other processes kept {others.cores:.1f} of the {plural(cores, 'core')} "
                   f"busy while calibrate measured (fp32 matmul {profile['peak_flops_fp32'] / 1e9:,.1f} GFLOP/s): the "
                   "profile describes a busy machine; run `threefold calibrate` again when it is idle", err=True)
