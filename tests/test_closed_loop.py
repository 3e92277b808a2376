"""The planner's closed loop, replayed from runs of this machine recorded by bench/planner_runs.py
(no training here): ``threefold compare``'s exposed communication per axis, the step time on the
plain profile, and the cross-validation of ``calibrate --from-runs`` on runs of other layouts.

The acceptance bars (issue 16) are asserted only on runs recorded on an otherwise idle machine:
each run records how many cores other processes kept busy meanwhile, and where that exceeded a
quarter of the cores the bar is skipped, the figure in the reason — a step timed beside twenty
other processes measures the neighbours."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

from threefold.plan import compare as cmp
from threefold.plan import fit
from threefold.plan.hardware import local_gpu

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench" / "results" / "planner_runs"
sys.path.insert(0, str(ROOT / "bench"))
import planner_runs  # noqa: E402  (the recorder: its run names, targets and the exposed runs)

MANIFEST = json.loads((RUNS / "manifest.json").read_text())


@pytest.fixture(autouse=True)
def recorded_profile(monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(RUNS))  # local.json: the profile measured with the runs


def recorded(name: str):
    entry = MANIFEST[name]
    return cmp.load_run(RUNS / entry["config"], entry["set"]), RUNS / entry["metrics"]


def rows_of(name: str) -> dict:
    cfg, metrics = recorded(name)
    return {row.quantity: row for row in cmp.compare_run(cfg, metrics)}


def require_idle(*names: str) -> None:
    """Skip unless other processes kept at most a quarter of the cores busy during every run
    (bench/planner_runs.py measures it from /proc/stat, the run's own CPU time taken off)."""
    cores = json.loads((RUNS / "local.json").read_text())["gpus_per_node"]
    others = {n: MANIFEST[n].get("other_processes_cores") for n in names}
    busy = {n: c for n, c in others.items() if c is None or c > 0.25 * cores}
    if busy:
        pytest.skip(f"recorded while other processes kept more than a quarter of the {cores} cores busy ("
                    + ", ".join(f"{n} {'unknown' if c is None else f'{c:.2f} cores'}" for n, c in busy.items())
                    + "); re-record with `.venv/bin/python bench/planner_runs.py` on an idle machine")


def test_the_recording_holds_the_runs_the_loop_needs():
    assert set(planner_runs.TARGETS) | set(planner_runs.EXPOSED_RUNS) <= set(MANIFEST)
    for entry in MANIFEST.values():
        assert {"load_1min_before", "load_1min_after", "seconds", "other_processes_cores"} <= set(entry)
        steps = cmp.read_steps(RUNS / entry["metrics"])
        assert all(set(s["comm_exposed_s"]) == set(s["comm_bytes"]) for s in steps)  # one key per ledger key


@pytest.mark.parametrize("name", ["ddp", "zero3", "dp-pp", "demo", "tp"])
def test_exposed_rows_are_the_planners_terms_beside_the_measured_waits(name):
    cfg, metrics = recorded(name)
    rows = rows_of(name)
    p = cfg.parallel
    steps = cmp.read_steps(metrics)
    gpu = local_gpu(cfg.train.dtype, workers=p.world_size)
    est = cmp.estimate_run(cmp.with_run_split(cfg, steps), gpu)
    # beside the least-waiting rank's figure (dp, tp) the calls less the ranks' skew; beside rank 0's (pp) all of it
    least = cmp.estimate_run(cmp.with_run_split(cfg, steps), gpu.without_skew())
    assert gpu.on_core_wait_s > 0 and least["step_time_s"] <= est["step_time_s"]
    expected = {"dp": (p.dp > 1, least["dp_exposed_s"], ("dp",)),
                "tp": (p.tp > 1, least["tp_exposed_s"], ("tp", "tp.loss", "tp.partial_grads")),
                "pp": (p.pp > 1, est["pp_exposed_s"] + est["rank0_bubble_s"], ("pp",))}
    for axis, (present, predicted, keys) in expected.items():
        row = rows.get(f"exposed comm: {axis}")
        assert (row is not None) == present, (axis, sorted(rows))
        if row:
            assert row.unit == "s" and row.predicted == pytest.approx(predicted)
            rank_zero = statistics.median(sum(s["comm_exposed_s"].get(k, 0.0) for k in keys) for s in steps)
            if axis == "pp":  # rank 0's waits, the bubble among them
                assert row.measured == rank_zero
            else:  # the group's least call by call, at most the least of its ranks' step totals,
                # at most rank 0's total, on every step
                assert row.measured == statistics.median(s["comm_exposed_call_least_s"][axis] for s in steps)
                for s in steps:
                    assert (s["comm_exposed_call_least_s"][axis] <= s["comm_exposed_least_s"][axis] + 1e-12
                            <= sum(s["comm_exposed_s"].get(k, 0.0) for k in keys) + 2e-12)


def test_metrics_without_exposed_times_give_no_exposed_rows(tmp_path):
    cfg, metrics = recorded("ddp")
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "comm_exposed_s"}) + "\n"
                           for line in metrics.read_text().splitlines()))
    rows = {row.quantity for row in cmp.compare_run(cfg, old)}
    assert "step time" in rows and not any(q.startswith("exposed comm") for q in rows)


