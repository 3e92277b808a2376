"""`threefold calibrate`: the measurements, the profile file and the command."""
import dataclasses
import functools
import json
import multiprocessing

import numpy as np
import pytest
import torch

from threefold import cli
from threefold.config import ConfigError, ModelConfig
from threefold.plan import calibrate, costs, fit
from threefold.plan.hardware import CATALOG, local_gpu
from threefold.plan.profile import MEASURED_SINCE_KEYS

# Sizes small enough for a test: one round of each kind (QUICK's one concurrent round, and one of
# the collective curves, whose median over rounds is then that round's).
TINY = calibrate.Settings(matmul_size=256, matmul_seconds=0.05, copy_bytes=8 << 20, copy_seconds=0.05,
                          gloo_bytes=1 << 20, gloo_reps=2, gloo_timeout_s=60.0, wait_calls=5, curve_calls=2,
                          curve_rounds=1, shared_core_seconds=0.1, shared_core_rounds=1,
                          shared_core_warm_cpu_s=0.05, concurrent_rounds=1)


def example_profile() -> dict:
    return {"name": "local", "peak_flops_fp32": 1.0e11, "peak_flops_bf16": 2.0e11, "hbm_bytes": 24 << 30,
            "hbm_bw": 3.0e10, "intra_node_bw": 1.2e9, "inter_node_bw": 1.2e9, "latency_s": 2e-4,
            "gpus_per_node": 2, "threads": 1, "measured_at": "2026-01-01T00:00:00+00:00",
            "torch_version": torch.__version__}


def test_profile_round_trips_with_exact_keys(tmp_path):
    path = calibrate.save_profile(example_profile(), tmp_path / "sub" / "local.json")
    assert calibrate.load_profile(path) == example_profile()
    assert tuple(json.loads(path.read_text())) == calibrate.PROFILE_KEYS
    assert [p.name for p in path.parent.iterdir()] == ["local.json"]  # no temporary file left behind


