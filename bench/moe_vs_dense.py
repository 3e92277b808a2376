"""The tiny MoE against the dense tiny model of the same active parameters, on Shakespeare.

Trains both with configs/moe.toml, same data, seed, steps, batch and learning-rate schedule
(``--set model.preset=tiny`` gives the dense peer), one process each, one after the other.
Writes their validation curves and the MoE's load balance per step to
bench/results/moe_vs_dense.json and draws docs/img/moe-vs-dense.png (docs/moe.md,
"Does the tiny MoE beat dense?"). ``--metrics LABEL=FILE`` redraws from finished runs' JSONL
instead of training (the first one is the dense model).

    .venv/bin/python bench/moe_vs_dense.py                   # trains both: about 30 min on an idle core
    .venv/bin/python bench/moe_vs_dense.py --set train.steps=300
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "bench" / "results" / "moe_vs_dense.json"
PICTURE = ROOT / "docs" / "img" / "moe-vs-dense.png"


def train(label: str, overrides: list[str], folder: Path) -> Path:
    path = folder / f"{label}.jsonl"
    command = [sys.executable, "-m", "threefold.cli", "train", "--config", str(ROOT / "configs" / "moe.toml"),
               "--metrics-file", str(path), "--no-progress", "--set", "train.sample_tokens=0",
               "--set", "train.threads=1"]  # one thread, as docs/moe.md measured them
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, check=True)
    return path


def summary(label: str, path: Path) -> dict:
    """The run's validation curve, and per step the MoE's tokens per expert and worst layer's max/mean."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = {"label": label, "val_loss": [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]}
    if "moe" in records[0]:
        run["max_over_mean"] = [[r["step"], round(r["moe"]["max_over_mean"], 4)] for r in records]
        run["tokens_per_expert_last"] = records[-1]["moe"]["tokens_per_expert"]
    return run


def draw(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        left.plot(*zip(*run["val_loss"]), marker="o", ms=3, label=run["label"])
        if "max_over_mean" in run:
            right.plot(*zip(*run["max_over_mean"]), lw=0.8, label=run["label"])
    left.set(xlabel="step", ylabel="validation loss (nats/token)", title="Validation loss")
    right.axhline(1.0, color="grey", lw=0.5)
    right.set(xlabel="step", ylabel="worst layer: max / mean tokens per expert", ylim=(0.9, 4.1),
              title="Load balance (1: even; 4: one expert in every top-2)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--set", "overrides", multiple=True, help="a config override for both runs, section.key=value")
@click.option("--metrics", multiple=True, help="LABEL=FILE: a finished run's metrics JSONL (dense first); no training")
def main(overrides: tuple[str, ...], metrics: tuple[str, ...]) -> None:
    if metrics:
        runs = [summary(label, Path(path)) for label, path in (m.split("=", 1) for m in metrics)]
    else:
        with tempfile.TemporaryDirectory() as folder:
            runs = [summary("tiny (dense)", train("dense", ["model.preset=tiny", *overrides], Path(folder))),
                    summary("tiny-moe, aux loss 0.01", train("moe", list(overrides), Path(folder)))]
    RESULTS.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    draw(runs, PICTURE)
    for run in runs:
        step, loss = run["val_loss"][-1]
        balance = f", max/mean {run['max_over_mean'][-1][1]:.2f}" if "max_over_mean" in run else ""
        print(f"{run['label']}: validation loss {loss:.4f} at step {step}{balance}")
    print(f"wrote {RESULTS.relative_to(ROOT)} and {PICTURE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
