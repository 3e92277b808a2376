"""The planner's commands as a new user runs them (issue 17): every bad input one line and exit 2,
the plan's controls, and what it says when a search shows fewer rows than fit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from threefold.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPT3 = ["--model", "gpt3-175b", "--global-batch", "1536", "--gpu", "a100-80gb"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*args, cwd=None):
    """The installed command in a fresh process, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "threefold.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)
    return done.returncode, done.stdout, done.stderr


def assert_one_line(code, err, message):
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("flag", ["--tp", "--pp", "--cp", "--micro-batch", "--virtual-stages", "--num-gpus", "--dp"])
def test_estimate_zero_sizes_are_refused(capsys, flag):
    code, _, err = run(capsys, "estimate", *GPT3, flag, "0")
    assert_one_line(code, err, f"{flag}: must be a positive integer, got 0")


@pytest.mark.parametrize("command", ["estimate", "plan"])
def test_negative_global_batch_is_refused(capsys, command):
    code, _, err = run(capsys, command, "--model", "gpt3-175b", "--global-batch", "-1", "--gpu", "a100-80gb",
                       "--num-gpus", "1024")
    assert_one_line(code, err, "--global-batch: must be a positive integer")


def test_plan_with_zero_gpus_is_one_clear_line(capsys):
    code, _, err = run(capsys, "plan", *GPT3, "--num-gpus", "0")
    assert_one_line(code, err, "--num-gpus: must be a positive integer, got 0")


def test_schedule_out_must_be_a_picture(tmp_path):
    code, _, err = run_cli("schedule", "--out", "x.txt", cwd=tmp_path)
    assert_one_line(code, err, "--out: x.txt is not a picture")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_huge_schedule_is_refused_fast_with_the_limit():
    code, _, err = run_cli("schedule", "--pp", "1000", "--microbatches", "100000")
    assert_one_line(code, err, "more than the 50,000 this command plays")
    code, _, err = run_cli("schedule", "--pp", "1000000")  # the flags as given, the default's too
    assert_one_line(code, err, "--pp 1000000 × --microbatches 8 × --virtual-stages 1 = 8,000,000")


def test_zb_h1_with_fewer_microbatches_than_ranks_is_the_simulators_bubble(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "gpt3-175b", "--global-batch", "4", "--gpu", "a100-80gb",
                       "--tp", "8", "--pp", "8", "--schedule", "zb-h1", "--json")
    estimate = json.loads(out)["bubble_fraction"]
    code, out, _ = run(capsys, "schedule", "--schedule", "zb-h1", "--pp", "8", "--microbatches", "4", "--json")
    assert json.loads(out)["bubble_fraction"] == pytest.approx(11 / 23)  # the simulator at F = B = W
    # The planner prices ZB-H1 at the model's own shares, where W is under a third of a slot (the
    # attention cores and memory-bound kernels have none): more idle than at F = B = W, less than
    # 1F1B's 7/11, and not the m ≥ p form's 36.8% it once used.
    assert 11 / 23 < estimate < 7 / 11


