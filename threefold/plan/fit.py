"""``threefold calibrate --from-runs``: fit the local profile's efficiencies to measured runs.

The profile ``threefold calibrate`` measures holds typical rates: the median matmul FLOP/s and
copy bandwidth over its trials, the gloo all-reduce bandwidth and latency. A training step
usually reaches less of them (small products, Python between kernels, other processes on the
cores), and sometimes more (the machine faster than while it was measured): each fraction
ranges over [0.02, 1.5], up to half again as fast as measured. Given runs of the user's own
machine (a config and its metrics file each, all of one model: the same block, vocabulary and
sequence, any depth), this fits three fractions, one per kind of work,
so that the planner's predicted step times match the measured ones:

  matmul_efficiency  of the measured matmul peak (the products and the attention core),
  hbm_efficiency     of the measured copy bandwidth (the memory-bound work and the optimizer),
  link_efficiency    of the measured all-reduce bandwidth (every collective and transfer).

It minimises the mean squared log-ratio of predicted to measured step time (a run 20% slow
weighs as much as one 20% fast) over a grid of the three fractions in log space, refined around
its best point (the cost model evaluates a whole grid in one call per run), and
cross-validates: each run in turn is left out, the fractions are fitted on the others, and the
left-out run is predicted. The error before (the plain profile), after (fitted on all) and
left out is reported per run.

A run is given as ``CONFIG.toml:METRICS.jsonl`` or as a manifest ``.json``:
``{"name": {"config": "run.toml", "set": ["train.steps=8", …], "metrics": "run.jsonl"}, …}``
with paths relative to the manifest (bench/planner_runs.py writes one); ``MANIFEST.json:a,b``
takes the runs named a and b of it. Each config is checked against its metrics file as
``threefold compare`` checks it (compare.check_same_run).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from threefold.config import Config, ConfigError, check_output_path
from threefold.plan import costs
from threefold.plan.compare import (check_same_run, load_run, measured_imbalance, measured_step_time, read_steps,
                                    run_layout, run_split, with_run_split)
from threefold.plan.dryrun_predict import predict_rank
from threefold.plan.hardware import local_gpu
from threefold.words import plural

FRACTIONS = ("matmul_efficiency", "hbm_efficiency", "link_efficiency")


@dataclass(frozen=True)
class Run:
    name: str
    cfg: Config
    measured_s: float
    work: costs.Workload = None
    layout: costs.Layout = None
    stage_layers: tuple[int, ...] | None = None  # the run's pipeline split, from its timeline


def read_runs(specs, one_model: bool = True) -> list[Run]:
    """The runs named by ``--from-runs`` arguments; ConfigError, one line, for a bad one, and
    (``one_model``) for runs of different models (``check_one_model``)."""
    runs = []
    for spec in specs:
        before, sep, after = spec.rpartition(":")
        if spec.endswith(".json") or (sep and before.endswith(".json")):
            path, names = (Path(spec), None) if spec.endswith(".json") else (Path(before), after.split(","))
            try:
                manifest = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                raise ConfigError(f"--from-runs: cannot read the manifest {path} ({err})") from None
            if not isinstance(manifest, dict) or not manifest:
                raise ConfigError(f"--from-runs: {path} is not a manifest of runs (an object of name → run)")
            unknown = [name for name in names or [] if name not in manifest]
            if unknown:
                raise ConfigError(f"--from-runs: {path} has no run {unknown[0]!r}; its runs: {', '.join(manifest)}")
            for name, entry in manifest.items() if names is None else ((n, manifest[n]) for n in names):
                if not isinstance(entry, dict) or not {"config", "metrics"} <= set(entry):
                    raise ConfigError(f"--from-runs: {spec}: run {name!r} needs 'config' and 'metrics'")
                runs.append(_run(name, path.parent / entry["config"], path.parent / entry["metrics"],
                                 entry.get("set", []), f"--from-runs {spec}: run {name!r}"))
        else:
            config, sep, metrics = spec.rpartition(":")
            if not sep or not config:
                raise ConfigError(f"--from-runs: {spec!r} is neither CONFIG.toml:METRICS.jsonl nor a manifest .json")
            runs.append(_run(Path(metrics).stem, Path(config), Path(metrics), [], f"--from-runs {spec}"))
    if len(runs) < 2:
        raise ConfigError(f"--from-runs: needs at least two runs to fit and cross-validate, got {len(runs)}")
    if one_model:
        check_one_model(runs)
    return runs


def check_one_model(runs: list[Run]) -> None:
    """ConfigError, one line, unless every run trains the same model (``_block``): a fit's
    efficiencies are the machine's, but only runs of one model tell them apart from the model's."""
    first = runs[0]
    for run in runs[1:]:
        if _block(run.cfg) != _block(first.cfg):
            raise ConfigError(f"--from-runs: run {run.name!r} trains another model than {first.name!r} "
                              f"({_describe(run.cfg)} against {_describe(first.cfg)}): fit on runs of one model "
                              "(from a manifest: MANIFEST.json:NAME,NAME,…)")


def _block(cfg: Config) -> tuple:
    """What makes two runs the same model for the fit: the block's shapes (its products' sizes,
    which set how much of the peak they reach), the vocabulary and the sequence; the depth may
    differ (a pipeline benchmark stacks more of the same blocks)."""
    m = cfg.model
    return m.arch, m.hidden, m.heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size, m.seq_len


def _describe(cfg: Config) -> str:
    m = cfg.model
    return f"hidden {m.hidden}, {plural(m.heads, 'head')}, ffn {m.ffn_hidden}, vocab {m.vocab_size}, seq {m.seq_len}"


def _run(name: str, config: Path, metrics: Path, overrides, given: str) -> Run:
    """One run to fit; ``given``: the run as the user named it (``--from-runs CONFIG:METRICS``, or
    its manifest and name), which starts the one line of a ConfigError for a bad metrics file."""
    if not config.is_file():
        raise ConfigError(f"--from-runs: run {name!r}: no config file {config}")
    if not metrics.is_file():
        raise ConfigError(f"--from-runs: run {name!r}: no metrics file {metrics}")
    steps = read_steps(metrics, given)  # records.read_records: every field's type and value checked
    try:
        cfg = with_run_split(load_run(config, overrides), steps, metrics)
        check_same_run(cfg, predict_rank(cfg, 0), steps, metrics)
    except ConfigError as err:  # which run, then compare's words
        raise ConfigError(f"--from-runs: run {name!r}: {err}") from None
    return Run(name, cfg, measured_step_time(steps), *run_layout(cfg, measured_imbalance(cfg, steps)), run_split(cfg))


def predict(run: Run, profile: dict, fractions: dict):
    """The planner's step time of ``run`` with the profile's fractions set to ``fractions``
    (numbers, or numpy arrays of candidate values: then an array of step times)."""
    gpu = local_gpu(run.cfg.train.dtype, workers=run.cfg.parallel.world_size, profile={**profile, **PLAIN})
    gpu = dataclasses.replace(gpu, matmul_efficiency=fractions["matmul_efficiency"],
                              hbm_efficiency=fractions["hbm_efficiency"],
                              intra_link_efficiency=fractions["link_efficiency"],
                              inter_link_efficiency=fractions["link_efficiency"])
    step = costs.estimate(run.work, run.layout, gpu, stage_split=run.stage_layers)["step_time_s"]
    return float(step) if np.ndim(step) == 0 else np.asarray(step)


PLAIN = {key: 1.0 for key in FRACTIONS}
# The profile's rates are medians, not bursts (calibrate._typical_rate): a run may beat them.
MAX_FRACTION = 1.5
MIN_FRACTION = 0.02


def loss(runs, profile, fractions):
    """The mean squared log-ratio of predicted to measured step time over ``runs``."""
    return sum(np.log(predict(r, profile, fractions) / r.measured_s) ** 2 for r in runs) / len(runs)


def fit(runs: list[Run], profile: dict, levels: int = 4, points: int = 13) -> dict:
    """The fractions, each in [MIN_FRACTION, MAX_FRACTION], that minimise ``loss``: a grid of ``points`` values
    per fraction, evenly spaced in log, over all three at once (the cost model evaluates the
    whole grid in one call per run), then again around the best point on a grid 1/6 as wide,
    ``levels`` times: the last grid's step is 0.05% of the fraction; PLAIN where that is no better."""
    low, high = np.full(3, np.log(MIN_FRACTION)), np.full(3, np.log(MAX_FRACTION))
    best = None
    for _ in range(levels):
        axes = [np.linspace(low[k], high[k], points) for k in range(3)]
        grid = np.meshgrid(*axes, indexing="ij")
        values = {key: np.exp(g.ravel()) for key, g in zip(FRACTIONS, grid)}
        i = int(np.argmin(loss(runs, profile, values)))
        best = np.array([np.log(values[key][i]) for key in FRACTIONS])
        half = (high - low) / 12  # ±1/12 of this grid's span around the best point
        low, high = np.maximum(best - half, np.log(MIN_FRACTION)), np.minimum(best + half, np.log(MAX_FRACTION))
    fitted = {key: float(np.exp(value)) for key, value in zip(FRACTIONS, best)}
    # the grids need not hold the profile as measured (every fraction 1): never end worse than it
    return fitted if loss(runs, profile, fitted) <= loss(runs, profile, PLAIN) else dict(PLAIN)


