"""DualPipeV (DeepSeek-V3's DualPipe cut in half): the V placement, its order as data, the local
hand-off at the turn of the V, equivalence with one process, its pp bytes, its bubble's closed
form, and the layouts it refuses.

The closed form is derived here from the order, independently of the simulator: at uniform
costs (per stage F = B = W, B the input gradient alone) every rank computes 2m·(F + B + W) and
idles (pp − 1)·(F + B − W), so the bubble is (pp − 1)/(6m + pp − 1). DeepSeek's table gives
(PP/2 − 1)·(F&B + B − 3W) of idle for PP stages, B the full backward, F&B one forward and one
backward run as a single overlapped unit; this runtime runs them as two actions (see
docs/pipeline_parallel.md).
"""
from __future__ import annotations

import pytest

import equivalence
from equivalence import assert_same_training
from threefold.cli import main
from threefold.config import ConfigError
from threefold.configure import load_config
from threefold.parallel.pipeline.schedule import (SCHEDULE_REGISTRY, Action, Kind, ScheduleError, build_schedule,
                                                  check_schedule, validate)
from threefold.plan import costs
from threefold.plan.simulate import ActionCosts, simulate

UNTIED = "model.tie_embeddings=false"


def layout(pp: int, m: int, *extra: str) -> tuple[str, ...]:
    """TINY with 2·pp equal stages of one block each at pp 4 (two at pp 2), untied embeddings."""
    layers = 4 if pp == 2 else 2 * pp
    return tuple(equivalence.TINY + [f"model.layers={layers}", UNTIED, f"train.global_batch={2 * m}",
                                     *extra])


def run(distributed, pp: int, m: int, *extra: str) -> list[dict]:
    return equivalence.case(distributed, layout(pp, m, "parallel.schedule=dualpipev", f"parallel.pp={pp}", *extra))


