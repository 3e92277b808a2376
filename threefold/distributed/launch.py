"""Running N processes on this machine: ``threefold train --nproc N`` re-executes itself under torchrun.

    threefold train --config c.toml --nproc 4
      runs what  python -m torch.distributed.run --standalone --nproc-per-node 4 -m threefold.cli train --config c.toml
      would run (torchrun's own ``run()``, called in this process).

torchrun starts the processes, sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and the
mesh (``ParallelMesh.from_config``) joins the process group: NCCL on CUDA, gloo on CPU.
For several machines, run torchrun yourself with a c10d rendezvous (docs/launch.md).
"""
from __future__ import annotations

import logging
import os
import sys


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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torchrun would otherwise set 1 thread per process and warn; each rank refines this itself.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(nproc, argv, max_restarts)))
    except ChildFailedError as err:
        for rank, failure in sorted(err.failures.items()):
            # SIGTERM is how torchrun stops the other ranks; any other signal killed a rank, which
            # could say nothing itself.
            if failure.exitcode < 0 and failure.signal_name() != "SIGTERM":
                hint = "" if max_restarts else " (--max-restarts N restarts them from the last checkpoint)"
                print(f"error: rank {rank} (pid {failure.pid}) died of {failure.signal_name()}; torchrun stopped "
                      f"the other ranks{hint}", file=sys.stderr)
        exited = sorted((f.timestamp, f.exitcode) for f in err.failures.values() if f.exitcode > 0)
        return exited[0][1] if exited else 1  # a rank that stopped itself (2: a user error) said why
    return 0
