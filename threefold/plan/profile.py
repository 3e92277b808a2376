"""The machine profile's file: where it lives, its keys, reading and writing it. Torch-free, so
``--gpu local`` (threefold/plan/hardware.py) reads it without the measuring code
(threefold/plan/calibrate.py) that writes it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from threefold.config import ConfigError

PROFILE_KEYS = ("name", "peak_flops_fp32", "peak_flops_bf16", "hbm_bytes", "hbm_bw", "intra_node_bw",
                "inter_node_bw", "latency_s", "gpus_per_node", "threads", "measured_at", "torch_version")
# Measured by `threefold calibrate` since 2026-12; a profile written before lacks them, and the
# planner then times the attention core at the matmul rate, memory-bound work at hbm_bw and
# every collective by the all-reduce's bandwidth and latency.
MEASURED_SINCE_KEYS = ("attention_flops_fp32", "attention_flops_bf16", "elementwise_bw", "collectives",
                       "concurrent_slowdown", "oversubscribed_wait_s", "block_overhead_s", "other_processes_cores",
                       "peak_flops_fp32_at_end", "oversubscribed_call_cpu_s", "oversubscribed_compute_slowdown",
                       "oversubscribed_pair_wait_s")
# Written by `threefold calibrate --from-runs` (threefold/plan/fit.py): the achieved fractions of
# the measured rates that the user's own runs show, and the runs they were fitted on.
FITTED_KEYS = ("matmul_efficiency", "hbm_efficiency", "link_efficiency", "fitted_from")


def profile_path() -> Path:
    """Where the profile lives: ``$THREEFOLD_HOME/local.json``, by default ``~/.cache/threefold/local.json``."""
    home = os.environ.get("THREEFOLD_HOME") or Path.home() / ".cache" / "threefold"
    return Path(home) / "local.json"


def save_profile(profile: dict, path: Path | None = None) -> Path:
    """Write the profile atomically: readers see the old file or the new one, never half of one."""
    path = Path(path or profile_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        json.dump(profile, tmp, indent=2)
        tmp.write("\n")
    os.replace(tmp.name, path)
    return path


def load_profile(path: Path | str | None = None) -> dict:
    """Read a profile written by ``threefold calibrate``; ConfigError if it is missing or malformed."""
    path = Path(path or profile_path())
    if not path.is_file():
        raise ConfigError(f"no machine profile at {path}: run `threefold calibrate` first")
    try:
        profile = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"machine profile {path} is not valid JSON ({err}): run `threefold calibrate` again") from None
    if not isinstance(profile, dict) or not set(PROFILE_KEYS) <= set(profile) <= {*PROFILE_KEYS, *MEASURED_SINCE_KEYS, *FITTED_KEYS}:
        raise ConfigError(f"machine profile {path} does not have the expected keys: run `threefold calibrate` again")
    return profile
