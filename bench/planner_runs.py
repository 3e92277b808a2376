"""Record short training runs of this machine for the planner's closed loop: the demo's layout
and the dp, tp, pp and ZeRO-3 layouts of configs/, a few steps each, with the machine profile
they were measured with. ``threefold compare`` predicts each run's step time from the profile;
``threefold calibrate --from-runs`` fits the profile's efficiencies to them; tests/test_calibrate.py
replays the recorded files, so the test needs no training.

    .venv/bin/python bench/planner_runs.py [--steps 8] [--only demo,ddp]

Writes bench/results/planner_runs/{local.json, <name>.jsonl, <name>.toml, manifest.json}. Each
run is short (the tiny model, a few steps, no evaluation, no checkpoints, no sample), well under
two minutes on a shared 2-core machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click

from threefold.plan.compare import load_run

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "planner_runs"
QUIET = ["train.eval_every=0", "train.sample_tokens=0", "train.checkpoint_every=0", 'train.checkpoint_dir=""',
         "train.warmup_steps=2"]
RUNS = {  # name → (config file, its overrides)
    "demo": ("configs/demo.toml", []),
    "ddp": ("configs/ddp.toml", []),
    "tp": ("configs/tp.toml", []),
    "pp": ("configs/pp.toml", []),
    "zero3": ("configs/zero3.toml", []),
    "single": ("configs/single.toml", []),
    "ddp-mb2": ("configs/ddp.toml", ["train.micro_batch=2"]),
    "pp-1f1b": ("configs/pp.toml", ["parallel.schedule=1f1b", "parallel.pp=2"]),
}


def threefold(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / ".venv" / "bin" / "threefold"), *args], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=600)


@click.command()
@click.option("--steps", type=int, default=8, show_default=True, help="Training steps per run.")
@click.option("--only", default=None, help="Comma-separated run names (default: all).")
@click.option("--profile/--no-profile", default=True, help="Measure the machine profile first (calibrate --quick).")
def main(steps, only, profile):
    OUT.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, THREEFOLD_HOME=str(OUT), PYTHONPATH=str(ROOT))
    if profile:
        done = threefold("calibrate", "--quick", "--json", env=env)
        if done.returncode:
            sys.exit(done.stderr)
        click.echo(f"profile: {done.stdout.strip()}")
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    for name, (config, overrides) in RUNS.items():
        if only and name not in only.split(","):
            continue
        sets = [*overrides, *QUIET, f"train.steps={steps}"]
        metrics = OUT / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        began = time.perf_counter()
        done = threefold("train", "--config", config, *(a for s in sets for a in ("--set", s)),
                         "--metrics-file", str(metrics), "--no-progress", env=env)
        seconds = time.perf_counter() - began
        if done.returncode:
            click.echo(f"{name}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
            continue
        (OUT / f"{name}.toml").write_text((ROOT / config).read_text())
        # The tokenizer's vocabulary, so that replaying needs no tokenizer.
        vocab = load_run(ROOT / config, sets).model.vocab_size
        manifest[name] = {"config": f"{name}.toml", "set": [*sets, f"model.vocab_size={vocab}"],
                          "metrics": f"{name}.jsonl", "seconds": seconds}
        click.echo(f"{name}: {seconds:.0f} s")
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
