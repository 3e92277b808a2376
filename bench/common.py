"""What the benchmark scripts share: the model they start from, the config fields they agree on,
one training step as the trainer takes it, timing two sides step by step, and the spawning of
their gloo ranks.

The scripts run as ``python bench/<name>.py``, which puts bench/ on ``sys.path``, so they import
this module as ``common``; their spawned ranks get the same ``sys.path`` and import it alike.
"""
from __future__ import annotations

import datetime
import os
import socket
import statistics
import time
from queue import Empty

import click
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from threefold.config import Config
from threefold.models.llama import Llama
from threefold.models.presets import get_preset

ADDRESS = "127.0.0.1"  # every world of ranks runs on this machine


def preset_config(preset: str) -> Config:
    """The preset's model with a 4096-token vocabulary and 256-token sequences, unvalidated.

    The one-process, data-parallel, tensor-parallel and checkpoint benchmarks train this model so
    that their numbers compare; each caller sets its batch, parallelism and optimizer, then
    validates.
    """
    cfg = Config()
    cfg.model = get_preset(preset)
    cfg.model.vocab_size = 4096
    cfg.model.seq_len = 256
    return cfg


def fresh_model(cfg: Config) -> Llama:
    """The model seeded as the trainer seeds it: every contender and rank starts from the same weights."""
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    return model


def train_step(engine, micro_batches, cfg: Config):
    """One optimizer step as the trainer takes it: forward/backward over the micro-batches, clipping
    by the global norm, AdamW at ``cfg.train.lr``, gradients zeroed. Returns what ``forward_backward``
    returns (the loss). Works on threefold's engines and on any PyTorch peer with the same methods,
    so both sides of a comparison do the same work."""
    loss = engine.forward_backward(micro_batches)
    engine.clip_grad_norm(cfg.train.grad_clip)
    engine.optimizer_step(cfg.train.lr)
    engine.zero_grad()
    return loss


def step_at_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """``Engine.optimizer_step`` for a bare torch optimizer, so that PyTorch's side steps as ours does."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def alternate_steps(cfg: Config, sides: dict, warmup: int, steps: int) -> dict:
    """Every rank: ``warmup + steps`` steps of each side, on the same random batches, and per side
    the losses (every step) and the seconds (timed steps only).

    ``sides`` maps a name to a callable ``(inputs, targets) -> loss`` that takes one whole step on
    the step's ``cfg.train.global_batch`` sequences. The order flips every step so that neither
    side always runs on a cache the other warmed; a barrier before each step and the slowest
    rank's time make a step last until every rank is done.
    """
    gen = torch.Generator().manual_seed(cfg.train.seed)
    out = {name: {"losses": [], "times": []} for name in sides}
    for step in range(warmup + steps):
        tokens = torch.randint(cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        names = list(sides) if step % 2 == 0 else list(reversed(sides))
        for name in names:
            dist.barrier()
            start = time.perf_counter()
            loss = sides[name](inputs, targets)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            out[name]["losses"].append(loss)
            if step >= warmup:
                out[name]["times"].append(elapsed.item())
    return out


def dp_rows_step(engine, inputs, targets) -> float:
    """One training step of ``engine`` on its data-parallel rank's rows of the global batch
    (``inputs``, ``targets``), in its micro-batches, an MoE model's end of step included."""
    rows = inputs.shape[0] // engine.dp_size
    mine = slice(engine.dp_rank * rows, (engine.dp_rank + 1) * rows)
    micro = list(zip(inputs[mine].split(engine.cfg.train.micro_batch),
                     targets[mine].split(engine.cfg.train.micro_batch)))
    loss = train_step(engine, micro, engine.cfg)
    engine.end_moe_step()
    return loss


def report_sides(rank: int, queue, engines: dict, out: dict, per_rank: dict) -> None:
    """The end of a worker that timed ``engines`` side by side (``alternate_steps``'s ``out``):
    gathers every rank's ``per_rank`` figures ({figure: {side: value}}), and rank 0 puts on
    ``queue``, per side, its median step time, the timed steps, each figure of every rank (as
    "<figure>_per_rank") and the losses; then the engines and the process group shut down."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, per_rank)
    if rank == 0:
        queue.put({name: {"step_time_s": statistics.median(out[name]["times"]), "step_times_s": out[name]["times"],
                          **{f"{figure}_per_rank": [e[figure][name] for e in everyone] for figure in per_rank},
                          "losses": out[name]["losses"]} for name in engines})
    for engine in engines.values():
        engine.shutdown()
    dist.destroy_process_group()


def same_losses(a: dict, b: dict, tolerance: float) -> float:
    """The largest difference between two sides' losses; one line and exit where it is above
    ``tolerance`` (sides that should train alike did not)."""
    difference = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    if not difference <= tolerance:
        raise click.ClickException(f"the two sides must train alike: losses differ by {difference:.3g} "
                                   f"(> {tolerance:g}); {a['losses']} against {b['losses']}")
    return difference


def summarise_pair(out: dict) -> dict:
    """Adds to ``alternate_steps``'s ``ours`` and ``torch`` their median step times, the ratio
    ours / torch (below 1: ours is faster) and the largest difference between their losses."""
    for side in ("ours", "torch"):
        out[side]["step_time_s"] = statistics.median(out[side]["times"])
    out["ratio"] = out["ours"]["step_time_s"] / out["torch"]["step_time_s"]
    out["max_loss_difference"] = max(abs(a - b) for a, b in zip(out["ours"]["losses"], out["torch"]["losses"]))
    return out


def save_and_print(results: dict, out, table, console) -> None:
    """Write ``results`` as JSON to ``out`` (a Path), print ``table`` and where the file went."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(table)
    console.print(f"wrote {out}")


def free_port() -> int:
    """A TCP port nobody listens on now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind((ADDRESS, 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int, threads: int, timeout_s: float) -> None:
    """In a spawned rank: ``threads`` intra-op threads, then join the gloo group at ``port``."""
    os.environ.update(MASTER_ADDR=ADDRESS, MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def spawn_ranks(world: int, worker, *args):
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` spawned processes and return the
    one object rank 0 puts on ``queue``.

    ``worker`` must be a module-level function of the script (spawn imports it anew in each
    child). The queue is polled rather than waited on, so that a rank which dies (its traceback
    printed by the child) ends the run instead of leaving it waiting forever.
    """
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    result = None
    while result is None and all(proc.exitcode in (None, 0) for proc in procs):
        try:
            result = queue.get(timeout=1.0)
        except Empty:
            pass
    for proc in procs:
        proc.join()
    if result is None:
        raise click.ClickException("a rank failed (its traceback is above)")
    return result
