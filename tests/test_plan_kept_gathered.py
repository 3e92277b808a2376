"""ZeRO-3 with its units kept gathered through the step (``--no-reshard-after-forward``, batch key
``reshard_after_forward``; the engine's ``parallel.reshard_after_forward = false``, fsdp.py): FSDP2's
``reshard_after_forward=False``, torchtitan's default under a pipeline, and so the engine's and the
planner's where the key is unset. One gather and one reduction a step, the full weights and
gradients while the step runs: priced as ZeRO-1, and its bytes the engine's
(tests/test_equivalence.py holds the engine to ``costs.dp_bytes_per_step``)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from threefold.cli import main
from threefold.configure import load_config
from threefold.plan import costs, search
from threefold.plan.hardware import CATALOG

H100 = CATALOG["h100-sxm"]
LLAMA3_8B = costs.ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128_256, seq_len=8192)
WORK = costs.Workload(LLAMA3_8B, 256)


def estimate(zero, reshard=True, pp=4, dp=16):
    layout = costs.Layout.named(recompute="full", tp=1, pp=pp, dp=dp, zero=zero, micro_batch=1,
                                reshard_after_forward=reshard)
    return costs.estimate(WORK, layout, H100)


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_kept_gathered_is_priced_as_zero1_and_sends_one_gather_and_one_reduction_a_step():
    kept, zero1, resharded = estimate(3, reshard=False), estimate(1), estimate(3)
    for key, value in zero1.items():
        if isinstance(value, float):
            assert kept[key] == pytest.approx(value, rel=1e-12), key
    m = int(kept["microbatches"])
    assert m == 16
    # resharding gathers 16-bit weights twice and reduces fp32 gradients once a micro-batch
    assert resharded["dp_bytes"] / kept["dp_bytes"] == pytest.approx(m * (2 * 2 + 4) / (2 + 4), rel=1e-9)
    # the whole stage's 16-bit weights and fp32 gradients while the step runs, not a unit's
    assert kept["params_bytes"] > 2 * resharded["params_bytes"] and kept["grads_bytes"] > resharded["grads_bytes"]
    assert kept["step_time_s"] < resharded["step_time_s"]


@pytest.mark.parametrize("m", [1, 8])
def test_the_engines_bytes_are_zero1s_at_any_number_of_micro_batches(m):
    kept = costs.dp_bytes_per_step(1e6, 8, 3, m, reshard_after_forward=False)
    assert kept == pytest.approx(costs.dp_bytes_per_step(1e6, 8, 1, m))
    assert costs.dp_bytes_per_step(1e6, 8, 3, m) == pytest.approx(1.5 * m * kept)
    assert costs.dp_bytes_per_step(1e6, 8, 3, m, shard=4, reshard_after_forward=False) == pytest.approx(
        costs.dp_bytes_per_step(1e6, 8, 1, m, shard=4))


def test_estimate_batch_and_plan_take_it_and_the_config_runs_it(capsys, tmp_path):
    args = ["--model", "llama3-8b", "--global-batch", "256", "--gpu", "h100-sxm", "--num-gpus", "64", "--pp", "4"]
    code, out, _ = run(capsys, "estimate", *args, "--zero", "3", "--micro-batch", "1", "--schedule", "1f1b",
                       "--no-reshard-after-forward", "--json")
    one = json.loads(out)
    assert code == 0 and one["layout"]["reshard_after_forward"] is False
    batch = tmp_path / "b.jsonl"
    line = {"model": "llama3-8b", "global_batch": 256, "gpu": "h100-sxm", "num_gpus": 64, "pp": 4, "zero": 3,
            "micro_batch": 1, "schedule": "1f1b"}
    batch.write_text("".join(json.dumps({**line, **flag}) + "\n" for flag in
                             ({"reshard_after_forward": False}, {}, {"reshard_after_forward": True})))
    code, out, _ = run(capsys, "estimate", "--batch", str(batch))
    kept, default, resharded = (json.loads(text) for text in out.splitlines())
    assert code == 0 and kept["step_time_s"] == one["step_time_s"] == default["step_time_s"]
    assert resharded["layout"]["reshard_after_forward"] and not default["layout"]["reshard_after_forward"]
    assert kept["comm"]["dp_bytes"] < resharded["comm"]["dp_bytes"]
    path = tmp_path / "run.toml"
    code, out, err = run(capsys, "plan", *args, "--no-reshard-after-forward", "--top", "3", "--json",
                         "--config-out", str(path))
    assert code == 0, err
    rows = json.loads(out)["layouts"]
    assert all(r["layout"]["zero"] == 3 and not r["layout"]["reshard_after_forward"] and "no-reshard" in r["describe"]
               for r in rows)
    cfg = load_config(path)
    assert (cfg.parallel.zero, cfg.parallel.reshard_after_forward) == (3, False)


def test_the_search_leaves_it_out_unless_asked_as_it_repeats_zero1():
    plain = search.candidate_layouts(WORK, 64, {})
    assert np.asarray(plain.reshard_after_forward).all()
    kept = search.candidate_layouts(WORK, 64, {"reshard_after_forward": False})
    assert len(kept.zero) == int((np.asarray(plain.zero) == 3).sum())
    assert (np.asarray(kept.zero) == 3).all() and not np.asarray(kept.reshard_after_forward).any()


def test_without_zero3_it_is_a_note_and_changes_nothing(capsys):
    from threefold import config

    config.note_once.cache_clear()  # once a process: an earlier test may have printed it
    args = ["estimate", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "8",
            "--zero", "1", "--micro-batch", "1", "--json"]
    code, out, err = run(capsys, *args, "--no-reshard-after-forward")
    assert code == 0 and err.strip() == ("note: --no-reshard-after-forward has no effect without --zero 3 (it keeps "
                                         "ZeRO-3's gathered weights through the step)")
    assert json.loads(out)["step_time_s"] == json.loads(run(capsys, *args)[1])["step_time_s"]


def test_a_run_of_the_engine_is_priced_as_it_runs():
    from threefold.plan.compare import run_layout

    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=256", "parallel.dp=2", "parallel.pp=2", "parallel.zero=3",
                             "parallel.reshard_after_forward=false", "train.global_batch=16", "train.micro_batch=2"])
    _, layout = run_layout(cfg)
    assert layout.reshard_after_forward is False


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_plan_restricted_to_kept_zero3_at_another_stage_is_one_line(capsys, zero):
    code, _, err = run(capsys, "plan", "--model", "llama3-8b", "--global-batch", "256", "--gpu", "h100-sxm",
                       "--num-gpus", "64", "--zero", str(zero), "--no-reshard-after-forward")
    assert code == 2 and err.strip() == (f"error: --no-reshard-after-forward: restricts the search to ZeRO-3 kept "
                                         f"gathered through the step; it needs --zero 3 or no --zero, got {zero}")


def test_unset_it_is_torchtitans_default_kept_under_a_pipeline_resharding_without(capsys):
    """torchtitan sets FSDP2's reshard_after_forward to ``not pp_enabled``; the engine and the
    planner do the same where the key is not given, so a published torchtitan run under a pipeline
    is priced as it ran, and a config's ZeRO-3 trains as estimate priced it."""
    from threefold.plan.compare import run_layout

    assert costs.Layout.named(pp=4, zero=3).reshard_after_forward is False
    assert costs.Layout.named(pp=1, zero=3).reshard_after_forward is True
    assert list(costs.Layout(pp=np.array([1, 2, 4]), zero=3).reshard_after_forward) == [True, False, False]
    tiny = ["model.preset=tiny", "model.vocab_size=256", "parallel.zero=3", "train.global_batch=16", "train.micro_batch=2"]
    for sets, resharding in ((["parallel.dp=2", "parallel.pp=2"], False), (["parallel.dp=2"], True),
                             (["parallel.dp=2", "parallel.pp=2", "parallel.reshard_after_forward=true"], True)):
        cfg = load_config(None, tiny + sets)
        assert cfg.parallel.resharding is resharding and run_layout(cfg)[1].reshard_after_forward is resharding
    args = ["estimate", "--model", "llama3-8b", "--global-batch", "256", "--gpu", "h100-sxm", "--num-gpus", "64",
            "--zero", "3", "--micro-batch", "1", "--schedule", "1f1b", "--json"]
    for pp, same_as in (("4", "--no-reshard-after-forward"), ("1", "--reshard-after-forward")):
        default = json.loads(run(capsys, *args, "--pp", pp)[1])
        assert default["step_time_s"] == json.loads(run(capsys, *args, "--pp", pp, same_as)[1])["step_time_s"]
        assert default["layout"]["reshard_after_forward"] is (pp == "1")
