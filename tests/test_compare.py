"""``threefold compare`` on real runs: where the planner has an exact formula for rank 0, the
prediction equals the measurement to the byte."""
import json

import pytest

from threefold.configure import load_config
from threefold.plan import compare as cmp
from threefold.plan.dryrun_predict import rank_share
from threefold.plan.calibrate import PROFILE_KEYS, save_profile
from threefold.train.trainer import train
from test_train import TINY, config, corpus  # noqa: F401  (the corpus fixture)


def rows_by_name(rows):
    return {row.quantity: row for row in rows}


def assert_exact(rows, *names):
    for name in names:
        row = rows[name]
        assert row.predicted == row.measured and row.ratio == 1.0, row


def test_single_process_model_states_are_exact(tmp_path, corpus, monkeypatch):  # noqa: F811
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path / "home"))  # no machine profile there
    cfg = config(tmp_path, corpus, "train.steps=3")
    metrics = tmp_path / "m.jsonl"
    train(cfg, str(metrics), progress=False)
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer")
    assert not any(name.startswith("bytes/step") for name in rows)  # one process sends nothing
    # The blocks' activations (tests/test_tensor_parallel.py), the final norm's and the logits'
    # (dryrun_predict.head_activation_bytes) and the token ids' and targets': to the byte, as in
    # the dry run.
    act = rows["memory: activations, peak"]
    assert "+ the final norm and logits" in act.formula and act.measured == act.predicted, act
    step = rows["step time"]
    assert step.predicted is None and "run `threefold calibrate` first (under two minutes)" in step.formula

    # With a profile, the step time is predicted; the bytes do not change.
    save_profile({key: 1.0 for key in PROFILE_KEYS} | dict(name="test", peak_flops_fp32=1e10, peak_flops_bf16=1e10,
                                                          hbm_bytes=2**34, hbm_bw=1e10, intra_node_bw=1e9,
                                                          inter_node_bw=1e9, latency_s=1e-4, gpus_per_node=2))
    with_profile = rows_by_name(cmp.compare_run(cfg, metrics))
    assert with_profile["step time"].predicted > 0
    assert with_profile["memory: params"] == rows["memory: params"]


def train_rank(cfg, metrics):
    train(cfg, metrics, progress=False)


LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1", "parallel.sequence_parallel=true",
          "train.global_batch=8", "train.micro_batch=2", "train.threads=1", "train.steps=3"]


def test_3d_run_bytes_and_model_states_are_exact(tmp_path, corpus, distributed):  # noqa: F811
    """dp 2 × tp 2 × pp 2, ZeRO-1, SP: rank 0 is the first stage, without the head."""
    from threefold.data import prepare_dataset

    cfg = config(tmp_path, corpus, *LAYOUT)
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)  # once, before the ranks read it
    metrics = tmp_path / "m.jsonl"
    distributed.run(8, train_rank, cfg, str(metrics), timeout=240)
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer", "bytes/step: dp", "bytes/step: tp",
                 "bytes/step: pp")
    assert "tp.loss" not in " ".join(rows)  # the first stage computes no loss
    # Exposed communication: measured per ledger key, beside the planner's per axis.
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(set(s["comm_exposed_s"]) == set(s["comm_bytes"]) and min(s["comm_exposed_s"].values()) >= 0
               for s in steps)
    assert {"exposed comm: dp", "exposed comm: tp", "exposed comm: pp"} <= set(rows)
    other = rows["bytes/step: other"]  # measured, not modelled: the tied embedding's gradient among them
    assert other.predicted is None and "pp.tied" in other.formula
    # 1F1B, pp 2: the first stage holds two micro-batches' activations at its peak, predicted to
    # the byte with the engine's token ids and masks (it measured 1.0–1.02 without them).
    act = rows["memory: activations, peak"]
    assert "2 × block_activation_bytes of 2 × 32 tokens, up to 2 (micro-batch, stage) in flight" in act.formula
    assert act.measured == act.predicted, act


@pytest.mark.parametrize("sp", [True, False])
def test_bf16_run_bytes_are_exact(tmp_path, corpus, distributed, sp):  # noqa: F811
    """tp 2 × pp 2 in bf16 (autocast over fp32 weights): tp and pp bytes exact with the engine's
    widths (bf16 products, the fp32 residual stream), model states exact, the blocks'
    activations with their fp32 stream and bf16 weight copies, and the engine's token ids and
    masks, to the byte (1.0–1.02 of the prediction without the ids and masks)."""
    from threefold.data import prepare_dataset

    cfg = config(tmp_path, corpus, "parallel.tp=2", "parallel.pp=2", f"parallel.sequence_parallel={str(sp).lower()}",
                 "train.dtype=bfloat16", "train.global_batch=8", "train.threads=1", "train.steps=2")
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)
    metrics = tmp_path / "m.jsonl"
    distributed.run(4, train_rank, cfg, str(metrics), timeout=240)
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer", "bytes/step: tp", "bytes/step: pp")
    act = rows["memory: activations, peak"]
    assert act.measured == act.predicted, act


