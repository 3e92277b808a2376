"""The tiny MoE against the dense tiny model of the same active parameters, on Shakespeare.

Trains both with configs/moe.toml, same data, seed, steps, batch and learning-rate schedule
(``--set model.preset=tiny`` gives the dense peer; ``--moe PRESET`` another MoE than the
config's), one process of one thread each, one after the other (``--together``: both at once;
the runs are deterministic, so the losses are the same). Adds their validation curves and the MoE's
load balance per step to bench/results/moe_vs_dense.json, beside the runs already there (a run
of the same label is replaced), and draws this pair, with the earlier runs named by
``--beside`` dashed, in docs/img/moe-vs-dense.png (docs/moe.md, "Does the tiny MoE beat dense?").
``--metrics LABEL=FILE`` takes finished runs' JSONL instead of training (the first one is the
dense model).

    .venv/bin/python bench/moe_vs_dense.py --set train.steps=600   # trains both: about 25 min on an idle core
    .venv/bin/python bench/moe_vs_dense.py --together --set train.steps=1000 --moe tiny-moe-fine \
        --moe-set model.moe_expert_lr_scale=8 --beside "tiny-moe-fine, 1000 steps"   # the picture of docs/moe.md
    .venv/bin/python bench/moe_vs_dense.py --moe tiny-moe          # the first tiny MoE, 300 steps
    .venv/bin/python bench/moe_vs_dense.py --moe-set model.moe_aux_loss_coef=0.05   # a change to the MoE only
    .venv/bin/python bench/moe_vs_dense.py --together --moe tiny-moe-fine --moe-set model.moe_expert_lr_scale=8 \
        --set train.seed=1236   # the MoE that beats dense, with another seed (300 steps)
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


def start(label: str, overrides: list[str], folder: Path) -> tuple[subprocess.Popen, Path]:
    """A training run started in the background, and the path its metrics go to."""
    path = folder / f"{label}.jsonl"
    command = [sys.executable, "-m", "threefold.cli", "train", "--config", str(ROOT / "configs" / "moe.toml"),
               "--metrics-file", str(path), "--no-progress", "--set", "train.sample_tokens=0",
               "--set", "train.threads=1"]  # one thread, as docs/moe.md measured them
    for override in overrides:
        command += ["--set", override]
    return subprocess.Popen(command), path


def train(runs: list[tuple[str, list[str]]], folder: Path, together: bool) -> list[Path]:
    """Each (label, overrides) trained to the end, one after the other or all at once; their metrics."""
    started = []
    for label, overrides in runs:
        started.append(start(label, overrides, folder))
        if not together:
            started[-1][0].wait()
    for process, path in started:
        if process.wait():
            raise SystemExit(f"the run writing {path.name} failed (exit {process.returncode})")
    return [path for _, path in started]


def config_preset() -> str:
    import tomllib

    return tomllib.loads((ROOT / "configs" / "moe.toml").read_text())["model"]["preset"]


def summary(label: str, path: Path) -> dict:
    """The run's validation curve, and per step the MoE's tokens per expert and worst layer's max/mean."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = {"label": label, "val_loss": [[r["step"], r["val_loss"]] for r in records if "val_loss" in r]}
    if "moe" in records[0]:
        run["max_over_mean"] = [[r["step"], round(r["moe"]["max_over_mean"], 4)] for r in records]
        run["tokens_per_expert_last"] = records[-1]["moe"]["tokens_per_expert"]
    return run


def merged(runs: list[dict], path: Path) -> list[dict]:
    """The runs already recorded in ``path``, those of the same label as a new one replaced, then the new ones."""
    earlier = json.loads(path.read_text())["runs"] if path.exists() else []
    labels = {run["label"] for run in runs}
    return [run for run in earlier if run["label"] not in labels] + runs


def draw(runs: list[dict], beside: list[dict], path: Path) -> None:
    """``runs`` drawn solid, ``beside`` (earlier runs) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    drawn = [(run, "-") for run in runs] + [(run, "--") for run in beside]
    for (run, style), color in zip(drawn, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2):
        left.plot(*zip(*run["val_loss"]), ls=style, color=color, marker="o" if style == "-" else None, ms=3,
                  label=run["label"])
        if "max_over_mean" in run:
            right.plot(*zip(*run["max_over_mean"]), ls=style, color=color, lw=0.8, label=run["label"])
    left.set(xlabel="step", ylabel="validation loss (nats/token)", title="Validation loss")
    right.axhline(1.0, color="grey", lw=0.5)
    right.set(xlabel="step", ylabel="worst layer: max / mean tokens per expert", ylim=(0.9, None),
              title="Load balance (1: even; E/k: an expert in every top-k)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


@click.command()
@click.option("--set", "overrides", multiple=True, help="a config override for both runs, section.key=value")
@click.option("--moe", "moe_preset", default=None, help="the MoE preset (default: configs/moe.toml's)")
@click.option("--moe-set", "moe_sets", multiple=True, help="a config override for the MoE run only (named in its label)")
@click.option("--metrics", multiple=True, help="LABEL=FILE (split at the last =): a finished run's metrics JSONL (dense first); no training")
@click.option("--beside", multiple=True, help="LABEL of a run in the results to draw dashed beside these")
@click.option("--no-draw", is_flag=True, help="only add the runs to the results; leave the picture as it is")
@click.option("--together", is_flag=True, help="train the two at once, two processes of one thread each")
def main(overrides: tuple[str, ...], moe_preset: str | None, moe_sets: tuple[str, ...], metrics: tuple[str, ...],
         beside: tuple[str, ...], no_draw: bool, together: bool) -> None:
    if metrics:
        runs = [summary(label, Path(path)) for label, path in (m.rsplit("=", 1) for m in metrics)]
    else:
        steps = dict(o.split("=", 1) for o in overrides).get("train.steps", "300")
        both = "".join(f", {o}" for o in overrides if not o.startswith("train.steps="))  # the seed, the lr, …
        moe_overrides = [f"model.preset={moe_preset}"] * bool(moe_preset) + list(overrides) + list(moe_sets)
        moe_label = ", ".join([moe_preset or config_preset(), *moe_sets])
        with tempfile.TemporaryDirectory() as folder:
            dense, moe = train([("dense", ["model.preset=tiny", *overrides]), ("moe", moe_overrides)], Path(folder),
                               together)
            runs = [summary(f"tiny (dense), {steps} steps{both}", dense), summary(f"{moe_label}, {steps} steps{both}", moe)]
    everything = merged(runs, RESULTS)
    recorded = {run["label"]: run for run in everything}
    unknown = [label for label in beside if label not in recorded]
    if unknown:
        raise click.BadParameter(f"no run labelled {unknown[0]!r} in {RESULTS.name}", param_hint="--beside")
    RESULTS.write_text(json.dumps({"runs": everything}, indent=1) + "\n")
    if not no_draw:
        draw(runs, [recorded[label] for label in beside], PICTURE)
    for run in runs:
        step, loss = run["val_loss"][-1]
        balance = f", max/mean {run['max_over_mean'][-1][1]:.2f}" if "max_over_mean" in run else ""
        print(f"{run['label']}: validation loss {loss:.4f} at step {step}{balance}")
    print(f"wrote {RESULTS.relative_to(ROOT)}" + ("" if no_draw else f" and {PICTURE.relative_to(ROOT)}"))


if __name__ == "__main__":
    main()