def test_profile_path_follows_threefold_home(tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
    assert calibrate.profile_path() == tmp_path / "local.json"
    calibrate.save_profile(example_profile())
    assert calibrate.load_profile()["peak_flops_fp32"] == 1.0e11


@pytest.mark.parametrize("content", [None, "{not json", json.dumps({"name": "local"}),
                                     json.dumps({**example_profile(), "extra": 1})])
def test_load_profile_refuses_missing_or_malformed_files(tmp_path, content):
    path = tmp_path / "local.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="threefold calibrate") as err:
        calibrate.load_profile(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_flops_are_plausible(dtype):
    threads_before = torch.get_num_threads()
    flops = calibrate.measure_matmul_flops(dtype, threads=1, size=256, seconds=0.05)
    assert 1e8 < flops < 1e13  # one core: between a slow laptop and a CPU with matrix units
    assert torch.get_num_threads() == threads_before


def test_a_slow_kernel_is_timed_on_smaller_products():
    """bf16 without a fast CPU kernel (1.2 GFLOP/s on an AVX2 machine) would take 14 s per 2048-wide
    product, seven of them per measurement: the size halves until one takes at most half the
    budget. A fast kernel's 256-wide probe (45 GFLOP/s there for fp32) keeps the 2048 asked for."""
    assert calibrate.product_size(1.2e9, 2048, 2.0) == 512
    assert 2 * 512**3 / 1.2e9 <= 1.0 < 2 * 1024**3 / 1.2e9
    assert calibrate.product_size(45e9, 2048, 2.0) == 2048
    assert calibrate.product_size(45e9, 1024, 0.6) == 1024
    assert calibrate.product_size(1e6, 2048, 2.0) == calibrate.PROBE_SIZE  # never below the probe


def test_memory_bandwidth_is_plausible():
    assert 1e8 < calibrate.measure_memory_bandwidth(size_bytes=8 << 20, seconds=0.05) < 1e13


def forked_from_a_server_with_torch():
    """Forked from a server that has imported torch, the model, and torch._dynamo (which building
    AdamW imports: 1.4 s of CPU in each of the eight shared-core workers otherwise)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["threefold.plan.calibrate", "threefold.models.llama", "torch._dynamo"])
    return context


def test_command_quick_json_measures_and_saves(tmp_path, monkeypatch, capsys):
    """The whole command at TINY sizes. Its 24 workers are forked from a server that has imported
    torch, not spawned (calibrate.worker_context says why the command spawns them): 33 s, not 52."""
    monkeypatch.setattr(calibrate, "QUICK", TINY)
    monkeypatch.setattr(calibrate, "worker_context", forked_from_a_server_with_torch)
    # The sizes Settings does not carry, at test sizes too: the attention on 1 × 128 tokens (4 ×
    # 512 took 6 s in bf16), the memory-bound rounds and the block's fixed cost 0.05 s a timing.
    for name, sizes in (("measure_attention_flops", dict(batch=1, seq=128)),
                        ("memory_bound_rounds", dict(seconds=0.05)), ("dispatch_seconds_per_block", dict(seconds=0.05))):
        monkeypatch.setattr(calibrate, name, functools.partial(getattr(calibrate, name), **sizes))
    out = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == calibrate.load_profile(out)
    assert set(printed) == {*calibrate.PROFILE_KEYS, *MEASURED_SINCE_KEYS}
    assert 1e7 < printed["attention_flops_fp32"] <= 10 * printed["peak_flops_fp32"]
    assert 1e7 < printed["elementwise_bw"] < 1e13 and printed["concurrent_slowdown"] >= 1.0
    assert set(printed["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert all(c["latency_s"] >= 0 and c["bus_bw"] > 0 for c in printed["collectives"].values())
    cores = calibrate.cpu_cores()
    assert set(printed["oversubscribed_wait_s"]) == {str(max(2, cores)), str(2 * cores), str(4 * cores)}
    assert 0 <= printed["block_overhead_s"] < 1
    assert all(0 <= wait < 1 for wait in printed["oversubscribed_wait_s"].values())
    slowdown = printed["oversubscribed_compute_slowdown"]
    assert set(printed["oversubscribed_call_cpu_s"]) == set(slowdown) == set(printed["oversubscribed_wait_s"])
    assert all(0 <= cpu < 0.1 for cpu in printed["oversubscribed_call_cpu_s"].values())
    assert set(printed["oversubscribed_pair_wait_s"]) == set(printed["oversubscribed_wait_s"])
    assert all(0 <= wait < 1 for wait in printed["oversubscribed_pair_wait_s"].values())
    assert slowdown[str(max(2, cores))] == 1.0 and all(x >= 1.0 for x in slowdown.values())  # one a core: the base
    assert printed["name"] == "local" and printed["gpus_per_node"] == calibrate.cpu_cores()
    assert printed["peak_flops_bf16"] > 0 and printed["peak_flops_fp32"] > 1e8
    assert 1e6 < printed["intra_node_bw"] == printed["inter_node_bw"] < 1e12
    assert 0 < printed["latency_s"] < 0.1
    assert printed["hbm_bytes"] > 1 << 30 and printed["hbm_bw"] > 1e8


def test_the_shared_core_slowdown_is_each_crowded_phase_over_its_neighbours():
    """The machine speeds up 10% a phase while it is measured: each crowded phase against the mean
    of the one-a-core phases on either side still gives the 1.2x and 1.5x put in, and a phase at
    one worker a core in the middle of a crowded one's round is refused."""
    base = [1.0, 0.9, 0.8, 0.7, 0.6]
    phases = [(2, base[0]), (4, 1.2 * (base[0] + base[1]) / 2), (2, base[1]), (8, 1.5 * (base[1] + base[2]) / 2),
              (2, base[2]), (4, 1.2 * (base[2] + base[3]) / 2), (2, base[3]), (8, 1.5 * (base[3] + base[4]) / 2),
              (2, base[4])]
    assert calibrate.slowdown_from_phases(phases) == pytest.approx({"2": 1.0, "4": 1.2, "8": 1.5})
    # the median of three rounds: one disturbed round does not move it
    phases = [(2, 1.0), (8, 1.1), (2, 1.0), (8, 2.0), (2, 1.0), (8, 1.15), (2, 1.0)]
    assert calibrate.slowdown_from_phases(phases)["8"] == pytest.approx(1.15)
    assert calibrate.slowdown_from_phases([(2, 1.0), (4, 0.9), (2, 1.0)]) == {"2": 1.0, "4": 1.0}  # never below 1
    with pytest.raises(ValueError, match="lacks a base phase"):
        calibrate.slowdown_from_phases([(2, 1.0), (4, 1.1), (8, 1.2), (2, 1.0)])


class _ColdStartMachine:
    """phase(workers, seconds) on 2 cores: the first ``workers`` workers share them for that long;
    a worker's CPU per micro-batch is ``CROWD[workers]``, doubled until it has computed ``warm_s``
    of CPU (caches and allocator not yet in their steady state, as calibrate's workers were)."""
    CROWD = {1: 1.0, 2: 1.1, 4: 1.1 * 1.2, 8: 1.1 * 1.5}

    def __init__(self, warm_s=1.0, cores=2):
        self.cpu, self.warm_s, self.cores, self.calls = [0.0] * 8, warm_s, cores, []

    def __call__(self, workers, seconds):
        self.calls.append((workers, seconds))
        costs = []
        for w in range(workers):
            costs.append(self.CROWD[workers] * (2.0 if self.cpu[w] < self.warm_s else 1.0))
            self.cpu[w] += seconds * min(1.0, self.cores / workers)
        return sum(costs) / workers


def test_the_shared_core_workers_are_warmed_untimed_before_any_phase_is_timed():
    """Every worker first computes WARM_CPU_S of CPU at once, untimed; then the phases give the
    slowdowns put in. Without the warm-up the workers that first compute in a crowded phase are
    still cold, and the 8-worker figure reads half as much again as it is."""
    machine = _ColdStartMachine()
    concurrent, beyond = calibrate.shared_core_phases(machine, cores=2, seconds=2.0, rounds=2, concurrent_rounds=3,
                                                      warm_cpu_s=calibrate.WARM_CPU_S)
    assert machine.calls[0] == (8, calibrate.WARM_CPU_S * 8 / 2)  # all 8, WARM_CPU_S of CPU each
    assert all(seconds == 2.0 for _, seconds in machine.calls[1:])
    assert concurrent == pytest.approx(1.1) and beyond == pytest.approx({"2": 1.0, "4": 1.2, "8": 1.5})
    _, cold = calibrate.shared_core_phases(_ColdStartMachine(), cores=2, seconds=2.0, rounds=2, concurrent_rounds=3,
                                           warm_cpu_s=0.0)
    assert cold["8"] == pytest.approx(2.25)  # the median of two rounds, one of them cold: 1.5x the truth


def test_a_collectives_line_goes_through_the_median_of_its_rounds():
    """Three passes over the sizes; in one, a slow spell of the machine takes the largest call to
    5x its time (as a 4 MB reduce-scatter's pass once read 49 ms against 11-13): the line is the
    one through the other passes, where a line through each size's overall mean would be off."""
    chunks = calibrate.CURVE_CHUNK_BYTES
    latency, bw = 1e-3, 5e8
    steady = {("reduce_scatter", c): latency + c / bw for c in chunks}  # two ranks: a chunk sent
    means = {key: [t, t * (5 if key[1] == chunks[-1] else 1), t] for key, t in steady.items()}
    line = calibrate.collective_lines(means, world=2)["reduce_scatter"]
    assert line["latency_s"] == pytest.approx(latency) and line["bus_bw"] == pytest.approx(bw)
    # an all-reduce sends 2(n-1)/n of its tensor: at 4 ranks 1.5 chunks
    means = {("all_reduce", c): [latency + 1.5 * c / bw] for c in chunks}
    line = calibrate.collective_lines(means, world=4)["all_reduce"]
    assert line["latency_s"] == pytest.approx(latency) and line["bus_bw"] == pytest.approx(bw)


def test_measure_gloo_needs_two_processes():
    with pytest.raises(ValueError):
        calibrate.measure_gloo(1)


# ---- calibrate --from-runs: runs of this machine recorded by bench/planner_runs.py -----------

from pathlib import Path  # noqa: E402

RUNS = Path(__file__).resolve().parents[1] / "bench" / "results" / "planner_runs"


def recorded_profile() -> dict:
    return json.loads((RUNS / "local.json").read_text())


def one_model_runs() -> list:
    """The recording's runs of the benchmarks' model: all but the demo, whose vocabulary is 4,608."""
    return [r for r in fit.read_runs([str(RUNS / "manifest.json")], one_model=False) if r.name != "demo"]


def test_recorded_runs_replay_without_training():
    runs = fit.read_runs([str(RUNS / "manifest.json")], one_model=False)
    assert len(runs) >= 6 and {"demo", "ddp", "tp", "pp", "zero3", "dp-pp"} <= {r.name for r in runs}
    assert all(r.measured_s > 0 and r.cfg.model.vocab_size == (4608 if r.name == "demo" else 4096) for r in runs)
    fit.check_one_model(one_model_runs())


def test_fitting_lowers_the_error_and_cross_validates():
    """The fitted fractions predict the runs better than the plain profile (in the fit's own
    measure, the mean squared log-ratio), and every run is also predicted by a fit on the others."""
    runs = one_model_runs()
    profile = recorded_profile()
    report = fit.cross_validate(runs, profile)  # 7 runs: one fit on all, 7 left-out fits
    plain = {k: 1.0 for k in fit.FRACTIONS}
    assert fit.loss(runs, profile, report["fractions"]) < fit.loss(runs, profile, plain)
    assert all(0.02 <= v <= fit.MAX_FRACTION for v in report["fractions"].values())
    assert [row["run"] for row in report["runs"]] == [r.name for r in runs]
    for row in report["runs"]:
        assert row["left_out_s"] > 0 and row["fitted_s"] > 0
        assert row["fitted_error"] == pytest.approx(row["fitted_s"] / row["measured_s"] - 1)
    print(json.dumps(report["mean_abs_error"]))
    # "plain" is the profile as measured, not an earlier fit's fractions saved in it
    again = fit.cross_validate(runs[:2], {**profile, **report["fractions"]})
    assert [row["plain_s"] for row in again["runs"]] == [fit.predict(r, profile, plain) for r in runs[:2]]
    # on these 7 runs the products and the memory-bound work trade off, and two fractions end at
    # the range's ends: said, not hidden
    assert report["at_limit"] == fit.at_limit(report["fractions"]) and report["at_limit"]
    assert fit.at_limit({"matmul_efficiency": 1.5, "hbm_efficiency": 0.5, "link_efficiency": 0.0201}) == [
        "matmul_efficiency", "link_efficiency"]


def test_from_runs_command_writes_the_profile(tmp_path, capsys):
    out = tmp_path / "local.json"
    out.write_text(json.dumps(recorded_profile()))
    recorded = json.loads((RUNS / "manifest.json").read_text())
    three = {name: dict(recorded[name], config=str(RUNS / recorded[name]["config"]),
                        metrics=str(RUNS / recorded[name]["metrics"])) for name in ("ddp", "tp", "zero3")}
    (tmp_path / "three.json").write_text(json.dumps(three))
    code = cli.main(["calibrate", "--from-runs", str(tmp_path / "three.json"), "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and set(printed["fractions"]) == {"matmul_efficiency", "hbm_efficiency", "link_efficiency"}
    saved = calibrate.load_profile(out)
    assert saved["matmul_efficiency"] == printed["fractions"]["matmul_efficiency"]
    assert saved["fitted_from"] == ["ddp", "tp", "zero3"]
    # The fitted profile is what `--gpu local` now uses.
    from threefold.plan.hardware import local_gpu

    assert local_gpu(profile=saved).matmul_efficiency == saved["matmul_efficiency"]


@pytest.mark.parametrize("runs,message", [
    (lambda tmp: [f"{RUNS / 'manifest.json'}:ddp,tp,demo"], "run 'demo' trains another model than 'ddp'"),
    (lambda tmp: [str(RUNS / "manifest.json")], "(from a manifest: MANIFEST.json:NAME,NAME,…)"),
    (lambda tmp: [f"{RUNS / 'manifest.json'}:ddp,dp_pp"], "has no run 'dp_pp'; its runs: demo, ddp, tp"),
    # a config that is not its metrics file's run, refused as compare refuses it
    (lambda tmp: [str(RUNS / "manifest.json"), str(tmp / "other.json")],
     "run 'big': --config: " + str(RUNS / "ddp.jsonl") + " was written by another model or layout"),
    (lambda tmp: [f"{RUNS / 'ddp.toml'}:{RUNS / 'tp.jsonl'}", f"{RUNS / 'tp.toml'}:{RUNS / 'ddp.jsonl'}"],
     "was written by another model or layout"),
    (lambda tmp: [f"{RUNS / 'ddp.toml'}:{tmp / 'missing.jsonl'}"], "no metrics file"),
    (lambda tmp: ["nonsense"], "neither CONFIG.toml:METRICS.jsonl nor a manifest"),
    (lambda tmp: [f"{RUNS / 'ddp.toml'}:{RUNS / 'ddp.jsonl'}"], "needs at least two runs"),
])
def test_from_runs_refuses_bad_runs_in_one_line(tmp_path, capsys, runs, message):
    other = {"big": {"config": str(RUNS / "ddp.toml"), "metrics": str(RUNS / "ddp.jsonl"),
                     "set": ["model.vocab_size=4096", "model.hidden=512"]}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    out = tmp_path / "local.json"
    out.write_text(json.dumps(recorded_profile()))
    code = cli.main(["calibrate", "--from-runs", *runs(tmp_path), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_compare_refuses_a_config_of_another_pipeline(tmp_path, capsys, monkeypatch):
    """pp-1f1b's metrics (a pipeline of 2, its timeline says) with its config file as it is on
    disk (pp 4; the manifest's --set makes it 2): one line naming both pipelines, where compare
    had failed on parallel.stage_layers, a key the user never set."""
    monkeypatch.setenv("THREEFOLD_HOME", str(RUNS))
    code = cli.main(["compare", "--config", str(RUNS / "pp-1f1b.toml"), "--metrics-file", str(RUNS / "pp-1f1b.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "was written by another layout: its pipeline had pp=2 with 1 chunk a rank, this config pp=4" in err


def test_targets_of_another_vocabulary_are_read_apart_from_the_fit(tmp_path):
    """bench/planner_runs.py predicts the demo (4,608 tokens) from a fit on runs of 4,096: it reads
    every run without the one-model rule and checks the rule on the runs it fits."""
    two = f"{RUNS / 'manifest.json'}:ddp,demo"
    runs = fit.read_runs([two], one_model=False)
    assert [r.cfg.model.vocab_size for r in runs] == [4096, 4608]
    with pytest.raises(ConfigError, match="trains another model"):
        fit.check_one_model(runs)
    with pytest.raises(ConfigError, match="trains another model"):
        fit.read_runs([two])


# ---- what the planner makes of the measurements ---------------------------------------------
def measured_profile(**extra) -> dict:
    collectives = {"all_reduce": {"latency_s": 1e-4, "bus_bw": 2e9}, "all_gather": {"latency_s": 5e-4, "bus_bw": 1e9},
                   "reduce_scatter": {"latency_s": 3e-4, "bus_bw": 0.5e9}}
    return {**example_profile(), "attention_flops_fp32": 2.5e10, "attention_flops_bf16": 5e10,
            "elementwise_bw": 6e9, "concurrent_slowdown": 1.5, "collectives": collectives,
            "oversubscribed_wait_s": {"2": 0.001, "4": 0.004, "8": 0.012}, "block_overhead_s": 0.001,
            "oversubscribed_call_cpu_s": {"2": 0.0004, "4": 0.0005, "8": 0.0006},
            "oversubscribed_compute_slowdown": {"2": 1.0, "4": 1.0, "8": 1.1}, **extra}


def test_a_profile_from_before_the_new_measurements_still_loads_and_plans_as_before(tmp_path):
    path = calibrate.save_profile(example_profile(), tmp_path / "local.json")
    gpu = local_gpu("float32", workers=2, profile=calibrate.load_profile(path))
    assert gpu.attention_efficiency == 1.0 and gpu.elementwise_rate == gpu.hbm_bw and gpu.collectives is None
    assert gpu.peak_flops == 1.0e11  # no slowdown recorded: none applied


def test_the_local_gpu_takes_the_measured_rates():
    gpu = local_gpu("float32", workers=1, profile=measured_profile())
    assert gpu.attention_efficiency == pytest.approx(0.25) and gpu.elementwise_rate == pytest.approx(6e9)
    assert gpu.collectives["reduce_scatter"] == (3e-4, 0.5e9)
    # Both cores busy: every rate over the measured slowdown; eight workers on two cores also share them.
    two, eight = (local_gpu("float32", workers=w, profile=measured_profile()) for w in (2, 8))
    assert two.peak_flops == pytest.approx(1e11 / 1.5) and two.elementwise_rate == pytest.approx(6e9 / 1.5)
    assert eight.peak_flops == pytest.approx(1e11 / 1.5 / 4 / 1.1)  # and the slowdown measured at 4 a core
    assert gpu.overlap_slowdown == 1.0 and CATALOG["a100-80gb"].overlap_slowdown == 0.5


def test_collectives_are_timed_by_their_own_measured_line_inside_a_node():
    gpu = local_gpu("float32", workers=2, profile=measured_profile())
    seconds = costs._collective_time(gpu, ("all_gather", "reduce_scatter"), 3e6, 10, 1, 1e9, 1e-5, True)
    assert seconds == pytest.approx(10 * (5e-4 + 3e-4) / 2 + 3e6 * (1 / 1e9 + 1 / 0.5e9) / 2)
    ring = costs._ring_time(3e6, 10 * 1, 1e9, 1e-5)
    assert costs._collective_time(gpu, ("all_gather",), 3e6, 10, 1, 1e9, 1e-5, False) == pytest.approx(ring)
    assert costs._collective_time(CATALOG["h100-sxm"], ("all_gather",), 3e6, 10, 1, 1e9, 1e-5, True) == ring


def test_the_memory_bound_rate_and_fixed_cost_are_what_the_reference_model_leaves_after_its_products():
    """memory_bound_rates inverts the planner: reference times built from a known rate and a known
    fixed cost per block give both back."""
    from threefold.config import ModelConfig
    from threefold.plan.hardware import GPU

    true_bw, overhead, matmul, attention, copy = 4e9, 0.003, 1e11, 2.5e10, 1e10
    gpu = GPU("r", matmul, 0, copy, 1.0, 1.0, 0.0, 0.0, 1, matmul_efficiency=1.0, hbm_efficiency=1.0,
              intra_link_efficiency=1.0, inter_link_efficiency=1.0, attention_efficiency=attention / matmul,
              elementwise_bw=true_bw, block_overhead_s=overhead)
    measured = {}
    for micro_batch in (1, 4):
        est = costs.estimate(costs.Workload(ModelConfig(**calibrate.REFERENCE_MODEL), micro_batch, precision="fp32"),
                             costs.Layout.named(micro_batch=micro_batch), gpu)
        measured[micro_batch] = float(est["compute_s"] + est["memory_bound_s"])
    assert calibrate.memory_bound_rates(measured, matmul, attention, copy) == pytest.approx((true_bw, overhead))
    # the fixed cost measured apart (dispatch_seconds_per_block): only the rate is fitted, through it
    assert calibrate.memory_bound_rates(measured, matmul, attention, copy, fixed_per_block=overhead) == pytest.approx(
        (true_bw, overhead))
    assert calibrate.memory_bound_rates(measured, matmul, attention, copy, fixed_per_block=2 * overhead)[0] > 1.02 * true_bw
    too_busy = {b: 0.0 for b in measured}  # products longer than the whole: the copy's bandwidth, no fixed cost
    assert calibrate.memory_bound_rates(too_busy, matmul, attention, copy) == (copy, 0.0)
    # calibrate fits on the narrow model, where the memory-bound work is a third of the step, not a twentieth
    narrow = ModelConfig(**dict(calibrate.REFERENCE_MODEL, **calibrate.MEMORY_BOUND_MODEL))
    shares = []
    for cfg, micro_batches in ((ModelConfig(**calibrate.REFERENCE_MODEL), (1, 2, 4)),
                               (narrow, calibrate.MEMORY_BOUND_MICRO_BATCHES)):
        times = {mb: costs.estimate(costs.Workload(cfg, mb, precision="fp32"), costs.Layout.named(micro_batch=mb), gpu)
                 for mb in micro_batches}
        measured = {mb: float(e["compute_s"] + e["memory_bound_s"]) for mb, e in times.items()}
        model = calibrate.MEMORY_BOUND_MODEL if cfg is narrow else calibrate.REFERENCE_MODEL
        assert calibrate.memory_bound_rates(measured, matmul, attention, copy, overhead, model) == pytest.approx(
            (true_bw, overhead))
        big = times[max(micro_batches)]
        shares.append(float(big["memory_bound_s"] / (big["compute_s"] + big["memory_bound_s"])))
    assert shares[1] > 2 * shares[0]


def test_more_workers_than_cores_wait_on_every_call_and_run_the_bubble_faster():
    gpu = local_gpu("float32", workers=8, profile=measured_profile())
    # calibrate's waits less the one-float all-reduce's own time (latency_s, 0.2 ms), which the
    # collective's price already holds
    assert [w for w, _ in gpu.collective_waits] == [1, 2, 4, 8]
    assert [t for _, t in gpu.collective_waits] == pytest.approx([0.0, 0.0008, 0.0038, 0.0118])
    assert costs.call_wait(gpu, np.array([1, 2, 3, 4, 6, 8, 16])) == pytest.approx(
        [0, 0.0008, 0.0023, 0.0038, 0.0078, 0.0118, 0.0278])
    # without the lines a pair's all-reduce is the ring's 2 steps at latency_s / 2: the same own time off
    no_lines = {k: v for k, v in measured_profile().items() if k != "collectives"}
    ring_pair = local_gpu("float32", workers=2, profile=no_lines)
    assert 2 * ring_pair.intra_node_latency_s == pytest.approx(no_lines["latency_s"])
    assert [t for _, t in local_gpu("float32", workers=8, profile=no_lines).collective_waits] == pytest.approx(
        [0.0, 0.0008, 0.0038, 0.0118])
    assert costs.call_wait(CATALOG["h100-sxm"], 8) == 0.0
    assert (local_gpu("float32", workers=2, profile=measured_profile()).bubble_speedup, gpu.bubble_speedup) == (1.0, 2.0)
    # Each tp collective of a run pays the wait once per call.
    calls = 10
    waited = costs._collective_time(gpu, ("all_gather",), 1e6, calls, 1, 1e9, 1e-5, True, wait=0.012)
    assert waited - costs._collective_time(gpu, ("all_gather",), 1e6, calls, 1, 1e9, 1e-5, True) == pytest.approx(
        calls * 0.012)


def test_without_skew_the_calls_wait_only_for_members_off_their_core():
    """At one worker a core (calibrate's first point, 2 workers on 2 cores) a call's wait, less
    its own time, is the ranks' skew: the least-waiting rank does not see it, so without_skew
    takes that point's wait off every point (never below 0); the catalog's GPUs have none to
    take off."""
    gpu = local_gpu("float32", workers=8, profile=measured_profile())
    assert gpu.on_core_wait_s == pytest.approx(0.0008)
    least = gpu.without_skew()
    assert [w for w, _ in least.collective_waits] == [1, 2, 4, 8]
    assert [t for _, t in least.collective_waits] == pytest.approx([0.0, 0.0, 0.003, 0.011])
    assert least.on_core_wait_s == 0.0 and least.without_skew() == least
    assert CATALOG["h100-sxm"].without_skew() == CATALOG["h100-sxm"]
    # a ZeRO-3 pair on 2 cores: its exposed gathers lose the on-core wait, call by call
    from threefold.config import ModelConfig

    work = costs.Workload(ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256), 16,
                          precision="fp32")
    pair = local_gpu("float32", workers=2, profile=measured_profile())
    layout = costs.Layout.named(dp=2, zero=3, micro_batch=2)
    full, skewless = (costs.estimate(work, layout, g) for g in (pair, pair.without_skew()))
    assert 0 < skewless["dp_exposed_s"] < full["dp_exposed_s"]


def test_a_blocks_fixed_cost_is_paid_per_block_and_micro_batch():
    from threefold.config import ModelConfig

    cfg = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    plain = local_gpu("float32", workers=1, profile=measured_profile())
    costly = dataclasses.replace(plain, block_overhead_s=0.002)
    work, layout = costs.Workload(cfg, 16, precision="fp32"), costs.Layout.named(micro_batch=4)
    added = costs.estimate(work, layout, costly)["step_time_s"] - costs.estimate(work, layout, plain)["step_time_s"]
    assert plain.block_overhead_s == 0.001  # the profile's, one worker: its own core
    assert added == pytest.approx(4 * 4 * (0.002 - 0.001))  # 4 micro-batches × 4 blocks


def test_with_more_workers_than_cores_a_step_takes_the_larger_of_the_cpu_work_and_one_ranks_path():
    """Brent's bounds: the cores' work (every rank's compute at its share) or one rank's path (its
    compute at a whole core and its waits); with a core each, the plain sum of the terms."""
    from threefold.config import ModelConfig

    cfg = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    work = costs.Workload(cfg, 16, precision="fp32")
    layout = costs.Layout.named(tp=2, pp=2, dp=2, micro_batch=2, sequence_parallel=True)
    eight = local_gpu("float32", workers=8, profile=measured_profile())
    assert eight.core_share == 0.25
    est = costs.estimate(work, layout, eight)
    terms = sum(est[k] for k in ("compute_s", "memory_bound_s", "tp_exposed_s", "cp_exposed_s", "ep_exposed_s",
                                  "pp_exposed_s", "bubble_s", "dp_exposed_s", "optimizer_s", "contention_s"))
    busy = (est["compute_s"] + est["memory_bound_s"] + est["optimizer_s"] + est["contention_s"]
            + est["collective_cpu_s"] / 0.25)  # the collectives' CPU, at a whole core, at its share
    assert est["collective_cpu_s"] > 0
    assert est["step_time_s"] == pytest.approx(max(busy, busy * 0.25 + terms - busy))
    assert est["step_time_s"] < terms  # the waits hand their cores to the computing ranks


def test_an_unequal_split_on_shared_cores_costs_the_ranks_mean_work_not_the_heaviest_ranks():
    """dp2·pp2 on 2 cores: the heavy stage's ranks take the cores their light partners leave
    while they wait, so the machine's bound is the ranks' mean work at a fair share: the whole
    model's compute (the pp = 1 run's, same micro-batches) over the 2 stages, whatever the split.
    The recorded dp2·pp2 run (split 3-1) came out 0.952 s on the heaviest rank's work and 0.806 s
    on the mean's, against 0.851 s measured."""
    from threefold.config import ModelConfig

    cfg = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    work = costs.Workload(cfg, 16, precision="fp32")
    four = local_gpu("float32", workers=4, profile=measured_profile())
    whole = costs.estimate(work, costs.Layout.named(dp=2, micro_batch=2), four)
    for split in ((3, 1), (2, 2), (1, 3)):
        est = costs.estimate(work, costs.Layout.named(pp=2, dp=2, micro_batch=2), four, stage_split=split)
        overhead = est["optimizer_s"] + est["contention_s"] + est["collective_cpu_s"] / four.core_share
        heaviest = est["compute_s"] + est["memory_bound_s"]  # the busiest rank's, as the breakdown reports it
        mean = (whole["compute_s"] + whole["memory_bound_s"]) / 2
        assert mean < heaviest
        assert est["step_time_s"] == pytest.approx(mean + overhead)  # the machine's bound holds here
        assert est["step_time_s"] < heaviest + overhead


def test_a_collectives_cpu_is_its_calls_at_the_measured_cost_and_its_bytes_at_gloos_rate():
    """Per rank and step: each call's CPU (calibrate's point at the workers computing) and each
    byte sent at the mean of the kinds' measured rates. DDP on 4 workers: one all-reduce (one
    bucket); a pp=2 stage: a send or a receive per micro-batch each way, 2·m."""
    from threefold.config import ModelConfig

    cfg = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    gpu = local_gpu("float32", workers=4, profile=measured_profile())
    per_byte = (1 / 2e9 + 1 / 1e9 + 1 / 0.5e9) / 3
    ddp = costs.estimate(costs.Workload(cfg, 16, precision="fp32"), costs.Layout.named(dp=4, micro_batch=4), gpu)
    assert ddp["collective_calls"] == 1
    assert ddp["collective_cpu_s"] == pytest.approx(0.0005 + ddp["dp_bytes"] * per_byte)
    pp = costs.estimate(costs.Workload(cfg, 16, precision="fp32"), costs.Layout.named(pp=2, dp=2, micro_batch=2), gpu)
    runnable = 4 * (1 - pp["bubble_fraction"])  # the pipeline's waiting ranks do not compete
    cpu_per_call = np.interp(runnable, [2, 4], [0.0004, 0.0005])
    assert pp["collective_calls"] == 2 * 4 + 1  # 4 micro-batches, and the dp all-reduce
    assert pp["collective_cpu_s"] == pytest.approx(9 * cpu_per_call + (pp["pp_bytes"] + pp["dp_bytes"]) * per_byte)
    # a profile from before calibrate measured it: each call at least its idle latency
    old = local_gpu("float32", workers=4, profile=measured_profile(oversubscribed_call_cpu_s={}))
    ddp_old = costs.estimate(costs.Workload(cfg, 16, precision="fp32"), costs.Layout.named(dp=4, micro_batch=4), old)
    assert ddp_old["collective_cpu_s"] == pytest.approx((1e-4 + 5e-4 + 3e-4) / 3 + ddp["dp_bytes"] * per_byte)


def test_beyond_one_worker_a_core_compute_slows_by_the_measured_factor():
    base = local_gpu("float32", workers=2, profile=measured_profile())
    eight = local_gpu("float32", workers=8, profile=measured_profile())
    six = local_gpu("float32", workers=6, profile=measured_profile())
    assert eight.peak_flops == pytest.approx(base.peak_flops * (2 / 8) / 1.1)
    assert six.peak_flops == pytest.approx(base.peak_flops * (2 / 6) / 1.05)  # between the points


def test_a_groups_wait_is_the_last_of_its_members_to_reach_a_core():
    """calibrate times calls over every worker; a tp pair among 8 waits for one partner, H(2)/H(8)."""
    harmonic = {2: 1.5, 8: sum(1 / k for k in range(1, 9))}
    assert costs.group_wait(0.012, 2, 8) == pytest.approx(0.012 * harmonic[2] / harmonic[8], rel=0.01)
    assert costs.group_wait(0.012, 8, 8) == pytest.approx(0.012)
    assert costs.group_wait(0.012, 16, 8) == pytest.approx(0.012)  # no more members than workers run


def test_where_calibrate_timed_pairs_a_pair_waits_that_and_larger_groups_in_between():
    """calibrate times the same calls in pairs (pairs among 8 workers: 0.40 of the whole machine's
    wait, where independent delays say H(2)/H(8) = 0.55): a pair waits the measured figure, the
    whole machine its own, a group of 4 in proportion to H between; the least-waiting rank's
    figure loses the on-core skew from both; a profile without pair points prices as before."""
    profile = measured_profile(oversubscribed_pair_wait_s={"2": 0.001, "4": 0.0026, "8": 0.0052})
    gpu = local_gpu("float32", workers=8, profile=profile)
    assert [t for _, t in gpu.collective_pair_waits] == pytest.approx([0.0, 0.0008, 0.0024, 0.005])
    pair, whole = costs.call_pair_wait(gpu, 8), costs.call_wait(gpu, 8)
    assert (pair, whole) == pytest.approx((0.005, 0.0118))
    assert costs.group_wait(whole, 2, 8, pair) == pytest.approx(0.005)
    assert costs.group_wait(whole, 8, 8, pair) == pytest.approx(0.0118)
    h = {n: sum(1 / k for k in range(1, n + 1)) for n in (2, 4, 8)}
    assert costs.group_wait(whole, 4, 8, pair) == pytest.approx(
        0.005 + (0.0118 - 0.005) * (h[4] - h[2]) / (h[8] - h[2]), rel=0.01)
    assert costs.group_wait(0.0008, 2, 2, costs.call_pair_wait(gpu, 2)) == pytest.approx(0.0008)  # 2 workers: one pair
    least = gpu.without_skew()
    assert [t for _, t in least.collective_pair_waits] == pytest.approx([0.0, 0.0, 0.0016, 0.0042])
    assert costs.call_pair_wait(local_gpu("float32", workers=8, profile=measured_profile()), 8) is None
    # the demo's layout on 8 workers: its tp pairs wait less than H(2)/H(8) of the whole said
    cfg = ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    layout = costs.Layout.named(dp=2, tp=2, pp=2, sequence_parallel=True, micro_batch=2, zero=1)
    estimate = {name: costs.estimate(costs.Workload(cfg, 16, precision="fp32"), layout,
                                     local_gpu("float32", workers=8, profile=p))
                for name, p in (("pairs", profile), ("model", measured_profile()))}
    assert estimate["pairs"]["tp_exposed_s"] < estimate["model"]["tp_exposed_s"]


def test_other_processes_counts_a_busy_neighbour():
    """A process spinning beside the block (not yet reaped, so not this process's) counts as
    about one busy core; this process's own sleeping counts for nothing."""
    import subprocess
    import sys
    import time

    with calibrate.OtherProcesses() as others:
        spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"])
        time.sleep(1.2)
    spinner.wait()
    assert others.cores is not None and 0.5 < others.cores < calibrate.cpu_cores() + 0.5


@pytest.mark.parametrize("cores, busy, said", [(2, 1.9, "1.9 of the 2 cores busy"),
                                               (1, 0.9, "0.9 of the 1 core busy")])  # was "1 cores"
def test_a_profile_measured_beside_busy_processes_is_flagged(tmp_path, monkeypatch, capsys, cores, busy, said):
    class Busy:
        def __enter__(self):
            self.cores = None
            return self

        def __exit__(self, *exc):
            self.cores = busy

    profile = {k: v for k, v in recorded_profile().items() if k not in calibrate.FITTED_KEYS}
    monkeypatch.setattr(calibrate, "measure_profile", lambda settings, on_step: dict(profile, gpus_per_node=cores))
    monkeypatch.setattr(calibrate, "OtherProcesses", Busy)
    out = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"warning: other processes kept {said}" in err
    assert calibrate.load_profile(out)["other_processes_cores"] == busy


@pytest.mark.parametrize("at_end, warned", [(0.85, True), (1.15, True), (0.95, False), (None, False)])
def test_a_profile_whose_speed_drifted_is_flagged(tmp_path, monkeypatch, capsys, at_end, warned):
    """calibrate measures the fp32 matmul rate again at its end: a VM whose speed moved by more
    than 10% meanwhile gave every rate of the profile at some other speed."""
    profile = {k: v for k, v in recorded_profile().items() if k not in calibrate.FITTED_KEYS}
    profile.pop("peak_flops_fp32_at_end", None)
    if at_end is not None:  # a profile written before the second measurement has no such key
        profile["peak_flops_fp32_at_end"] = at_end * profile["peak_flops_fp32"]
    monkeypatch.setattr(calibrate, "measure_profile", lambda settings, on_step: dict(profile))
    assert cli.main(["calibrate", "--quick", "--out", str(tmp_path / "profile.json")]) == 0
    err = capsys.readouterr().err
    assert ("warning: the machine's speed drifted" in err) == warned
    if warned:
        assert f"{at_end - 1:+.0%}" in err


def test_the_first_pipeline_rank_waits_while_the_others_compute():
    """While rank 0 waits for a gradient the pp − 1 ranks after it compute: on shared cores they
    run p/(p − 1) faster, never beyond a core each; at pp 2 this is the bubble's speedup, on a GPU
    1. The estimate's rank-0 wait is the uniform bubble over it, so at pp 4 on 4 workers over 2
    cores it is 3/2 of what the bubble's 2× would give."""
    four = local_gpu("float32", workers=4, profile=measured_profile())
    assert four.core_share <= 0.5
    assert four.first_rank_wait_speedup(2) == pytest.approx(four.bubble_speedup) == pytest.approx(2.0)
    assert four.first_rank_wait_speedup(4) == pytest.approx(4 / 3)
    assert local_gpu("float32", workers=2, profile=measured_profile()).first_rank_wait_speedup(4) == 1.0
    assert CATALOG["h100-sxm"].first_rank_wait_speedup(np.array([2, 8])) == pytest.approx([1.0, 1.0])
    cfg = ModelConfig(layers=8, hidden=256, heads=8, kv_heads=4, vocab_size=4096, seq_len=256)
    est = costs.estimate(costs.Workload(cfg, global_batch=16, precision="fp32"),
                         costs.Layout.named(pp=4, micro_batch=2, schedule="1f1b"), four)
    assert est["rank0_bubble_s"] == pytest.approx(est["bubble_s"] * four.bubble_speedup / (4 / 3))


class _Stop(Exception):
    pass


def test_the_progress_says_1_thread_not_1_threads(monkeypatch):
    """With a worker per core each measures on one thread: the spinner said "1 thread(s)"."""
    steps = []

    def stop(*args):
        raise _Stop

    monkeypatch.setattr(calibrate, "keep_large_blocks_in_the_heap", lambda: None)
    monkeypatch.setattr(calibrate, "measure_matmul_flops", stop)
    with pytest.raises(_Stop):
        calibrate.measure_profile(calibrate.QUICK, steps.append)
    assert steps == ["fp32 matmul, 1 thread"]
