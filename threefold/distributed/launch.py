"""Running N processes on this machine: ``threefold train --nproc N`` re-executes itself under torchrun.

    threefold train --config c.toml --nproc 4
      → python -m torch.distributed.run --standalone --nproc-per-node 4 -m threefold.cli train --config c.toml

torchrun starts the processes, sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT, and the
mesh (``ParallelMesh.from_config``) joins the process group: NCCL on CUDA, gloo on CPU.
For several machines, run torchrun yourself with a c10d rendezvous (docs/launch.md).
"""
from __future__ import annotations

import os
import subprocess
import sys


def under_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


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


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "threefold.cli", *without_nproc(argv)]


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run the ``threefold`` command line ``argv`` (without the program name) in ``nproc``
    processes under torchrun on this machine; return its exit code."""
    env = dict(os.environ)
    # torchrun would otherwise set 1 thread per process and warn; each rank refines this itself.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(torchrun_command(nproc, argv), env=env).returncode
