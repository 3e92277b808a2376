"""Pipelines that never flush against 1F1B, on this CPU: the measured bubble, and what the
staleness costs in loss.

1. Bubble. ``threefold train`` on pp = 4 (4 gloo processes), 8 micro-batches per step, 20 steps,
   once with 1F1B and once with 2BW, the same model, seed and batches. From every step's measured
   timeline (the metrics file's, each rank's compute actions), the bubble over the run:
   1 − Σ busy / (pp · Σ_steps span of the step), the first step (warm-up) left out. 1F1B fills and
   drains every step; 2BW's steps follow each other, each rank's warm-up forwards of the next step
   running in this one's drain, so only the run's first and last step fill and drain.
2. Loss. The same three runs' training loss on Shakespeare over the same steps and the same
   batches of 8 sequences: 1F1B (synchronous), 2BW (one update stale), PipeDream (one micro-batch
   of 8 per step, stage s a further pp − s − 1 updates stale), pp = 4. Plotted to
   docs/img/pp_async_loss.png.

    .venv/bin/python bench/pp_async.py            # writes bench/results/pp_async.json
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "pp_async.json"
PICTURE = ROOT / "docs" / "img" / "pp_async_loss.png"
MODEL = ["model.hidden=128", "model.heads=4", "model.kv_heads=4", "model.seq_len=128",
         "parallel.pp=4", "train.eval_every=0", "train.sample_tokens=0", "train.checkpoint_dir=none",
         "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=10", "train.threads=1"]


def train(overrides: list[str], metrics: Path) -> tuple[list[dict], str]:
    args = [sys.executable, "-m", "threefold.cli", "train", "--nproc", "4", "--no-progress",
            "--metrics-file", str(metrics)] + [f"--set={o}" for o in MODEL + overrides]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"train failed: {done.stderr.strip().splitlines()[-1]}")
    split = next((line for line in done.stderr.splitlines() + done.stdout.splitlines() if "pipeline stages" in line), "")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return records, split


def run_bubble(records: list[dict]) -> dict:
    """Idle share of the run's steps (the first left out): busy compute over pp × the steps' spans."""
    busy = span = 0.0
    per_step = []
    for record in records[1:]:
        ranks = [[(start, end) for start, end, kind, *_ in rank if kind in ("F", "B", "W")]
                 for rank in record["timeline"]["ranks"]]
        first = min(s for rank in ranks for s, _ in rank)
        last = max(e for rank in ranks for _, e in rank)
        step_busy = sum(e - s for rank in ranks for s, e in rank)
        busy += step_busy
        span += len(ranks) * (last - first)
        per_step.append(1 - step_busy / (len(ranks) * (last - first)))
    return {"bubble": 1 - busy / span, "per_step_median": statistics.median(per_step),
            "per_step_min": min(per_step), "per_step_max": max(per_step),
            "step_time_s_median": statistics.median(r["step_time_s"] for r in records[1:])}


@click.command()
@click.option("--bubble-steps", default=20, show_default=True)
@click.option("--loss-steps", default=200, show_default=True, help="0: the bubble only (the loss curves kept).")
@click.option("--bubble-layers", default=10, show_default=True,
              help="Blocks for the bubble runs: 10 split 3-3-3-1 + head evenly here (the head costs ~2.4 blocks).")
@click.option("--loss-layers", default=4, show_default=True)
def main(bubble_steps: int, loss_steps: int, bubble_layers: int, loss_layers: int):
    out = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"loss": {}}
    out["bubble"] = {}
    out.setdefault("setup", {}).update({"model": MODEL, "bubble_steps": bubble_steps, "bubble_layers": bubble_layers,
                                        "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()})
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("1f1b", "2bw"):
            records, split = train([f"model.layers={bubble_layers}", f"parallel.schedule={schedule}",
                                    f"train.steps={bubble_steps}",
                                    "train.global_batch=16", "train.micro_batch=2"], Path(tmp) / f"b-{schedule}.jsonl")
            out["bubble"][schedule] = {**run_bubble(records), "split": split}
            print(schedule, out["bubble"][schedule], flush=True)
        runs = {"1f1b": ["parallel.schedule=1f1b", "train.micro_batch=2"],
                "2bw": ["parallel.schedule=2bw", "train.micro_batch=2"],
                "pipedream": ["parallel.schedule=pipedream", "train.micro_batch=8"]}
        if loss_steps:
            out["loss"], out["setup"]["loss_steps"], out["setup"]["loss_layers"] = {}, loss_steps, loss_layers
        for name, overrides in runs.items() if loss_steps else ():
            records, _ = train(overrides + [f"model.layers={loss_layers}", f"train.steps={loss_steps}",
                                            "train.global_batch=8"],
                               Path(tmp) / f"l-{name}.jsonl")
            out["loss"][name] = [r["loss"] for r in records]
            tail = out["loss"][name][-20:]
            print(name, "mean loss of the last 20 steps", sum(tail) / len(tail), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"1f1b": "1F1B (synchronous)", "2bw": "2BW (1 update stale)",
              "pipedream": "PipeDream (stage s: 3 − s updates stale)"}
    for name, losses in out["loss"].items():
        smooth = [statistics.mean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=labels[name])
    ax.set_xlabel("step (8 sequences of 128 tokens each)")
    ax.set_ylabel("training loss (mean of 10 steps)")
    ax.set_title("pp = 4 on Shakespeare: what stale weights cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PICTURE, dpi=110)
    print(f"wrote {RESULTS} and {PICTURE}")


if __name__ == "__main__":
    main()