def cross_validate(runs: list[Run], profile: dict) -> dict:
    """Per run: measured, predicted with the plain profile, fitted on all, and fitted on the
    others (left out); and the fractions fitted on all."""
    fitted = fit(runs, profile)
    rows = []
    for i, run in enumerate(runs):
        others = runs[:i] + runs[i + 1:]
        rows.append({"run": run.name, "measured_s": run.measured_s,
                     "plain_s": predict(run, profile, PLAIN),  # as measured, not an earlier fit's
                     "fitted_s": predict(run, profile, fitted),
                     "left_out_s": predict(run, profile, fit(others, profile))})
    for row in rows:
        for key in ("plain", "fitted", "left_out"):
            row[f"{key}_error"] = row[f"{key}_s"] / row["measured_s"] - 1
    mean = {key: sum(abs(r[f"{key}_error"]) for r in rows) / len(rows) for key in ("plain", "fitted", "left_out")}
    return {"fractions": fitted, "runs": rows, "mean_abs_error": mean, "at_limit": at_limit(fitted)}


def at_limit(fractions: dict) -> list[str]:
    """The fractions a fit left at an end of its range, [MIN_FRACTION, MAX_FRACTION]: the runs
    did not pin them down (too few layouts, or runs that disagree), and the profile then prices
    that kind of work by the limit, not by the machine."""
    return [key for key, value in fractions.items()
            if value <= MIN_FRACTION * 1.01 or value >= MAX_FRACTION / 1.01]