def test_tolerance_is_25_percent_or_20_ms_whichever_is_larger():
    row = lambda predicted, measured: cmp.Row("t", predicted, measured, "", unit="s")  # noqa: E731
    assert cmp.within_tolerance(row(0.030, 0.045))  # 15 ms off: inside 20 ms
    assert not cmp.within_tolerance(row(0.010, 0.045))  # 35 ms off, 78%
    assert cmp.within_tolerance(row(1.2, 1.0)) and not cmp.within_tolerance(row(1.3, 1.0))
    assert cmp.within_tolerance(row(None, 1.0)) is None


def train_and_targets() -> tuple[list, list]:
    """The recording's runs, split as the recorder splits them: the targets (the demo trains a
    4,608-token vocabulary, the benchmarks 4,096) and the runs of other layouts, of one model."""
    runs = fit.read_runs([str(RUNS / "manifest.json")], one_model=False)
    train = [r for r in runs if r.name not in planner_runs.TARGETS]
    fit.check_one_model(train)
    return train, [r for r in runs if r.name in planner_runs.TARGETS]


def test_cross_validation_fits_on_other_layouts_and_predicts_the_targets():
    train, targets = train_and_targets()
    profile = json.loads((RUNS / "local.json").read_text())
    report = fit.fit_and_predict(train, targets, profile)
    assert report["fitted_on"] == [r.name for r in train] and not set(report["fitted_on"]) & set(planner_runs.TARGETS)
    assert [row["run"] for row in report["runs"]] == [r.name for r in targets]
    for row, run in zip(report["runs"], targets):
        assert row["predicted_s"] == pytest.approx(fit.predict(run, profile, report["fractions"]))
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1)
    # The fit is at least as good on what it was fitted to as the plain profile.
    plain = {k: 1.0 for k in fit.FRACTIONS}
    assert fit.loss(train, profile, report["fractions"]) <= fit.loss(train, profile, plain)
    print(json.dumps({"targets_mean_abs_error": report["mean_abs_error"], "worst": report["max_abs_error"]}))


# ---- issue 16's bars, on runs recorded on an idle machine ------------------------------------
# The recording of 2026-12-05 04:52 UTC (2 rounds of 12 steps a run; other processes ≤ 0.03
# cores), designated before it was made (commit 4baa65e): the first after calibrate's collective
# lines came from the median of three passes and its shared-core workers were warmed before being
# timed. The plain profile: demo −2%, ddp −8%, tp −14%, pp −6% (bar 15%: met). Fitted on the other
# layouts: demo +5%, ddp −2%, tp −7%, pp −1% (bar 10%: met). Exposed communication, predicted /
# measured: DDP dp 0.009 / 0.004 s, ZeRO-3 dp 0.057 / 0.046, dp2·pp2 dp 0.008 / 0.002 and pp
# 0.061 / 0.063 (bar: within 25% or 20 ms: met). The three designated before it (2026-12-04 21:12,
# 23:28, 23:46; now planner_runs_2026-12-04_2112/, _2328/, _2346/) missed the exposed bar, the
# first two all three; docs/planner.md, "The closed loop", has every recording replayed.


def test_exposed_communication_within_25_percent_or_20_ms():
    require_idle(*planner_runs.EXPOSED_RUNS)
    for name in planner_runs.EXPOSED_RUNS:
        rows = [row for quantity, row in rows_of(name).items() if quantity.startswith("exposed comm")]
        assert rows
        for row in rows:
            assert cmp.within_tolerance(row), (name, row)


def test_compare_within_15_percent_on_the_plain_profile():
    require_idle(*planner_runs.TARGETS)
    for name in planner_runs.TARGETS:
        step = rows_of(name)["step time"]
        assert abs(step.predicted / step.measured - 1) <= 0.15, (name, step)