# --- the placement and the order ------------------------------------------------------------------
def test_v_places_two_stages_per_rank():
    plan = build_schedule("dualpipev", 4, 8)
    assert plan.virtual_stages == 2 and plan.num_stages == 8
    assert [tuple(plan.stages_of(r)) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [plan.rank_of(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [plan.chunk_of(s) for s in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [plan.hands_over_locally(s) for s in range(8)] == [False] * 4 + [True] + [False] * 3


def test_the_turn_of_the_v_has_no_send_or_receive():
    """Rank pp − 1 runs stages pp − 1 and pp: the activation and its gradient pass in memory."""
    plan = build_schedule("dualpipev", 4, 8)
    last = plan.actions[3]
    p2p = {(a.kind, a.stage) for a in last if a.peer is not None}
    assert p2p == {(Kind.RECV_ACT, 3), (Kind.SEND_GRAD, 3), (Kind.SEND_ACT, 4), (Kind.RECV_GRAD, 4)}
    assert all(a.peer == 2 for a in last if a.peer is not None)
    # ... and the validator refuses one that sends across it
    broken = list(last)
    broken.insert(broken.index(Action(Kind.FORWARD, 0, 3)) + 1, Action(Kind.SEND_ACT, 0, 3, 3))
    with pytest.raises(ScheduleError, match="hands over locally"):
        validate(type(plan)(plan.name, 4, 8, 2, plan.actions[:3] + (tuple(broken),)))


def test_validator_wants_the_local_forward_first():
    plan = build_schedule("dualpipev", 2, 4)
    rank1 = list(plan.actions[1])
    f_up, f_down = rank1.index(Action(Kind.FORWARD, 0, 2)), rank1.index(Action(Kind.FORWARD, 0, 1))
    rank1[f_up], rank1[f_down] = rank1[f_down], rank1[f_up]
    with pytest.raises(ScheduleError, match="comes before its FORWARD of stage 1"):
        validate(type(plan)(plan.name, 2, 4, 2, (plan.actions[0], tuple(rank1))))


def compute(plan, rank: int) -> list[str]:
    return [str(a) for a in plan.actions[rank] if a.kind.is_compute]


def test_deepseeks_phases_on_pp2():
    """DualPipeV.step for 2 ranks, 4 micro-batches: rank 0 warms up 2 forwards down, rank 1 none;
    the steady phase pairs a forward down with a backward up and a forward up with a backward
    down; the drain defers the second half's weight gradients (W) and runs them last."""
    plan = build_schedule("dualpipev", 2, 4)
    assert compute(plan, 0) == [
        "F0@s0", "F1@s0",  # 1. 2(pp − r − 1) forwards down
        "F2@s0", "F0@s3",  # 2. r + 1 pairs down, up
        "B0@s3", "W0@s3", "F1@s3",  # 3. pp − r − 1 backward up, forward up
        "F3@s0", "B1@s3", "W1@s3", "F2@s3", "B0@s0", "W0@s0",  # 4. m − 2pp + r + 1 = 1 steady round
        "B2@s3", "W2@s3", "F3@s3", "B1@s0", "W1@s0",  # 5. pp − r − 1 backward up, forward up, backward down
        "B3@s3", "W3@s3", "B2@s0",  # 6. r + 1 pairs of backwards, the down one's W deferred
        "W2@s0", "B3@s0",  # 7. a deferred W, then a backward down deferring its own
        "W3@s0"]  # 8. what is left
    assert compute(plan, 1) == [
        "F0@s1", "F0@s2", "F1@s1", "F1@s2",  # 2. r + 1 = 2 pairs
        "F2@s1", "B0@s2", "W0@s2", "F2@s2", "B0@s1", "W0@s1",  # 4. m − 2pp + r + 1 = 2 rounds
        "F3@s1", "B1@s2", "W1@s2", "F3@s2", "B1@s1", "W1@s1",
        "B2@s2", "W2@s2", "B2@s1", "W2@s1",  # 6. i = 0 < half = 1: both whole; ...
        "B3@s2", "B3@s1",  # ... from i = half on, both W deferred (rank 1 is odd: from the up one)
        "W3@s2", "W3@s1"]  # 8. in the order their B ran


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("extra", [0, 1, 3, 8])
def test_every_layout_validates_and_its_bubble_is_the_closed_form(pp, extra):
    m = 2 * pp + extra
    plan = build_schedule("dualpipev", pp, m)
    validate(plan)
    sim = simulate(plan, ActionCosts(forward=0.5, backward=1.0, weight_grad=0.5))
    assert sim.bubble_fraction == pytest.approx((pp - 1) / (6 * m + pp - 1), abs=1e-12)
    assert all(busy == pytest.approx(3 * m) for busy in sim.busy)
    assert sim.makespan == pytest.approx(3 * m + (pp - 1) / 2)
    # 2·pp + 1 chunks in flight on every rank (DeepSeek's "PP + 1"), in units of the rank's layers
    assert sim.peak_activations == pytest.approx([pp + 0.5] * pp)
    spec = SCHEDULE_REGISTRY["dualpipev"]
    assert float(spec.bubble(pp, m, 2)) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert costs.bubble_fraction("dualpipev", pp, m) == pytest.approx(sim.bubble_fraction, abs=1e-12)


def test_its_bubble_beats_1f1b_and_zb_h1_on_the_same_model():
    """pp 4, m 8: 1F1B idles 3/11 = 27.3%, ZB-H1 1/9 = 11.1%, DualPipeV 3/51 = 5.9%."""
    assert costs.bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert costs.bubble_fraction("zb-h1", 4, 8) == pytest.approx(3 / 27)
    assert costs.bubble_fraction("dualpipev", 4, 8) == pytest.approx(3 / 51)


# --- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m,v,layers,message", [
    (4, 7, 1, 8, "parallel.microbatches: dualpipev needs at least 2·pp = 8 micro-batches per step"),
    (2, 8, 3, 8, "parallel.virtual_stages: dualpipev always holds two stages per rank"),
    (4, 8, 1, 12, "parallel.pp: dualpipev cuts the model into 2·pp = 8 equal stages; 12 layers do not split so"),
    (1, 8, 1, 8, "parallel.pp: dualpipev needs at least 2 pipeline ranks"),
])
def test_check_schedule_refuses_in_one_line(pp, m, v, layers, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")) as err:
        check_schedule("dualpipev", pp, m, v, layers)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["train.global_batch=14"], "parallel.microbatches: dualpipev needs at least 2·pp = 8"),
    (["train.recompute=full"], "train.recompute: full recomputation with dualpipev is not supported"),
])
def test_layouts_it_refuses(overrides, message):
    with pytest.raises(ConfigError, match="^" + message):
        load_config(None, list(layout(4, 8, "parallel.schedule=dualpipev", "parallel.pp=4", *overrides)))


