"""Record the planner's closed loop on this machine, in one command:

    .venv/bin/python bench/planner_runs.py --steps 12   # about 12 minutes on an idle 2-core machine

1. ``threefold calibrate`` (the full one) measures the machine profile;
2. short training runs, the tiny model, a few steps each: the demo's dp2·tp2·pp2 and the dp, tp
   and pp benchmark configs (the runs ``threefold compare`` must predict), and runs of other
   layouts to fit on (one process, ZeRO-3 on 2 ranks, dp2·pp2, 1F1B on 2 stages);
3. the comparison: each run's step time and its exposed communication per axis (the seconds
   blocked in waits: on dp and tp, call by call, the least any rank of the group waited, the
   metrics' ``comm_exposed_call_least_s``; on pp rank 0's, bubble included) against the planner's
   prediction on the plain profile, and the cross-validation: the profile's efficiencies
   fitted (``calibrate --from-runs``) on the runs of other layouts, then the four targets predicted.

Every run can be recorded ``--rounds`` times (default 1), each round running all of them in turn,
and its steps pooled: this machine's speed drifts by 15-20% over minutes (a shared VM's
neighbours), and one short run of a layout measures the minute it ran in. Each run's load
average (1 minute, before and after; the run's own ranks count in it) and the
cores other processes kept busy while it ran (``other_processes_cores``: the machine's busy CPU
time from /proc/stat less the run's own) are recorded beside it: on a shared machine the step
times say as much about the neighbours as about the code. Writes
bench/results/planner_runs/{local.json, <name>.toml, <name>.jsonl, manifest.json, summary.json};
tests/test_calibrate.py replays them as data. ``--only ddp,zero3`` re-records some runs (keeping
the others and the profile with ``--no-profile``); ``--out DIR`` records elsewhere;
``--summary-only`` trains nothing and compares the recording with the planner as it is now.
``--moe`` records the tiny Mixture-of-Experts instead (MOE_RUNS, in bench/results/moe_runs):
each priced at the routing imbalance it measured (``compare.measured_imbalance``), balanced beside
it; tests/test_closed_loop.py replays those too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from threefold.plan.calibrate import OtherProcesses

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "planner_runs"
QUIET = ["train.eval_every=0", "train.sample_tokens=0", "train.checkpoint_every=0", 'train.checkpoint_dir=""',
         "train.warmup_steps=2"]
TARGETS = ("demo", "ddp", "tp", "pp")  # what `threefold compare` must predict within 15%
RUNS = {  # name → (config file, its overrides); the targets first
    "demo": ("configs/demo.toml", []),
    "ddp": ("configs/ddp.toml", []),
    "tp": ("configs/tp.toml", []),
    "pp": ("configs/pp.toml", []),
    # One thread, as the profile's worker: two would share one process's products over both cores,
    # and under load OpenMP's threads wait for each other (steps of 12-45 s where 2 ranks take 3).
    "single": ("configs/single.toml", ["train.threads=1"]),
    # ZeRO-3 on 2 ranks, one per core: with more ranks than cores a rank also waits for partners
    # the OS has descheduled, which no planner of GPUs models (configs/zero3.toml has dp=4).
    "zero3": ("configs/zero3.toml", ["parallel.dp=2"]),
    "dp-pp": ("configs/ddp.toml", ["parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=2"]),
    "pp-1f1b": ("configs/pp.toml", ["parallel.schedule=1f1b", "parallel.pp=2"]),
}
EXPOSED_RUNS = ("ddp", "zero3", "dp-pp")  # exposed communication within 25% or 20 ms of the planner's
# `--moe`: the tiny Mixture-of-Experts (configs/moe.toml) with and without expert parallelism,
# recorded apart (another model: the fit takes runs of one). Its learned routing is far from
# balanced in its first steps, so `compare` prices each run at the imbalance it measured.
MOE_OUT = ROOT / "bench" / "results" / "moe_runs"
MOE_RUNS = {
    "moe-dp2-ep2": ("configs/moe.toml", ["parallel.dp=2", "parallel.ep=2"]),
    "moe-dp4-ep4": ("configs/moe.toml", ["parallel.dp=4", "parallel.ep=4", "train.micro_batch=2"]),
    "moe-dp4-ep2": ("configs/moe.toml", ["parallel.dp=4", "parallel.ep=2", "train.micro_batch=2"]),
    "moe-dp2-tp2-ep2": ("configs/moe.toml", ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                             "parallel.ep=2"]),
    "moe-dp4": ("configs/moe.toml", ["parallel.dp=4", "train.micro_batch=2"]),
    # the ep group folded over tp (parallel.expert_tp = 1): the planner's --expert-tp 1
    "moe-dp2-tp2-ep4-folded": ("configs/moe.toml", ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                                    "parallel.ep=4", "parallel.expert_tp=1"]),
}
ALL_RUNS = {**RUNS, **MOE_RUNS}


def threefold_command(*args: str) -> list[str]:
    return [str(ROOT / ".venv" / "bin" / "threefold"), *args]


def load_1min() -> float:
    return round(os.getloadavg()[0], 2)


def record_run(name: str, steps: int, out: Path, env: dict, advance, round_: int = 0) -> dict | None:
    """Train one run, calling ``advance(steps done)`` as its metrics file grows; its manifest
    entry, or None (with the reason printed) if it failed. ``round_``: which of the recording's
    rounds (its metrics go to ``<name>.round<k>.jsonl`` until ``merge_rounds``)."""
    from threefold.plan.compare import load_run

    config, overrides = ALL_RUNS[name]
    sets = [*overrides, *QUIET, f"train.steps={steps}"]
    metrics = out / f"{name}.round{round_}.jsonl"
    metrics.unlink(missing_ok=True)
    load_before, began = load_1min(), time.perf_counter()
    with open(out / f"{name}.log", "w") as log, OtherProcesses() as others:
        proc = subprocess.Popen(threefold_command("train", "--config", config, *(a for s in sets for a in ("--set", s)),
                                                  "--metrics-file", str(metrics), "--no-progress"),
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:
            time.sleep(0.5)
            advance(len(metrics.read_text().splitlines()) if metrics.exists() else 0)
    seconds = time.perf_counter() - began
    if proc.returncode:
        tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:]
        click.echo(f"{name}: failed ({proc.returncode}): {tail}", err=True)
        return None
    (out / f"{name}.log").unlink()
    (out / f"{name}.toml").write_text((ROOT / config).read_text())
    vocab = load_run(ROOT / config, sets).model.vocab_size  # so that replaying needs no tokenizer
    return {"config": f"{name}.toml", "set": [*sets, f"model.vocab_size={vocab}"], "metrics": metrics.name,
            "seconds": round(seconds, 1), "load_1min_before": load_before, "load_1min_after": load_1min(),
            "other_processes_cores": None if others.cores is None else round(others.cores, 2)}


def merge_rounds(name: str, entries: list[dict], out: Path) -> dict:
    """One manifest entry and one metrics file ``<name>.jsonl`` from a run's rounds: every
    round's steps but its first (the warm-up), after the first round's whole file, whose first
    step the comparison leaves out itself; the seconds summed, the busiest round's load and
    other processes. The machine's speed drifts over minutes (a shared VM): rounds spread over
    the recording let each run's median step see the same drift."""
    lines = []
    for i, entry in enumerate(entries):
        path = out / entry["metrics"]
        steps = [line for line in path.read_text().splitlines() if line.strip()]
        lines += steps if i == 0 else steps[1:]
        path.unlink()
    (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    others = [e["other_processes_cores"] for e in entries]
    return dict(entries[0], metrics=f"{name}.jsonl", rounds=len(entries),
                seconds=round(sum(e["seconds"] for e in entries), 1),
                load_1min_before=max(e["load_1min_before"] for e in entries),
                load_1min_after=max(e["load_1min_after"] for e in entries),
                other_processes_cores=None if None in others else max(others))


def summarize(out: Path, manifest: dict, console: Console) -> dict:
    """The comparison of every recorded run (plain profile) and the cross-validation; printed
    and returned for summary.json."""
    from threefold.plan import fit
    from threefold.plan.compare import compare_run, load_run, measured_imbalance, priced_step, read_steps, within_tolerance
    from threefold.plan.profile import load_profile

    profile = load_profile(out / "local.json")
    runs = {}
    for name, entry in manifest.items():
        cfg = load_run(out / entry["config"], entry["set"])
        rows = {row.quantity: row for row in compare_run(cfg, out / entry["metrics"])}
        step = rows["step time"]
        exposed = {q.split(": ")[1]: {"predicted_s": r.predicted, "measured_s": r.measured,
                                      "within": within_tolerance(r)}
                   for q, r in rows.items() if q.startswith("exposed comm")}
        runs[name] = {"measured_s": step.measured, "plain_s": step.predicted,
                      "plain_error": step.predicted / step.measured - 1, "exposed": exposed,
                      "load_1min": [entry.get("load_1min_before"), entry.get("load_1min_after")],
                      "other_processes_cores": entry.get("other_processes_cores")}
        if cfg.parallel.ep > 1:  # priced at the busiest ep rank's measured load; balanced beside it
            steps = read_steps(out / entry["metrics"])
            runs[name].update(moe_imbalance=measured_imbalance(cfg, steps), balanced_s=priced_step(cfg, steps, 1.0))
    # The fit needs runs of one model; the targets may train another (the demo's vocabulary is
    # 4,608 tokens, the benchmarks' 4,096): the fitted efficiencies are the machine's.
    loaded = fit.read_runs([str(out / "manifest.json")], one_model=False)
    train = [r for r in loaded if r.name not in TARGETS]
    targets = [r for r in loaded if r.name in TARGETS]
    fit.check_one_model(train)
    cross = fit.fit_and_predict(train, targets, profile) if len(train) >= 2 and targets else None

    table = Table(title="step time (s): measured, and the planner on the plain calibrate profile and fitted on "
                        "the other layouts")
    moe = any("moe_imbalance" in r for r in runs.values())
    for column in ("run", "load 1 min", "others' cores", "measured", "plain profile", "fitted on others") + (
            ("busiest ep rank", "balanced routing") if moe else ()):
        table.add_column(column, justify="left" if column == "run" else "right")
    fitted = {row["run"]: row for row in cross["runs"]} if cross else {}
    for name, r in runs.items():
        f = fitted.get(name)
        balanced = (f"{r['moe_imbalance']:.2f}×", f"{r['balanced_s']:.3f} ({r['balanced_s'] / r['measured_s'] - 1:+.0%})"
                    ) if "moe_imbalance" in r else ("", "")
        table.add_row(name + (" *" if name in TARGETS else ""), "{} → {}".format(*r["load_1min"]),
                      str(r["other_processes_cores"]), f"{r['measured_s']:.3f}", f"{r['plain_s']:.3f} ({r['plain_error']:+.0%})",
                      f"{f['predicted_s']:.3f} ({f['error']:+.0%})" if f else "", *(balanced if moe else ()))
    plain_targets = [abs(runs[n]["plain_error"]) for n in TARGETS if n in runs]
    caption = [f"* targets: plain mean |error| {sum(plain_targets) / len(plain_targets):.1%}, "
               f"worst {max(plain_targets):.1%} (bar 15%)"] if plain_targets else []
    if cross:
        caption.append(f"fitted on {', '.join(r.name for r in train)}: the targets' mean |error| "
                       f"{cross['mean_abs_error']:.1%}, worst {cross['max_abs_error']:.1%} (bar 10%)")
    table.caption = "\n".join(caption)
    console.print(table)

    exposed = Table(title="exposed communication per step (s): measured (dp, tp: the group's least wait, "
                          "call by call; pp: rank 0's) and the planner's")
    for column in ("run", "axis", "predicted", "measured", "within 25% or 20 ms"):
        exposed.add_column(column, justify="left" if column in ("run", "axis") else "right")
    for name, r in runs.items():
        for axis, e in r["exposed"].items():
            exposed.add_row(name + (" †" if name in EXPOSED_RUNS else ""), axis, f"{e['predicted_s']:.3f}",
                            f"{e['measured_s']:.3f}", "yes" if e["within"] else "no")
    exposed.caption = "† the runs of the bar (DDP, ZeRO-3, dp × pp); pp: the waits include the schedule's bubble"
    console.print(exposed)
    return {"profile": {k: profile[k] for k in ("peak_flops_fp32", "hbm_bw", "intra_node_bw", "latency_s",
                                                "gpus_per_node", "measured_at")},
            "runs": runs, "cross_validation": cross}


def write_summary(out_dir: Path, manifest: dict) -> None:
    """Print the comparison of the recorded runs and write it to summary.json."""
    summary = summarize(out_dir, {n: manifest[n] for n in ALL_RUNS if n in manifest}, Console())
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


@click.command()
@click.option("--steps", type=int, default=6, show_default=True, help="Training steps per run and round.")
@click.option("--rounds", type=click.IntRange(1), default=1, show_default=True,
              help="Record every run this many times, the rounds one after another (each run's steps pooled).")
@click.option("--only", default=None, help="Comma-separated run names (default: all).")
@click.option("--profile/--no-profile", default=True, help="Measure the machine profile first (threefold calibrate).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=OUT, show_default=True)
@click.option("--summary-only", is_flag=True,
              help="Train nothing: compare the recorded runs with the planner as it is now (after a model change).")
@click.option("--moe", is_flag=True,
              help=f"Record the Mixture-of-Experts runs ({', '.join(MOE_RUNS)}) instead, by default in "
                   f"{MOE_OUT.relative_to(ROOT)}.")
def main(steps, rounds, only, profile, out_dir, summary_only, moe):
    runs = MOE_RUNS if moe else RUNS
    if moe and out_dir == OUT:
        out_dir = MOE_OUT
    if summary_only:
        if not (out_dir / "manifest.json").is_file():
            raise click.BadParameter(f"{out_dir} holds no recording (no manifest.json)", param_hint="--out")
        os.environ["THREEFOLD_HOME"] = str(out_dir)
        write_summary(out_dir, json.loads((out_dir / "manifest.json").read_text()))
        return
    console = Console(stderr=True)
    names = [n for n in runs if not only or n in only.split(",")]
    unknown = set(only.split(",")) - set(runs) if only else set()
    if unknown:
        raise click.BadParameter(f"unknown run {sorted(unknown)[0]!r} (known: {', '.join(runs)})", param_hint="--only")
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, THREEFOLD_HOME=str(out_dir), PYTHONPATH=str(ROOT))
    os.environ["THREEFOLD_HOME"] = str(out_dir)  # compare_run reads the profile from there
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() and only else {}
    columns = [TextColumn("{task.description:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TimeElapsedColumn(), TextColumn("load {task.fields[load]}")]
    began = time.perf_counter()
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("", total=steps * len(names) * rounds + (steps if profile else 0), load=load_1min())
        done = 0
        if profile:
            bar.update(task, description="threefold calibrate")
            measured = subprocess.run(threefold_command("calibrate", "--json"), cwd=ROOT, env=env, capture_output=True,
                                      text=True, timeout=300)
            if measured.returncode:
                sys.exit(measured.stderr)
            done += steps
            bar.update(task, completed=done)
        recorded = {name: [] for name in names}
        for round_ in range(rounds):
            for name in names:
                bar.update(task, description=f"{name} ({runs[name][0]}) {round_ + 1}/{rounds}", load=load_1min())
                entry = record_run(name, steps, out_dir, env,
                                   lambda n, done=done: bar.update(task, completed=done + n, load=load_1min()), round_)
                done += steps
                bar.update(task, completed=done)
                if entry:
                    recorded[name].append(entry)
        for name, entries in recorded.items():
            if len(entries) == rounds:  # a run that failed in any round is left out
                manifest[name] = merge_rounds(name, entries, out_dir)
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    console.print(f"recorded in {time.perf_counter() - began:.0f} s")
    write_summary(out_dir, manifest)


if __name__ == "__main__":
    main()