def fit_and_predict(train: list[Run], targets: list[Run], profile: dict) -> dict:
    """Fit on the runs of some layouts, predict those of others: the cross-validation a user
    does who calibrates on a few runs and plans another layout. The fractions fitted on
    ``train``, and per target its measured and predicted step time and the error."""
    fractions = fit(train, profile)
    rows = []
    for run in targets:
        predicted = predict(run, profile, fractions)
        rows.append({"run": run.name, "measured_s": run.measured_s, "predicted_s": predicted,
                     "error": predicted / run.measured_s - 1})
    errors = [abs(row["error"]) for row in rows]
    return {"fitted_on": [run.name for run in train], "fractions": fractions, "runs": rows,
            "mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors)}


def calibrate_from_runs(specs, out, as_json: bool) -> None:
    from threefold.plan.profile import load_profile, profile_path, save_profile

    path = Path(out or profile_path())
    check_output_path("--out", path)
    runs = read_runs(specs)  # a missing or wrong run is named before a missing profile
    profile = load_profile(path if path.exists() else None)
    report = cross_validate(runs, profile)
    saved = save_profile({**{k: v for k, v in profile.items() if k not in FRACTIONS}, **report["fractions"],
                          "fitted_from": [r.name for r in runs]}, path)
    if as_json:
        click.echo(json.dumps(dict(report, profile=str(saved))))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"step time: measured, predicted before and after fitting on {plural(len(runs), 'run')}")
    for column in ("run", "measured s", "plain profile", "fitted", "left out (cross-validated)"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for r in report["runs"]:
        table.add_row(r["run"], f"{r['measured_s']:.3f}", *(f"{r[k + '_s']:.3f} ({r[k + '_error']:+.0%})"
                                                            for k in ("plain", "fitted", "left_out")))
    mean = report["mean_abs_error"]
    table.caption = (f"mean |error|: plain {mean['plain']:.1%}, fitted {mean['fitted']:.1%}, left out "
                     f"{mean['left_out']:.1%}; fitted " + ", ".join(f"{k} {v:.3f}" for k, v in report["fractions"].items()))
    Console().print(table)
    for key in report["at_limit"]:
        click.echo(f"warning: {key} ended at {report['fractions'][key]:.3g}, the end of the range the fit searches "
                   f"([{MIN_FRACTION}, {MAX_FRACTION}]): these runs do not pin it down (runs of more layouts, or "
                   "longer ones, would); the profile prices that work by the limit", err=True)
    click.echo(f"profile written to {saved}")


