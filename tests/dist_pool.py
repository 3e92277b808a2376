"""A persistent pool of gloo worker processes per world size, reused across tests.

Starting N processes that import torch and join a gloo group costs seconds; dispatching a
function to processes that are already up costs milliseconds. So each world size gets one
pool of spawned workers (spawn, not fork: fork hangs after the parent ran OpenMP work), each
with one intra-op thread, joined in a gloo group on 127.0.0.1. ``pool.run(fn, *args)`` runs
``fn(*args)`` on every rank and returns the results in rank order.

``fn`` must be picklable: a module-level function of an importable module (test modules are,
pytest puts their folder on sys.path and spawned children inherit it).

Results come back serialized by ``torch.save`` (bytes), not as tensors in shared memory: a
tensor sent through a pipe keeps a file descriptor open for as long as it lives, and the
tests cache their runs' state dicts for the whole session, which used to exhaust the limit.

A failure on any rank (an exception, or no answer within the timeout) raises ``RankFailure``
with every rank's report, and the pool is shut down: a collective that failed can leave the
group broken, so the next test gets fresh processes and a fresh group.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import socket
import time
import traceback

GROUP_TIMEOUT_S = 60.0  # of the workers' default process group


class RankFailure(AssertionError):
    """One or more ranks raised or did not answer; the message holds each rank's report."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    conn.send(("ready", None))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            buffer = io.BytesIO()
            torch.save(fn(*args, **kwargs), buffer)
            conn.send(("ok", buffer.getvalue()))
        except BaseException:  # report everything, keep serving
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _loaded(payload):
    """A worker's result, from the bytes ``torch.save`` wrote (None for the start-up reply)."""
    import torch

    return None if payload is None else torch.load(io.BytesIO(payload), weights_only=False)


class WorkerPool:
    def __init__(self, world: int, start_timeout_s: float = 120.0):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=True,
                               name=f"dist-pool-{world}-rank{rank}")
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect(start_timeout_s, "start")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list:
        deadline = time.monotonic() + timeout
        replies: dict[int, tuple[str, object]] = {}
        while len(replies) < self.world and time.monotonic() < deadline:
            for rank, conn in enumerate(self.conns):
                if rank not in replies and conn.poll(0.01):
                    try:
                        replies[rank] = conn.recv()
                    except EOFError:
                        replies[rank] = ("error", "the worker process died")
            if any(not p.is_alive() for r, p in enumerate(self.procs) if r not in replies):
                break
        failed = {r: v for r, v in replies.items() if v[0] == "error"}
        missing = [r for r in range(self.world) if r not in replies]
        if failed or missing:
            self.close()
            report = [f"--- rank {r} raised:\n{text}" for r, (_, text) in sorted(failed.items())]
            report += [f"--- rank {r} did not answer within {timeout:.0f} s" for r in missing]
            raise RankFailure(f"{what} failed on world {self.world}:\n" + "\n".join(report))
        return [_loaded(replies[r][1]) for r in range(self.world)]

    def kill(self) -> None:
        """End the workers at once: at the session's end nothing is left to do on the group, and
        a graceful exit (each worker tears its group and torch down) cost 0.5-1 s of CPU a worker."""
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join(timeout=2)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=2)


class Pools:
    """One live pool per world size, created on first use and re-created after a failure."""

    def __init__(self):
        self._pools: dict[int, WorkerPool] = {}

    def run(self, world: int, fn, *args, **kwargs) -> list:
        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            pool = self._pools[world] = WorkerPool(world)
        try:
            return pool.run(fn, *args, **kwargs)
        except RankFailure:
            del self._pools[world]  # already closed; the next call starts a fresh one
            raise

    def close(self) -> None:
        for pool in self._pools.values():
            pool.kill()
        self._pools.clear()