def test_bad_input_is_one_line_and_exit_code_2(capsys):
    assert main(["schedule", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--microbatches: dualpipev needs at least 2·pp = 8" in err


def test_schedule_command(capsys, tmp_path):
    import json

    out = tmp_path / "dualpipev.png"
    assert main(["schedule", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "8", "--out", str(out),
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["virtual_stages"] == 2 and out.stat().st_size > 0
    assert got["bubble_fraction"] == pytest.approx(3 / 51) and got["peak_activations"] == [4.5] * 4
    assert got["makespan"] == pytest.approx(3 * 8 + 1.5)  # one stage's forward = 1: F = 1/2 per chunk


# --- equivalence, bytes ---------------------------------------------------------------------------
def test_pp_messages_leave_out_the_turn_of_the_v():
    """Rank r's two stages send forward and back, 4m messages, less 2m at each of the model's ends
    (rank 0) and at the turn of the V (rank pp − 1); counted here from the actions."""
    for pp in (2, 3, 4, 8):
        m = 2 * pp + 1
        plan = build_schedule("dualpipev", pp, m)
        for r in range(pp):
            sends = sum(a.kind.is_send for a in plan.actions[r])
            assert sends == costs.pp_messages_per_step(r, pp, m, 2, "dualpipev")
            assert sends == m * (4 - 2 * (r == 0) - 2 * (r == pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 6), (4, 8), (4, 10)])
def test_matches_single_process_and_sends_the_formulas_bytes(distributed, pp, m):
    ranks = run(distributed, pp, m)
    assert_same_training(ranks, equivalence.reference(layout(pp, m)))
    cfg = load_config(None, list(layout(pp, m)))
    for r in ranks:
        want = costs.pp_bytes_per_step(r["pp_rank"], pp, m, 2, cfg.train.micro_batch, cfg.model.seq_len,
                                       cfg.model.hidden, schedule="dualpipev")
        assert want == costs.dualpipev_messages_per_step(r["pp_rank"], pp, m) * 2 * 32 * 64 * 4
        for step in r["comm"]:
            assert step["pp"] == want
        assert r["layers_here"] == cfg.model.layers // pp


def test_with_tensor_parallel(distributed):
    """tp 2 without SP × pp 2: each tp rank sends 1/tp of a message (Megatron's scatter/gather),
    and the local hand-off passes the whole tensor, gathering nothing."""
    ranks = run(distributed, 2, 4, "parallel.tp=2")
    assert_same_training(ranks, equivalence.reference(layout(2, 4)))
    for r in ranks:
        for step in r["comm"]:
            assert step["pp"] == costs.pp_bytes_per_step(r["pp_rank"], 2, 4, 2, 2, 32, 64, 2, schedule="dualpipev")
            assert step["tp.scatter_gather"] == costs.scatter_gather_bytes_per_step(
                r["pp_rank"], 2, 4, 2, 2, 32, 64, 2, schedule="dualpipev")


@pytest.mark.parametrize("zero,tie", [(1, "false"), (2, "true")])
def test_with_data_parallel(distributed, zero, tie):
    """dp 2 × pp 2: each stage's buckets reduced as its last weight gradient (W) comes in. Tied
    embeddings: rank 0 holds both ends, a copy each in a bucket of its own, whose reduced
    gradients (ZeRO-2: this rank's shard of each) it adds."""
    tied = f"model.tie_embeddings={tie}"
    ranks = run(distributed, 2, 4, "parallel.dp=2", f"parallel.zero={zero}", "train.global_batch=16", tied)
    assert_same_training(ranks, equivalence.reference(layout(2, 4, "train.global_batch=16", tied)))



# --- the planner ----------------------------------------------------------------------------------
def test_a_dry_run_step_sends_what_the_planner_predicts():
    """pp 4 on fake tensors: each rank's pp bytes are predict_rank's (the V formula), its
    parameters those of its two stages (rank 0: the embedding and the head)."""
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config, dry_run_rank

    cfg = dry_run_config(load_config(None, list(layout(4, 10, "parallel.schedule=dualpipev", "parallel.pp=4"))), 4)
    for rank in range(4):
        got, want = dry_run_rank(cfg, rank, device="meta"), predict_rank(cfg, rank)
        messages = 10 * (4 - 2 * (rank == 0) - 2 * (rank == 3))  # m = 10, 2 × 32 × 64 fp32 values each
        assert got["comm_bytes"]["pp"] == want["comm_bytes"]["pp"] == messages * 2 * 32 * 64 * 4
        assert got["memory"]["params"] == want["memory"]["params"]


def test_estimate_counts_the_inner_ranks_messages_and_both_ends_on_rank_0():
    from threefold.plan.hardware import CATALOG

    cfg = load_config(None, list(layout(4, 8)))
    work = costs.Workload(cfg.model, global_batch=16)
    est = {name: costs.estimate(work, costs.Layout.named(pp=4, micro_batch=2, schedule=name), CATALOG["a100-80gb"])
           for name in ("1f1b", "dualpipev")}
    message = 2 * 32 * 64 * costs.PARAM_BYTES  # the planner's 16-bit activations
    assert est["1f1b"]["pp_bytes"] == 2 * 8 * message
    assert est["dualpipev"]["pp_bytes"] == 4 * 8 * message == costs.pp_bytes_per_step(
        1, 4, 8, 2, 2, 32, 64, dtype_bytes=costs.PARAM_BYTES, schedule="dualpipev")
    assert est["dualpipev"]["bubble_fraction"] == pytest.approx(3 / 51)
    # rank 0 holds the embedding and the head: more parameters than 1F1B's fuller end stage
    assert est["dualpipev"]["params_bytes"] > est["1f1b"]["params_bytes"]
