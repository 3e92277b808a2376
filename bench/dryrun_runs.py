"""The dry runs of docs/scale.md, each one step with --compare, written to bench/results/dryrun_*.jsonl.

    python bench/dryrun_runs.py                  # all five (about 12 minutes on a shared 2-core machine)
    python bench/dryrun_runs.py --only llama3_70b
    python bench/dryrun_runs.py --predict-only   # recompute the planner's figures in the files, keep the measured

Each run is `threefold dryrun --config CONFIG --world-size N --rank FIRST --rank LAST --compare --json`,
FIRST the first pipeline stage's rank 0 and LAST the first rank of the last pipeline stage.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {  # name → (config, world size, ranks)
    "llama3_8b": ("configs/dryrun-llama3-8b.toml", 8, (0,)),
    "llama3_70b": ("configs/dryrun-llama3-70b.toml", 1024, (0, 1024 - 1024 // 8)),
    "llama3_405b": ("configs/dryrun-llama3-405b.toml", 1024, (0, 1024 - 1024 // 16)),
    "llama3_405b_interleaved": ("configs/dryrun-llama3-405b-interleaved.toml", 896, (0, 896 - 896 // 14)),
    "gpt3_175b_llama": ("configs/dryrun-gpt3-175b-llama.toml", 1024, (0, 1024 - 1024 // 8)),
}


def out_path(name: str) -> Path:
    return ROOT / "bench" / "results" / f"dryrun_{name}.jsonl"


def run(name: str) -> None:
    config, world, ranks = RUNS[name]
    argv = [sys.executable, "-m", "threefold.cli", "dryrun", "--config", config, "--world-size", str(world),
            *(x for r in ranks for x in ("--rank", str(r))), "--compare", "--json"]
    out = subprocess.run(argv, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    out_path(name).write_text(out)


def refresh_predictions(name: str) -> None:
    from threefold.configure import load_config
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config

    config, world, _ = RUNS[name]
    cfg = dry_run_config(load_config(ROOT / config), world)
    records = [json.loads(line) for line in out_path(name).read_text().splitlines()]
    for record in records:
        record["predicted"] = predict_rank(cfg, record["rank"])
    out_path(name).write_text("".join(json.dumps(r) + "\n" for r in records))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(RUNS))
    parser.add_argument("--predict-only", action="store_true")
    args = parser.parse_args()
    for name in [args.only] if args.only else RUNS:
        (refresh_predictions if args.predict_only else run)(name)
        print(f"wrote {out_path(name).relative_to(ROOT)}")


if __name__ == "__main__":
    main()
