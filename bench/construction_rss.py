"""Peak host memory while one rank builds its share of a large model (real tensors, no process group).

    python bench/construction_rss.py [--preset llama3-70b] [--tp 8] [--pp 8] [--dp 2] [--rank 0]

Each measurement runs in a fresh subprocess: the model is created on the meta device, then
``cut_model`` (threefold/train/engine.py) applies tensor parallelism, keeps this rank's pipeline
stages and materialises only their tensors, each drawn whole from its own generator and cut to
this rank's piece. The peak RSS of the subprocess (its own high-water mark, VmHWM: getrusage's
ru_maxrss would keep its parent's from before the exec) is compared with this
rank's share of fp32 weights plus the largest single tensor it draws whole; the acceptance of
issue 12 is peak < 1.5 × that. Prints one JSON object; ``--out`` also writes it.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path


def high_water_bytes() -> int:
    """This process's peak resident memory since its exec (Linux's VmHWM)."""
    line = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def build_one_rank(preset: str, tp: int, pp: int, dp: int, rank: int) -> dict:
    import torch

    from threefold.configure import load_config
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import Llama
    from threefold.train.engine import cut_model

    cfg = load_config(None, [f"model.preset={preset}", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp={dp}",
                             f"train.global_batch={dp * pp}", "train.micro_batch=1"])
    with torch.device("meta"):
        model = Llama(cfg.model)
    mesh = ParallelMesh({"tp": tp, "pp": pp, "dp": dp}, rank)  # coordinates only: construction needs no group
    before = high_water_bytes()
    cut = cut_model(model, cfg, mesh, Comm(mesh))
    peak = high_water_bytes()
    held = {id(q): q for part in cut.parts.values() for q in part.parameters()}
    share = sum(q.numel() * q.element_size() for q in held.values())
    keys = {key for part in cut.parts.values() for key, _ in part.named_parameters()}
    largest = max(math.prod(cut.placements[key].full_shape) * 4 for key in keys)  # drawn whole, fp32
    return {"preset": preset, "tp": tp, "pp": pp, "dp": dp, "rank": rank, "stages": list(cut.parts),
            "share_bytes": share, "largest_tensor_bytes": largest, "rss_before_cut_bytes": before,
            "peak_rss_bytes": peak, "bound_bytes": 1.5 * (share + largest),
            "peak_over_share_plus_largest": peak / (share + largest),
            "params_meta_after": sum(q.is_meta for q in held.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-70b")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(build_one_rank(args.preset, args.tp, args.pp, args.dp, args.rank)))
        return
    argv = [sys.executable, __file__, "--child", "--preset", args.preset, "--tp", str(args.tp), "--pp", str(args.pp),
            "--dp", str(args.dp), "--rank", str(args.rank)]
    result = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)  # a fresh process
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