def test_the_demos_tp_waits_are_its_pairs_waits(monkeypatch):
    """The demo's tp calls wait for one partner, not for all 8 ranks (costs.group_wait): priced
    so, they come nearer what the demo's tp pairs waited than priced at the whole machine's wait.
    (Within 25% on the recordings of 2026-12-02 to -04 23:28; the 23:46 one's 0.773 s predicted
    against 0.565 s is 37% over, and the 12-05 04:52 one's 0.745 s against 0.529 s 41% over,
    docs/planner.md.)"""
    from threefold.plan import costs

    require_idle("demo")
    pairs = rows_of("demo")["exposed comm: tp"]
    monkeypatch.setattr(costs, "group_wait", lambda wait, members, runnable, pair_wait=None: wait)
    whole = rows_of("demo")["exposed comm: tp"]
    assert pairs.measured == whole.measured and pairs.predicted < whole.predicted
    assert abs(pairs.predicted - pairs.measured) < abs(whole.predicted - whole.measured)


def test_within_10_percent_after_fitting_on_other_layouts():
    require_idle(*MANIFEST)
    train, targets = train_and_targets()
    report = fit.fit_and_predict(train, targets, json.loads((RUNS / "local.json").read_text()))
    assert report["max_abs_error"] <= 0.10, report["runs"]


def test_a_recording_made_before_the_partial_gradients_key_was_renamed_reads_as_it_is_now():
    """The tp run was recorded when SP's once-a-step sum of partial gradients counted under
    "tp.norm_grads"; records.read_records reads it as "tp.partial_grads", which predict_rank now
    prices where the gradients are whole (ZeRO 0): the norm gains' 9,216 bytes, to the byte."""
    _, metrics = recorded("tp")
    assert '"tp.norm_grads"' in metrics.read_text()
    assert all("tp.norm_grads" not in s["comm_bytes"] for s in cmp.read_steps(metrics))
    row = rows_of("tp")["bytes/step: tp.partial_grads"]
    assert row.predicted == row.measured == 9216


# ---- the tiny Mixture-of-Experts (bench/planner_runs.py --moe), priced at its routing ---------
# The recording of 2026-12-07 18:59 UTC (20 steps a run, other processes 0.0 cores). Its learned
# routing is far from balanced in its first steps: the busiest ep rank took 1.32-1.78× the mean
# rows (the metrics' ep_max_over_mean, the median over the steps), and every rank waited for it.
MOE_RUNS = ROOT / "bench" / "results" / "moe_runs"
MOE_MANIFEST = json.loads((MOE_RUNS / "manifest.json").read_text())


def moe_step(name: str, imbalance: float | None = None) -> tuple[float, float, float]:
    """(measured, predicted at ``imbalance`` — by default the run's own —, the run's imbalance)."""
    entry = MOE_MANIFEST[name]
    cfg = cmp.load_run(MOE_RUNS / entry["config"], entry["set"])
    steps = cmp.read_steps(MOE_RUNS / entry["metrics"])
    return cmp.measured_step_time(steps), cmp.priced_step(cfg, steps, imbalance), cmp.measured_imbalance(cfg, steps)


def test_the_moe_recording_holds_every_moe_run(monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(MOE_RUNS))
    assert set(MOE_MANIFEST) == set(planner_runs.MOE_RUNS)
    assert all(entry["other_processes_cores"] <= 0.25 for entry in MOE_MANIFEST.values())
    ep_runs = [n for n in MOE_MANIFEST if "-ep" in n]
    assert all(1.2 < moe_step(n)[2] for n in ep_runs) and moe_step("moe-dp4")[2] == 1.0
    # calibrate --from-runs prices them at it too
    for run in fit.read_runs([str(MOE_RUNS / "manifest.json")]):
        assert run.work.moe_imbalance == moe_step(run.name)[2], run.name


def test_compare_prices_moe_runs_at_their_measured_routing_imbalance(monkeypatch):
    """Priced balanced, the expert-parallel runs come out 14-29% fast; at the busiest rank's
    measured load, 5-19% fast (within 20%; 10% on average). compare's step row is that price."""
    monkeypatch.setenv("THREEFOLD_HOME", str(MOE_RUNS))
    errors = {}
    for name in MOE_MANIFEST:
        measured, priced, imbalance = moe_step(name)
        _, balanced, _ = moe_step(name, 1.0)
        if imbalance > 1:
            assert abs(priced / measured - 1) < abs(balanced / measured - 1), name
        assert abs(priced / measured - 1) < 0.20, name
        entry = MOE_MANIFEST[name]
        row = {r.quantity: r for r in cmp.compare_run(cmp.load_run(MOE_RUNS / entry["config"], entry["set"]),
                                                       MOE_RUNS / entry["metrics"])}["step time"]
        assert row.predicted == pytest.approx(priced)
        errors[name] = priced / measured - 1
    assert statistics.mean(abs(e) for e in errors.values()) < 0.15, errors