def test_command_prints_json(tmp_path, corpus, monkeypatch):  # noqa: F811
    from click.testing import CliRunner

    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path / "home"))
    overrides = TINY + [f"data.corpus={json.dumps(str(corpus))}",
                        f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}", "train.steps=2"]
    metrics = tmp_path / "m.jsonl"
    train(load_config(None, overrides), str(metrics), progress=False)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    args = ["--config", str(empty), *(arg for o in overrides for arg in ("--set", o)), "--metrics-file", str(metrics)]
    result = CliRunner().invoke(cmp.compare, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {row["quantity"] for row in rows} >= {"memory: params", "step time"}
    assert all(set(row) == {"quantity", "predicted", "measured", "ratio", "formula", "unit"} for row in rows)
    table = CliRunner().invoke(cmp.compare, args, terminal_width=200)
    assert table.exit_code == 0 and "exact" in table.output



@pytest.mark.parametrize("tp,pp,v,schedule,tie,vocab", [
    (1, 1, 1, "1f1b", False, 100), (2, 1, 1, "1f1b", True, 101), (4, 1, 1, "1f1b", False, 102),
    (2, 2, 1, "1f1b", True, 99), (1, 2, 2, "interleaved", True, 100), (2, 4, 1, "zb-h1", False, 103),
])
def test_rank_share_counts_what_the_engine_builds(tp, pp, v, schedule, tie, vocab):
    """The torch-free count of rank 0's parameters (dryrun_predict.rank_share) equals the
    engine's: the plain model on the meta device, tp-sharded by the engine's own plan
    (vocabulary padded to a multiple of tp), cut into the engine's stage modules, a tied table
    counted once."""
    import torch

    from threefold.models.llama import Llama
    from threefold.parallel.pipeline.stages import StageModule
    from threefold.parallel.pipeline.schedule import build_schedule, partition
    from threefold.parallel.tensor_parallel import TensorParallelGroup, apply_tp

    cfg = load_config(None, ["model.preset=tiny", "model.layers=8", f"model.vocab_size={vocab}",
                             f"model.tie_embeddings={str(tie).lower()}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                             f"parallel.virtual_stages={v}", f"parallel.schedule={schedule}", "train.global_batch=8", "train.micro_batch=1"])
    with torch.device("meta"):
        model = Llama(cfg.model)
        if tp > 1:
            apply_tp(model, TensorParallelGroup(None, 0, tp, False, vocab))
    if pp == 1:
        held = [model]
    else:
        spans = partition(cfg.model, pp, v)
        held = [StageModule(model, spans[s]) for s in build_schedule(schedule, pp, cfg.microbatches, v).stages_of(0)]
    built = {id(q): q.numel() for module in held for q in module.parameters()}
    assert rank_share(cfg, 0).numel == sum(built.values())


def _compare_cli(capsys, tmp_path, overrides, metrics, *extra):
    from threefold.cli import main

    empty = tmp_path / "run.toml"
    empty.write_text("")
    code = main(["compare", "--config", str(empty), *(a for o in overrides for a in ("--set", o)),
                 "--metrics-file", str(metrics), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_compare_refuses_a_file_that_is_not_a_metrics_file(tmp_path, corpus, capsys):  # noqa: F811
    overrides = TINY + [f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'c'))}"]
    for content in ('{"a": 1}\n', "[model]\nlayers = 2\n", "not json at all\n"):
        wrong = tmp_path / "wrong.jsonl"
        wrong.write_text(content)
        code, _, err = _compare_cli(capsys, tmp_path, overrides, wrong)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "is not a step record of `threefold train --metrics-file`" in err
        assert ("not a JSON object" in err) == (content != '{"a": 1}\n')  # a half-written line says so


def test_compare_refuses_another_runs_metrics(tmp_path, corpus, capsys, monkeypatch):  # noqa: F811
    """The demo-like single-process run's metrics with a dp=2 config, or another model: refused,
    not meaningless ratios."""
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path / "home"))
    overrides = TINY + [f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'c'))}",
                        "train.steps=2"]
    metrics = tmp_path / "m.jsonl"
    train(load_config(None, overrides), str(metrics), progress=False)
    assert _compare_cli(capsys, tmp_path, overrides, metrics)[0] == 0
    for extra, message in ((["parallel.dp=2"], "its run sent nothing on the dp axis, this config has dp=2"),
                           (["model.hidden=128"], "was written by another model or layout"),
                           (["train.global_batch=8"], "was written by a run of another batch: its steps trained ")):
        code, _, err = _compare_cli(capsys, tmp_path, overrides + extra, metrics)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_run_whose_speed_moved_is_told_apart():
    """Ten-step stretches: one 30% slower than the fastest is reported with its step numbers;
    ±5% of noise is not; nor is a run shorter than two stretches."""
    from threefold.plan.compare import step_time_drift

    def steps(times):
        return [{"step": i + 2, "step_time_s": t} for i, t in enumerate(times)]
    drift = step_time_drift(steps([1.0] * 10 + [1.3] * 10 + [1.05] * 10))
    assert drift == {"fast_s": pytest.approx(1.0), "fast_steps": (2, 11), "slow_s": pytest.approx(1.3),
                     "slow_steps": (12, 21)}
    assert step_time_drift(steps([1.0, 1.05, 0.95] * 10)) is None
    assert step_time_drift(steps([1.0] * 10 + [2.0] * 9)) is None  # one whole stretch only


