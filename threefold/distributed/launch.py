"""Starting and stopping the ranks of a job.

Running N processes on this machine: ``threefold train --nproc N`` re-executes itself under torchrun.

    threefold train --config c.toml --nproc 4
      runs what  python -m torch.distributed.run --standalone --nproc-per-node 4 -m threefold.cli train --config c.toml
      would run (torchrun's own ``run()``, called in this process).

torchrun starts the processes, sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and the
mesh (``ParallelMesh.from_config``) joins the process group: NCCL on CUDA, gloo on CPU.
For several machines, run torchrun yourself with a c10d rendezvous (docs/launch.md).

Stopping: SIGTERM, what SLURM and Kubernetes send before they kill a job, asks every rank to
finish its step, save a checkpoint and exit 0 (``StopRequest``).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading


# glibc serves an allocation above its mmap threshold (dynamic, at most 32 MB) with fresh pages
# from the kernel, zeroed and faulted in on every call, and returns them on free. A CPU run's
# logits cross it: micro-batch 8 × 256 tokens × 4,096 fp32 logits is 33.5 MB, and each
# forward and backward allocates several such tensors. The one-process run (configs/single.toml)
# measured 1.69-1.81 s a step without this and 1.47-1.62 s with it; the loss alone 6.5-8.7 ns a
# logit against 2.6-3.5. PyTorch's CPU tuning guide swaps in jemalloc or tcmalloc for the same
# reason; this keeps glibc and raises its thresholds instead.
HEAP_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_large_blocks_in_the_heap() -> bool:
    """Have glibc keep blocks up to HEAP_THRESHOLD_BYTES in its heap, freed ones included, so a
    step's large tensors reuse memory already mapped; True where it took (Linux with glibc),
    False elsewhere, where nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, HEAP_THRESHOLD_BYTES))


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` with ``--nproc N`` / ``--nproc=N`` removed, so the children do not relaunch."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def torchrun_args(nproc: int, argv: list[str], max_restarts: int = 0) -> list[str]:
    """The arguments of ``python -m torch.distributed.run`` that run ``threefold argv`` in ``nproc``
    processes; after a failure torchrun restarts all of them up to ``max_restarts`` times."""
    return ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT",  # not SIGTERM: relaunch passes it on to the ranks
            "-m", "threefold.cli", *without_nproc(argv)]


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def relaunch(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Run the ``threefold`` command line ``argv`` (without the program name) in ``nproc``
    processes under torchrun on this machine; return the exit code of the first rank that
    stopped itself (1 when the failed ranks were killed).

    torchrun runs in this process (its ``run()``, exactly what the command line calls), so that a
    rank's one-line error stays the only message: torchrun's own report of a failed child, a
    traceback, is silenced, and the rank's exit code (2 for a user error) is returned. A rank
    killed by a signal cannot speak for itself: one line names it and the signal.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun would otherwise set 1 thread per process and warn; each rank refines this itself.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")] + [
            "torch.distributed.elastic"]:  # each of its modules' loggers has a level of its own (LOGLEVEL's)
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun's agent answers SIGTERM by terminating the ranks at once (SIGKILL 30 s later) and
    # failing; here SIGTERM is passed on to the ranks instead, which finish the step, save and exit
    # 0, and the agent sees them succeed.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _signal_children(signum))
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(nproc, argv, max_restarts)))
    except ChildFailedError as err:
        first = min(f.timestamp for f in err.failures.values())
        for rank, failure in sorted(err.failures.items()):
            # SIGTERM is how torchrun stops the other ranks, and SIGKILL 30 s later those that did not
            # stop (a stuck rank, which the others named); any other signal, or one among the first
            # failures (timestamps in whole seconds), killed a rank, which could say nothing itself.
            if failure.exitcode < 0 and failure.signal_name() != "SIGTERM" and failure.timestamp <= first + 1:
                hint = "" if max_restarts else " (--max-restarts N restarts them from the last checkpoint)"
                print(f"error: rank {rank} (pid {failure.pid}) died of {failure.signal_name()}; torchrun stopped "
                      f"the other ranks{hint}", file=sys.stderr)
        exited = sorted((f.timestamp, f.exitcode) for f in err.failures.values() if f.exitcode > 0)
        return exited[0][1] if exited else 1  # a rank that stopped itself (2: a user error) said why
    except SignalException as err:  # Ctrl-C or SIGHUP: torchrun passed it on to the ranks, and rank 0 said so
        return 128 + int(err.sigval)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _signal_children(signum: int) -> None:
    """Send ``signum`` to this process's children (the ranks torchrun started), read from /proc."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = f.read().rpartition(")")[2].split()[1]  # after "pid (name) state"
            if parent == me:
                os.kill(int(entry), signum)
        except (OSError, IndexError):  # gone meanwhile
            pass


_INTERRUPTED = False  # a StopRequest of this process has seen Ctrl-C


def interrupted() -> bool:
    """Whether this process was interrupted (Ctrl-C): a collective that then fails only means
    that another rank stopped first, as it was told to."""
    return _INTERRUPTED


class StopRequest:
    """SIGTERM, turned into a decision every rank takes at the same step.

    The signal reaches the ranks at different moments (SLURM signals each process, torchrun's
    agent passes it on), so each rank only notes it; the ranks then agree through the job's
    store. A rank that got the signal after finishing step s posts "stop after step s + 1"
    (the first post wins). Every step ends in a collective over the whole job (the global loss
    and gradient norm), so when one rank has finished step s, no rank has finished step s + 1
    yet: each reads the post before deciding on step s + 1, and all stop after it. On one
    process: stop after the step in progress.
    """

    def __init__(self, attempt: int = 0):
        self.signalled = False
        self.key = f"threefold/attempt{attempt}/stop-after-step"
        self._posted = False
        self._previous = None
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._unraisable_unless_interrupt
        if threading.current_thread() is threading.main_thread():
            interrupt = signal.getsignal(signal.SIGINT)  # left alone where it is ignored (a job in the background)
            self._previous = (signal.signal(signal.SIGTERM, self._note),
                              signal.signal(signal.SIGINT, self._interrupt) if interrupt is signal.default_int_handler
                              else interrupt)

    def _note(self, signum, frame) -> None:
        self.signalled = True

    def _interrupt(self, signum, frame) -> None:
        """Ctrl-C: KeyboardInterrupt, as by default; noted too, because one raised while a
        finalizer runs (the activation meter's, as autograd frees saved tensors) is printed and
        ignored by Python, and the run went on: check_interrupt raises it again at the step's end."""
        global _INTERRUPTED
        _INTERRUPTED = True
        raise KeyboardInterrupt

    def check_interrupt(self) -> None:
        if _INTERRUPTED:
            raise KeyboardInterrupt

    def _unraisable_unless_interrupt(self, unraisable) -> None:
        """Python's report of an exception a finalizer raised, but for the Ctrl-C that
        check_interrupt raises again: no "Exception ignored" traceback before "aborted"."""
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._unraisable(unraisable)

    def stop_after(self, step: int) -> bool:
        """Every rank calls this after finishing ``step``: True when all ranks stop now."""
        store = _job_store()
        if store is None:
            return self.signalled
        if self.signalled and not self._posted:
            store.compare_set(self.key, "", str(step + 1))  # sets it only if no rank did yet
            self._posted = True
        return store.check([self.key]) and step >= int(store.get(self.key))

    def close(self) -> None:
        sys.unraisablehook = self._unraisable
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous[0])
            signal.signal(signal.SIGINT, self._previous[1])
            self._previous = None


def _job_store():
    """The key-value store all ranks of the job share, or None on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()