def test_estimate_dtype_picks_the_peak(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
    profile = {"name": "local", "peak_flops_fp32": 1e11, "peak_flops_bf16": 4e11, "hbm_bytes": 24 * 2**30,
               "hbm_bw": 2e10, "intra_node_bw": 1e9, "inter_node_bw": 1e9, "latency_s": 3e-4, "gpus_per_node": 2,
               "threads": 1, "measured_at": "2026-01-01T00:00:00+00:00", "torch_version": "2.13.0"}
    (tmp_path / "local.json").write_text(json.dumps(profile))
    args = ["estimate", "--model", "tiny", "--vocab", "4096", "--global-batch", "8", "--gpu", "local", "--json"]
    bf16 = json.loads(run(capsys, *args)[1])
    fp32 = json.loads(run(capsys, *args, "--dtype", "float32")[1])
    assert fp32["time_s"]["compute"] > 2 * bf16["time_s"]["compute"]  # a quarter of the peak
    assert fp32["mfu"] != bf16["mfu"]
    code, out, _ = run(capsys, "estimate", "--list-gpus")
    local = next(line for line in out.splitlines() if line.split()[:1] == ["local"])
    assert "0.4" in local and "0.1" in local  # 0.4 TFLOP/s bf16, 0.1 fp32: not "0"


def test_estimate_dtype_float32_on_a_gpu_without_the_figure(capsys):
    code, _, err = run(capsys, "estimate", "--model", "gpt3-175b", "--global-batch", "8", "--gpu", "b200",
                       "--dtype", "float32")
    assert_one_line(code, err, "--dtype: no float32 peak known for b200")


@pytest.mark.parametrize("knob,value,key", [("--tp", "8", "tp"), ("--schedule", "1f1b", "schedule"),
                                            ("--cp", "1", "cp"), ("--recompute", "full", "recompute"),
                                            ("--zero", "3", "zero"), ("--pp", "8", "pp")])
def test_plan_fixes_any_knob_and_searches_the_rest(capsys, knob, value, key):
    code, out, _ = run(capsys, "plan", *GPT3, "--num-gpus", "1024", "--top", "3", "--json", knob, value)
    assert code == 0
    result = json.loads(out)
    assert result["fixed"] == {key: int(value) if value.isdigit() else value}
    layouts = result["layouts"]
    assert layouts and all(str(layout["layout"][key]) == value for layout in layouts)
    free = json.loads(run(capsys, "plan", *GPT3, "--num-gpus", "1024", "--top", "3", "--json")[1])
    assert result["evaluated"] < free["evaluated"]
    assert layouts[0]["step_time_s"] >= free["layouts"][0]["step_time_s"]


def test_plan_says_the_smallest_gpu_count_that_fits(capsys):
    code, _, err = run(capsys, "plan", *GPT3, "--num-gpus", "8")
    assert_one_line(code, err, "no layout of this model fits on 8 × a100-80gb")
    assert "the smallest of 2×, 4×, 8× that fits is 64 GPUs" in err


def test_every_plan_row_gives_a_real_reason(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm",
                       "--num-gpus", "8", "--top", "5", "--json")
    reasons = [layout["why"] for layout in json.loads(out)["layouts"]]
    assert len(reasons) == 5
    assert not any("+0.00 s" in why for why in reasons), reasons
    assert all(("fastest" in why) or ("vs #1" in why) or ("ties #1" in why) for why in reasons)


def test_plan_explains_one_row_shown_of_many_that_fit(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm",
                       "--num-gpus", "7")
    assert code == 0
    assert "use 1 mesh (tp × pp × dp × cp × ep); the table shows the fastest of each" in " ".join(out.split())


def test_plan_names_the_knob_that_would_change_the_ranking(capsys):
    code, out, _ = run(capsys, "plan", *GPT3, "--num-gpus", "1024", "--top", "4")
    text = " ".join(out.split())
    assert "would overtake" in text or "would not change #1" in text


def test_batch_input_format_is_documented():
    text = (ROOT / "docs" / "planner.md").read_text()
    assert "--batch" in text and "keys are the flags' long names with underscores" in text


def test_an_uneven_interleaved_split_is_priced_at_its_busiest_rank(capsys):
    """Llama 3 405B's 126 layers over 16 stages of 4 chunks: the engine needs equal chunks, the
    planner (for runs Megatron splits unevenly) prices the rank with ceil(126/16) = 8 layers, the
    same as a 128-layer model's; more chunks than layers is still one line."""
    base = ["estimate", "--model", "llama3-405b", "--global-batch", "2048", "--gpu", "h100-sxm", "--num-gpus", "16384",
            "--tp", "8", "--pp", "16", "--dp", "128", "--sequence-parallel", "--schedule", "interleaved",
            "--virtual-stages", "4", "--json"]
    code, out, err = run(capsys, *base)
    assert code == 0, err
    uneven = json.loads(out)
    code, out, err = run(capsys, *base, "--layers", "128")
    even = json.loads(out)
    assert uneven["time_s"]["compute"] == pytest.approx(even["time_s"]["compute"])
    assert uneven["parameters"]["total"] < even["parameters"]["total"]
    code, _, err = run(capsys, *base[:-1], "--layers", "60")
    assert_one_line(code, err, "--pp: pp × virtual_stages = 16 × 4 = 64 stages, more than the model's 60 layers")