def test_a_hybrid_sharded_run_is_compared_with_its_shard_groups(tmp_path, corpus, distributed):  # noqa: F811
    """dp 4 in pairs (ZeRO-3, dp_shard 2): the model states are those of a pair, and the dp bytes
    add the all-reduce between the pairs, exactly as the ledger counts them."""
    from threefold.data import prepare_dataset

    cfg = config(tmp_path, corpus, "parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2", "train.global_batch=8",
                 "train.threads=1", "train.steps=2")
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)
    metrics = tmp_path / "m.jsonl"
    distributed.run(4, train_rank, cfg, str(metrics), timeout=240)
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer", "bytes/step: dp")
    assert "ZeRO-3 over dp_shard=2 of dp=4" in rows["memory: optimizer"].formula


def test_a_context_parallel_run_is_compared_on_its_share_of_the_sequence(tmp_path, corpus, distributed):  # noqa: F811
    """dp 2 × cp 2, ring attention, ZeRO-1: states over dp × cp, the gradients' bytes under
    "dp+cp" and the ring's under "cp", each exact; the activations are those of seq_len / cp
    tokens (priced at whole sequences before compare read predict_rank, the measured was 0.71 of
    the prediction, 0.97 with the grouped-query repeats the ring does not save, and 1.003 without
    the token ids and the rotary tables gathered at its positions), to the byte."""
    from threefold.data import prepare_dataset

    cfg = config(tmp_path, corpus, "parallel.dp=2", "parallel.cp=2", "parallel.zero=1", "train.global_batch=4",
                 "train.micro_batch=1", "train.threads=1", "train.steps=2")
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)
    metrics = tmp_path / "m.jsonl"
    distributed.run(4, train_rank, cfg, str(metrics), timeout=240)
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer", "bytes/step: dp+cp", "bytes/step: cp")
    assert "ring" in rows["bytes/step: cp"].formula and "× cp=2" in rows["memory: optimizer"].formula
    act = rows["memory: activations, peak"]
    assert "1 × 16 tokens (seq_len / cp, ring's own saves)" in act.formula
    assert act.measured == act.predicted, act


def test_an_asynchronous_pipeline_run_is_compared(tmp_path, corpus, distributed):  # noqa: F811
    """pp 2 under 2bw: a step also forwards the next step's first micro-batches (numbered on
    from m), so its timeline is not one flushed step's; compare refused the run's own metrics
    ("micro-batch 4 … not in 0..3"). Its states, the weight versions and the pp bytes are exact,
    and the activations too, with the first stage holding the next step's inputs as well."""
    from threefold.data import prepare_dataset

    cfg = config(tmp_path, corpus, "parallel.pp=2", "parallel.schedule=2bw", "train.global_batch=8",
                 "train.micro_batch=2", "train.threads=1", "train.steps=4")  # the median: two steady steps of three
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)
    metrics = tmp_path / "m.jsonl"
    distributed.run(2, train_rank, cfg, str(metrics), timeout=240)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert max(event[3] for event in steps[0]["timeline"]["ranks"][0]) >= cfg.microbatches  # the next step's
    rows = rows_by_name(cmp.compare_run(cfg, metrics))
    assert_exact(rows, "memory: params", "memory: grads", "memory: optimizer", "memory: weight_versions",
                 "bytes/step: pp", "memory: activations, peak")
