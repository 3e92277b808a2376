"""`threefold calibrate`: the measurements, the profile file and the command."""
import json

import pytest
import torch

from threefold import cli
from threefold.config import ConfigError
from threefold.plan import calibrate

# Sizes small enough for a test; the whole command then takes ~3 s, mostly spawning two processes.
TINY = calibrate.Settings(matmul_size=256, matmul_seconds=0.05, copy_bytes=8 << 20, copy_seconds=0.05,
                          gloo_bytes=1 << 20, gloo_reps=2, gloo_timeout_s=60.0)


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


def test_memory_bandwidth_is_plausible():
    assert 1e8 < calibrate.measure_memory_bandwidth(size_bytes=8 << 20, seconds=0.05) < 1e13


def test_command_quick_json_measures_and_saves(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(calibrate, "QUICK", TINY)
    out = tmp_path / "profile.json"
    assert cli.main(["calibrate", "--quick", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == calibrate.load_profile(out)
    assert tuple(printed) == calibrate.PROFILE_KEYS
    assert printed["name"] == "local" and printed["gpus_per_node"] == calibrate.cpu_cores()
    assert printed["peak_flops_bf16"] > 0 and printed["peak_flops_fp32"] > 1e8
    assert 1e6 < printed["intra_node_bw"] == printed["inter_node_bw"] < 1e12
    assert 0 < printed["latency_s"] < 0.1
    assert printed["hbm_bytes"] > 1 << 30 and printed["hbm_bw"] > 1e8


def test_measure_gloo_needs_two_processes():
    with pytest.raises(ValueError):
        calibrate.measure_gloo(1)


# ---- calibrate --from-runs: runs of this machine recorded by bench/planner_runs.py -----------

from pathlib import Path  # noqa: E402

RUNS = Path(__file__).resolve().parents[1] / "bench" / "results" / "planner_runs"


def recorded_profile() -> dict:
    return json.loads((RUNS / "local.json").read_text())


def test_recorded_runs_replay_without_training():
    from threefold.plan import fit

    runs = fit.read_runs([str(RUNS / "manifest.json")])
    assert len(runs) >= 6 and {"demo", "ddp", "tp", "pp", "zero3", "dp-pp"} <= {r.name for r in runs}
    assert all(r.measured_s > 0 and r.cfg.model.vocab_size == 4096 for r in runs)


def test_fitting_lowers_the_error_and_cross_validates():
    """The fitted fractions predict the runs better than the plain profile (in the fit's own
    measure, the mean squared log-ratio), and every run is also predicted by a fit on the others."""
    from threefold.plan import fit

    runs = fit.read_runs([str(RUNS / "manifest.json")])
    profile = recorded_profile()
    report = fit.cross_validate(runs, profile)  # 8 runs: one fit on all, 8 left-out fits
    plain = {k: 1.0 for k in fit.FRACTIONS}
    assert fit.loss(runs, profile, report["fractions"]) < fit.loss(runs, profile, plain)
    assert all(0.02 <= v <= 1.0 for v in report["fractions"].values())
    assert [row["run"] for row in report["runs"]] == [r.name for r in runs]
    for row in report["runs"]:
        assert row["left_out_s"] > 0 and row["fitted_s"] > 0
        assert row["fitted_error"] == pytest.approx(row["fitted_s"] / row["measured_s"] - 1)
    print(json.dumps(report["mean_abs_error"]))


def test_from_runs_command_writes_the_profile(tmp_path, capsys):
    out = tmp_path / "local.json"
    out.write_text(json.dumps(recorded_profile()))
    recorded = json.loads((RUNS / "manifest.json").read_text())
    three = {name: dict(recorded[name], config=str(RUNS / recorded[name]["config"]),
                        metrics=str(RUNS / recorded[name]["metrics"])) for name in ("ddp", "tp", "demo")}
    (tmp_path / "three.json").write_text(json.dumps(three))
    code = cli.main(["calibrate", "--from-runs", str(tmp_path / "three.json"), "--out", str(out), "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0 and set(printed["fractions"]) == {"matmul_efficiency", "hbm_efficiency", "link_efficiency"}
    saved = calibrate.load_profile(out)
    assert saved["matmul_efficiency"] == printed["fractions"]["matmul_efficiency"]
    assert saved["fitted_from"] == ["ddp", "tp", "demo"]
    # The fitted profile is what `--gpu local` now uses.
    from threefold.plan.hardware import local_gpu

    assert local_gpu(profile=saved).matmul_efficiency == saved["matmul_efficiency"]


@pytest.mark.parametrize("runs,message", [
    (lambda tmp: [str(RUNS / "manifest.json"), str(tmp / "other.json")], "trains another model"),
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
