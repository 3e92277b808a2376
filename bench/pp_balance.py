"""Balanced pipeline stages, measured: each rank's idle share in the demo (configs/demo.toml:
dp 2 × tp 2 × pp 2, 1F1B, 4 micro-batches) and in configs/pp.toml (pp 4, ZB-H1, 8 micro-batches),
against the simulated ideal of the schedule with uniform stages (the registry's closed form:
20% and 11.1%).

Each run trains ``--steps`` steps with the split the engine chooses (``parallel.stage_costs``,
measured by default) or one given (``--set parallel.stage_layers=[2,2]``); a rank's idle share of a
step is 1 − its compute / the step's span (the timeline of the metrics file), averaged over the
steps after the first. The machine is shared, so each configuration runs ``--repeats`` times and
every run's figures are kept.

    .venv/bin/python bench/pp_balance.py          # writes bench/results/pp_balance.json
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

from threefold.plan.measured import mean_idle
from threefold.plan.records import steady

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "pp_balance.json"
QUIET = ["train.eval_every=0", "train.sample_tokens=0", "train.checkpoint_dir=none"]


def uniform_ideal(records: list[dict]) -> float:
    """The schedule's idle share with uniform stages at this run's measured ratio of forward,
    input-gradient and weight-gradient time (each the mean over stages and the steps after the
    first): 1F1B's does not depend on the ratio, ZB-H1's does (11.1% at pp 4, m 8 when F = B = W)."""
    from threefold.parallel.pipeline.schedule import build_schedule
    from threefold.plan.measured import idle_fractions, measured_costs
    from threefold.plan.simulate import ActionCosts, simulate

    costs = [measured_costs(record["timeline"]) for record in records[1:]]
    mean = lambda name: statistics.mean(statistics.mean(getattr(c, name)) for c in costs)  # noqa: E731
    timeline = records[-1]["timeline"]
    schedule = build_schedule(timeline["schedule"], timeline["pp"], timeline["microbatches"], timeline["virtual_stages"])
    uniform = ActionCosts(forward=mean("forward"), backward=mean("backward"), weight_grad=mean("weight_grad"))
    return statistics.mean(idle_fractions(simulate(schedule, uniform).segments()))


def run(config: str, steps: int, extra: list[str], metrics: Path) -> dict:
    args = [sys.executable, "-m", "threefold.cli", "train", "--config", config, "--no-progress",
            "--metrics-file", str(metrics)] + [f"--set={o}" for o in QUIET + [f"train.steps={steps}"] + extra]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise SystemExit(f"train failed: {done.stderr.strip().splitlines()[-1]}")
    split = next((line for line in (done.stderr + done.stdout).splitlines() if "pipeline stages" in line), "")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {"idle": mean_idle([record["timeline"] for record in steady(records)]), "uniform_ideal_at_measured_ratios": uniform_ideal(records), "split": split, "stage_layers": records[-1]["timeline"]["stage_layers"],
            "load_average": os.getloadavg()[0]}


@click.command()
@click.option("--steps", default=12, show_default=True)
@click.option("--repeats", default=2, show_default=True)
@click.option("--config", "configs", multiple=True, default=("configs/demo.toml", "configs/pp.toml"))
@click.option("--set", "extra", multiple=True, help="Overrides for every run (e.g. parallel.stage_layers=[2,2]).")
@click.option("--label", default="measured split")
def main(steps: int, repeats: int, configs, extra, label: str):
    ideal = {"configs/demo.toml": 0.2, "configs/pp.toml": 1 / 9}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            runs = [run(config, steps, list(extra), Path(tmp) / f"{i}.jsonl") for i in range(repeats)]
            results.setdefault(config, {})[label] = {"ideal_idle": ideal.get(config), "steps": steps,
                                                     "overrides": list(extra), "runs": runs}
            for r in runs:
                print(config, label, [f"{x:.1%}" for x in r["idle"]], r["stage_layers"],
                      f"uniform ideal at the measured F/B/W {r['uniform_ideal_at_measured_ratios']:.1%}",
                      f"load {r['load_average']:.0f}", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
