"""Pipeline schedules as data, their validator, the simulator, the timeline drawing and the
``threefold schedule`` command. Expected bubbles come from the papers' closed forms, computed
here independently of the simulator:

GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021): (p−1)/(m+p−1) for uniform stage costs,
whatever the backward/forward ratio; interleaved with v chunks per rank (Narayanan et al. 2021):
(p−1)/(v·m+p−1); ZB-H1 with F = B = W (Qi et al. 2023): idle (p−1)·(F+B−W) per rank, i.e.
(p−1)/(3m+p−1). All with p2p time 0.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from threefold.cli import main
from threefold.config import ConfigError
from threefold.parallel.pipeline.schedule import Action, Kind, ScheduleError, build_schedule, validate
from threefold.plan.simulate import ActionCosts, bubble_fraction, simulate
from threefold.plan.timeline import draw_timelines

PP = [1, 2, 3, 4, 5, 8]
MICROBATCHES = [1, 2, 3, 4, 5, 7, 8, 12, 16]


def grid(min_pp=1):
    return [(p, m) for p in PP if p >= min_pp for m in MICROBATCHES]


# ---------------------------------------------------------------- building and validating

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("pp,m", grid())
def test_every_single_chunk_schedule_validates(name, pp, m):
    validate(build_schedule(name, pp, m))


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("pp,m", grid(min_pp=2))
def test_every_interleaved_schedule_validates(pp, m, v):
    validate(build_schedule("interleaved", pp, m, v))


def test_actions_carry_what_a_runtime_needs():
    plan = build_schedule("1f1b", 2, 2)
    rank0 = [str(a) for a in plan.actions[0]]
    rank1 = [str(a) for a in plan.actions[1]]
    assert rank0 == ["F0@s0", "send_act0@s0->r1", "F1@s0", "send_act1@s0->r1",
                     "recv_grad0@s0<-r1", "B0@s0", "recv_grad1@s0<-r1", "B1@s0"]
    assert rank1 == ["recv_act0@s1<-r0", "F0@s1", "B0@s1", "send_grad0@s1->r0",
                     "recv_act1@s1<-r0", "F1@s1", "B1@s1", "send_grad1@s1->r0"]
    assert not plan.split_backward and build_schedule("zb-h1", 2, 2).split_backward


def test_interleaved_places_chunks_round_the_ring():
    plan = build_schedule("interleaved", 2, 2, 2)
    assert plan.num_stages == 4 and list(plan.stages_of(1)) == [1, 3]
    # the last stage of chunk 0 (stage 1, rank 1) feeds stage 2 on rank 0
    assert Action(Kind.SEND_ACT, 0, 1, peer=0) in plan.actions[1]
    assert Action(Kind.RECV_ACT, 0, 2, peer=1) in plan.actions[0]


def _edit(plan, rank, edit):
    actions = list(plan.actions)
    actions[rank] = tuple(edit(list(actions[rank])))
    return replace(plan, actions=tuple(actions))


def _swap(first, second):
    def edit(actions):
        i, j = actions.index(first), actions.index(second)
        actions[i], actions[j] = actions[j], actions[i]
        return actions
    return edit


def _move_after(moved, anchor):
    def edit(actions):
        actions.remove(moved)
        actions.insert(actions.index(anchor) + 1, moved)
        return actions
    return edit


BROKEN = {
    # rank 0 waits for micro-batch 0's gradient before sending the activation that produces it
    "swapped send/recv": (0, _swap(Action(Kind.SEND_ACT, 0, 0, 1), Action(Kind.RECV_GRAD, 0, 0, 1)), "deadlock"),
    # both sends still follow their forwards, but arrive in the wrong order
    "sends out of order": (0, _move_after(Action(Kind.SEND_ACT, 0, 0, 1), Action(Kind.SEND_ACT, 1, 0, 1)),
                           "out of order"),
    "backward before its gradient": (0, _swap(Action(Kind.RECV_GRAD, 1, 0, 1), Action(Kind.BACKWARD, 1, 0)),
                                     "comes before its RECV_GRAD"),
    "wrong peer": (1, lambda a: [replace(x, peer=1) if x.kind is Kind.SEND_GRAD else x for x in a], "peer should be"),
    "missing backward": (1, lambda a: [x for x in a if (x.microbatch, x.kind) not in
                                       ((2, Kind.BACKWARD), (2, Kind.SEND_GRAD))], "appears 0 times"),
    "duplicate forward": (0, lambda a: a + [Action(Kind.FORWARD, 0, 0)], "appears twice"),
    "stage on another rank": (0, lambda a: a + [Action(Kind.FORWARD, 0, 1)], "not on this rank"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_validator_rejects_broken_schedules(case):
    rank, edit, message = BROKEN[case]
    plan = build_schedule("1f1b", 2, 3)
    validate(plan)
    with pytest.raises(ScheduleError, match=message):
        validate(_edit(plan, rank, edit))


def test_validator_requires_every_weight_grad_of_a_split_schedule():
    plan = build_schedule("zb-h1", 2, 2)
    broken = _edit(plan, 1, lambda a: [x for x in a if x != Action(Kind.WEIGHT_GRAD, 1, 1)])
    with pytest.raises(ScheduleError, match="WEIGHT_GRAD of micro-batch 1 on stage 1 appears 0 times"):
        validate(broken)


@pytest.mark.parametrize("name,pp,m,v,message", [
    ("1f1b", 0, 8, 1, "parallel.pp"),
    ("1f1b", 4, 0, 1, "parallel.microbatches"),
    ("chimera", 4, 8, 1, "parallel.schedule"),
    ("pipedream", 4, 8, 1, "parallel.microbatches"),
    ("2bw", 4, 3, 1, "parallel.microbatches"),
    ("gpipe", 4, 8, 2, "parallel.virtual_stages"),
    ("zb-h1", 4, 8, 2, "parallel.virtual_stages"),
    ("interleaved", 4, 8, 1, "parallel.virtual_stages"),
    ("interleaved", 1, 8, 2, "parallel.pp"),
])
def test_bad_layouts_are_refused(name, pp, m, v, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(name, pp, m, v)


# ---------------------------------------------------------------- bubble

@pytest.mark.parametrize("backward", [1.0, 2.0])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", grid())
def test_gpipe_and_1f1b_bubble_matches_the_closed_form(name, pp, m, backward):
    result = simulate(build_schedule(name, pp, m), ActionCosts(forward=1.0, backward=backward, weight_grad=0.0))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.makespan == pytest.approx((m + pp - 1) * (1.0 + backward))


@pytest.mark.parametrize("backward", [1.0, 2.0])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("pp,m", [(p, m) for p, m in grid(min_pp=2) if m >= p])
def test_interleaved_bubble_matches_the_closed_form(pp, m, v, backward):
    costs = ActionCosts(forward=1 / v, backward=backward / v, weight_grad=0.0)
    result = simulate(build_schedule("interleaved", pp, m, v), costs)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m", [(p, m) for p, m in grid(min_pp=2) if m < p])
def test_interleaved_with_fewer_microbatches_than_ranks_runs_with_a_larger_bubble(pp, m):
    costs = ActionCosts(forward=0.5, backward=1.0, weight_grad=0.0)
    result = simulate(build_schedule("interleaved", pp, m, 2), costs)
    assert (pp - 1) / (2 * m + pp - 1) < result.bubble_fraction <= (pp - 1) / (m + pp - 1) + 1e-12


ZB_COSTS = ActionCosts(forward=1.0, backward=2.0, weight_grad=1.0)  # F = B = W = 1


@pytest.mark.parametrize("pp,m", [(p, m) for p, m in grid() if m >= p])
def test_zb_h1_bubble_matches_the_closed_form(pp, m):
    result = simulate(build_schedule("zb-h1", pp, m), ZB_COSTS)
    assert result.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m", grid(min_pp=2))
def test_zb_h1_never_idles_more_than_1f1b(pp, m):
    zb = simulate(build_schedule("zb-h1", pp, m), ZB_COSTS)
    one_f_one_b = simulate(build_schedule("1f1b", pp, m), ZB_COSTS)
    assert zb.makespan <= one_f_one_b.makespan
    if m >= 4 * pp:  # the papers' regime: about a third of 1F1B's bubble
        assert 1 / 3 <= zb.bubble_fraction / one_f_one_b.bubble_fraction < 0.4


# ---------------------------------------------------------------- activations in flight

@pytest.mark.parametrize("pp,m", grid())
def test_peak_activations(pp, m):
    one_f_one_b = simulate(build_schedule("1f1b", pp, m)).peak_activations
    assert one_f_one_b[0] == min(pp, m)
    assert list(one_f_one_b) == [min(pp - r, m) for r in range(pp)]
    assert list(simulate(build_schedule("gpipe", pp, m)).peak_activations) == [m] * pp
    assert max(simulate(build_schedule("zb-h1", pp, m), ZB_COSTS).peak_activations) == min(pp, m)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (8, 16, 2)])
def test_interleaved_peak_follows_megatrons_warmup(pp, m, v):
    """Rank 0 runs (v−1)·pp + 2·(pp−1) warm-up chunk forwards and one more before its first
    backward; each chunk is 1/v of the rank's activations."""
    peak = simulate(build_schedule("interleaved", pp, m, v)).peak_activations
    assert peak[0] == pytest.approx(((v - 1) * pp + 2 * (pp - 1) + 1) / v)


# ---------------------------------------------------------------- simulator timing

def test_one_microbatch_walks_the_pipeline_with_per_stage_costs_and_latency():
    forward, backward, p2p = [1.0, 2.0, 3.0], [2.0, 5.0, 4.0], 0.25
    result = simulate(build_schedule("1f1b", 3, 1), ActionCosts(forward, backward, 0.0, p2p))
    assert result.makespan == pytest.approx(sum(forward) + sum(backward) + 4 * p2p)
    # split backward: B travels back, then rank 0's own weight gradient ends the step
    weight = [1.0, 2.0, 1.5]
    zb = simulate(build_schedule("zb-h1", 3, 1), ActionCosts(forward, backward, weight, p2p))
    input_grads = [b - w for b, w in zip(backward, weight)]
    assert zb.makespan == pytest.approx(sum(forward) + sum(input_grads) + weight[0] + 4 * p2p)


def test_simulated_actions_respect_order_and_never_overlap():
    result = simulate(build_schedule("interleaved", 4, 8, 2), ActionCosts(0.5, 1.0, 0.0, p2p=0.1))
    for rank in result.timelines:
        for before, after in zip(rank, rank[1:]):
            assert before.end <= after.start + 1e-12
    assert result.busy == pytest.approx([8 * 2 * (0.5 + 1.0)] * 4)


@pytest.mark.parametrize("costs", [
    ActionCosts(weight_grad=3.0),
    ActionCosts(forward=[1.0, 2.0]),
    ActionCosts(p2p=-1.0),
])
def test_bad_costs_are_refused(costs):
    with pytest.raises(ConfigError, match="costs"):
        simulate(build_schedule("1f1b", 4, 8), costs)


def test_bubble_of_a_measured_timeline():
    measured = [[(0.0, 2.0, "F", 0), (3.0, 4.0, "B", 0)], [(1.0, 4.0, "F", 0)]]
    assert bubble_fraction(measured) == pytest.approx(1 - 6 / 8)


# ---------------------------------------------------------------- drawing and the command

def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_draws_a_measured_timeline_beside_the_simulated_one(tmp_path):
    simulated = simulate(build_schedule("zb-h1", 2, 3), ZB_COSTS).segments()
    measured = [[(0.0, 0.01, "F", 0), (0.02, 0.03, "B", 0), (0.03, 0.04, "W", 0)],
                [(0.01, 0.02, "F", 0), (0.02, 0.025, Kind.BACKWARD, 0)]]
    one = draw_timelines([("simulated", simulated)], tmp_path / "one.png")
    two = draw_timelines([("simulated", simulated), ("measured", measured)], tmp_path / "two.png")
    (w1, h1), (w2, h2) = _png_size(one), _png_size(two)
    assert w1 == w2 and h2 > h1


def _run(capsys, *args):
    code = main(["schedule", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_command_json(capsys, tmp_path):
    code, out, _ = _run(capsys, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json",
                        "--out", str(tmp_path / "t.png"))
    assert code == 0
    result = json.loads(out)
    assert result["bubble_fraction"] == pytest.approx(3 / 11)
    assert result["peak_activations"] == [4, 3, 2, 1] and result["past_backward_at_peak"] == [0, 0, 0, 0]
    assert (result["schedule"], result["pp"], result["microbatches"], result["virtual_stages"]) == ("1f1b", 4, 8, 1)
    assert _png_size(tmp_path / "t.png")[0] > 0


def test_a_split_backwards_table_shows_the_micro_batches_past_b(capsys):
    """ZB-H1 holds four micro-batches at every rank's peak, but rank r defers its W's: r + 1 of
    them have run B there and hold only what W reads (docs/pipeline_parallel.md)."""
    code, out, _ = _run(capsys, "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8")
    assert code == 0 and "past B" in out
    rows = [line.split("│")[1:5] for line in out.splitlines() if line.startswith("│")]
    assert [cells[3].strip() for cells in rows] == ["4, 1", "4, 2", "4, 3", "4, 4"]


@pytest.mark.parametrize("chunks", [["--virtual-stages", "2"], []])  # 2 chunks a rank: interleaved's default too
def test_command_table(capsys, chunks):
    code, out, _ = _run(capsys, "--schedule", "interleaved", "--pp", "4", "--microbatches", "8", *chunks)
    assert code == 0
    assert f"bubble {3 / 19:.1%}" in out and "5.5" in out and "v=2" in out


@pytest.mark.parametrize("args", [
    ["--pp", "0"],
    ["--schedule", "nope"],
    ["--schedule", "1f1b", "--virtual-stages", "2"],
    ["--schedule", "interleaved", "--pp", "1", "--virtual-stages", "2"],
    ["--microbatches", "-1"],
])
def test_command_refuses_bad_input_in_one_line(capsys, args):
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "rror" in line]) == 1


# ---------------------------------------------------------------- the registry

from threefold.parallel.pipeline.schedule import (SCHEDULE_REGISTRY, check_schedule, schedule_names,  # noqa: E402
                                                 stages_per_rank)
from threefold.plan.simulate import peak_in_flight  # noqa: E402


def registry_grid():
    """Every (name, pp, m, v) the registry accepts for a model with enough layers, over a grid
    that includes fewer micro-batches than ranks and m not a multiple of pp."""
    cases = []
    for name, spec in SCHEDULE_REGISTRY.items():
        for pp in (2, 3, 4, 5, 8):
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16):
                for v in ((2, 3, 4) if spec.chunked else (1,)):
                    try:
                        check_schedule(name, pp, m, v, layers=pp * v * 2)
                    except ConfigError:
                        continue
                    cases.append((name, pp, m, v))
    return cases


def test_every_registered_schedule_has_cases_in_the_grid():
    names = {case[0] for case in registry_grid()}
    assert names == set(SCHEDULE_REGISTRY) and len(registry_grid()) > 150


@pytest.mark.parametrize("name,pp,m,v", registry_grid())
def test_each_schedules_closed_forms_equal_the_simulator(name, pp, m, v):
    """At uniform costs (F = B = W per chunk, as the planner assumes), the registry's bubble and
    its micro-batches in flight on the first and last rank are the simulator's, exactly."""
    spec = SCHEDULE_REGISTRY[name]
    sim = simulate(build_schedule(name, pp, m, v), ActionCosts(forward=1 / v, backward=2 / v, weight_grad=1 / v))
    assert float(spec.bubble(pp, m, v)) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert float(spec.in_flight_first(pp, m, v)) == pytest.approx(sim.peak_activations[0], abs=1e-12)
    assert float(spec.in_flight_last(pp, m, v)) == pytest.approx(sim.peak_activations[-1], abs=1e-12)
    # of those, the ones past B that `threefold schedule` shows: the registry's captured forms
    assert float(spec.captured_first(pp, m, v)) == pytest.approx(sim.past_backward_at_peak[0], abs=1e-12)
    assert float(spec.captured_last(pp, m, v)) == pytest.approx(sim.past_backward_at_peak[-1], abs=1e-12)
    # the micro-batches whose head tensors the rank with the last stage holds (released at W)
    schedule = build_schedule(name, pp, m, v)
    last = pp * stages_per_rank(name, v) - 1
    rank = next(r for r in range(pp) if last in schedule.stages_of(r))
    held = peak_in_flight(schedule.actions[rank], schedule.split_backward, lambda a: int(a.stage == last))
    assert float(spec.head_in_flight(pp, m, v)) == held
    # under a split backward a micro-batch keeps from its B to its W what W reads and the gradients
    # B captured, r of what it saved (about 0.96 for a Llama block in 16 bits), and while a B runs
    # it holds up to tau more (a block's captured gradients): the planner's peak
    # n + (c − 1)·(r − 1) + max(r − 1, tau), in units of one micro-batch (a chunk under DualPipeV)
    # (costs.estimate's split_peak), at r from half to more than all of it
    chunks = stages_per_rank(name, v)
    for rank, n, c in ((0, spec.in_flight_first, spec.captured_first), (pp - 1, spec.in_flight_last, spec.captured_last)):
        n, c = float(n(pp, m, v)), float(c(pp, m, v))
        assert c == 0 or schedule.split_backward
        one = min(c, 1)
        for r, tau in ((0.5, 0.0), (0.9, 0.0), (1.3, 0.0), (0.9, 0.3), (0.5, 0.6), (1.3, 0.1)):
            played = peak_in_flight(schedule.actions[rank], schedule.split_backward, lambda a: 1 / chunks,
                                    lambda a: r / chunks, lambda a: tau)
            during = tau if schedule.split_backward else 0.0  # a whole backward frees as it goes
            assert n + (c - one) * (r - 1) + max(one * (r - 1), during) == pytest.approx(played, abs=1e-9), (rank, r, tau)


def test_a_split_backward_holds_what_b_keeps_until_w():
    """ZB-H1 on pp 2, 4 micro-batches: the last rank runs F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3, so
    it holds two micro-batches' activations at most; when B keeps a quarter of a micro-batch's
    for W, one whole and one quarter (at F1, F2, F3), and when it keeps twice as much (its
    captured gradients outweighing what it released), two of those (at B1, B2, B3). 1F1B frees
    everything at B, so nothing is kept."""
    ranks = build_schedule("zb-h1", 2, 4, 1).actions
    assert peak_in_flight(ranks[1], True) == 2
    assert peak_in_flight(ranks[1], True, kept=lambda a: 0.25) == 1.25
    assert peak_in_flight(ranks[1], True, kept=lambda a: 2) == 4
    assert peak_in_flight(ranks[0], True, kept=lambda a: 2) == 3  # F0 F1 B0: one, and B0's two
    assert peak_in_flight(build_schedule("1f1b", 2, 4, 1).actions[1], False, kept=lambda a: 2) == 1


def test_closed_forms_take_arrays_of_layouts():
    """The planner evaluates them over numpy arrays; element by element they equal the scalars."""
    import numpy as np

    for name, spec in SCHEDULE_REGISTRY.items():
        cases = [(p, m, v) for n, p, m, v in registry_grid() if n == name]
        p, m, v = (np.array(x, dtype=float) for x in zip(*cases))
        for form in (spec.bubble, spec.in_flight_first, spec.in_flight_last, spec.head_in_flight):
            together = np.broadcast_to(form(p, m, v), p.shape)
            assert together == pytest.approx([float(form(*case)) for case in cases], abs=1e-12)


def test_zb_h1_with_fewer_microbatches_than_ranks_is_the_simulators_bubble():
    """Issue 17: pp 8 with 4 micro-batches idles 47.8%, not the m ≥ pp closed form's 36.8%."""
    from threefold.plan import costs

    sim = simulate(build_schedule("zb-h1", 8, 4), ZB_COSTS)
    assert sim.bubble_fraction == pytest.approx(11 / 23)
    assert costs.bubble_fraction("zb-h1", 8, 4) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    assert (8 - 1) / (3 * 4 + 8 - 1) == pytest.approx(0.368, abs=1e-3)  # what the planner used to say


def test_registered_names_are_the_configs():
    from threefold.config import SCHEDULES
    from threefold.plan import costs

    assert schedule_names() == tuple(SCHEDULES) == costs.SCHEDULES


@pytest.mark.parametrize("name,pp,m,v,layers,message", [
    ("interleaved", 4, 8, 3, 8, "parallel.pp: pp × virtual_stages = 4 × 3 = 12 stages, more than the model's 8"),
    ("interleaved", 2, 8, 3, 10, "parallel.virtual_stages: interleaved splits each rank's layers into equal chunks"),
    ("interleaved", 4, 3, 2, 8, "parallel.microbatches: interleaved needs at least pp=4 micro-batches per step"),
    ("1f1b", 4, 8, 2, 8, "parallel.virtual_stages: 1f1b has one stage per rank"),
    ("chimera", 4, 8, 1, 8, "parallel.schedule: must be one of gpipe, 1f1b, interleaved, zb-h1"),
    ("2bw", 4, 3, 1, 8, "parallel.microbatches: 2bw needs at least pp=4 micro-batches per step, got 3"),
    ("pipedream", 4, 2, 1, 8, "parallel.microbatches: pipedream takes one optimizer step per micro-batch"),
])
def test_check_schedule_says_what_is_wrong_in_one_line(name, pp, m, v, layers, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        check_schedule(name, pp, m, v, layers)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^--pp" if "parallel.pp" in message else "."):
        check_schedule(name, pp, m, v, layers, flags={"pp": "--pp"})


@pytest.mark.parametrize("pp,m", [(4, 8), (2, 8), (8, 16), (4, 4), (8, 4), (4, 2)])
@pytest.mark.parametrize("f,b,w", [(46, 62, 39), (1, 1.5, 0.5), (1, 2, 1), (1, 1, 1)])
def test_zb_h1_closed_form_at_any_shares_is_the_simulators_bubble(pp, m, f, b, w):
    """ZB-H1 idles (p − 1)(F + B − W) + max(0, p − m)·W per rank (B: the input gradient alone):
    the registry's form equals the simulator off F = B = W too (46 : 62 : 39 ms is this CPU's
    tiny model, measured; at pp 4, m 8 that is 15.0%, not F = B = W's 11.1%)."""
    from threefold.plan import costs

    sim = simulate(build_schedule("zb-h1", pp, m), ActionCosts(forward=f, backward=b + w, weight_grad=w))
    slot = f + b + w
    shares = (f / slot, b / slot, w / slot)
    assert costs.bubble_fraction("zb-h1", pp, m, shares=shares) == pytest.approx(sim.bubble_fraction, abs=1e-12)
    if (pp, m, (f, b, w)) == (4, 8, (46, 62, 39)):
        assert sim.bubble_fraction == pytest.approx(0.1497, abs=1e-4)
    # the schedules whose bubble the shares do not move at uniform stages keep their form
    assert costs.bubble_fraction("1f1b", pp, m, shares=shares) == costs.bubble_fraction("1f1b", pp, m)


def test_the_command_reads_other_frameworks_names_and_gives_a_steady_runs_bubble(capsys):
    """`schedule` takes the names estimate and plan take (1F1B, interleaved-1f1b, pipedream-flush),
    and for the schedules that never flush says both figures: a step alone fills the pipeline
    (2bw pp 4, m 8: 1F1B's 9 idle units of 33), a step of a run's steady state has no bubble, as
    estimate prices it."""
    for given, read in (("1F1B", "1f1b"), ("interleaved-1f1b", "interleaved"), ("pipedream-flush", "1f1b")):
        assert main(["schedule", "--schedule", given, "--pp", "4", "--microbatches", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["schedule"] == read
    assert main(["schedule", "--schedule", "2bw", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction"] == pytest.approx(9 / 33) and report["steady_bubble_fraction"] == 0.0
    assert main(["schedule", "--schedule", "1f1b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steady_bubble_fraction"] is None
    assert main(["schedule", "--schedule", "pipedream", "--pp", "4", "--microbatches", "1"]) == 0
    assert "its steady steps: bubble 0.0%" in " ".join(capsys.readouterr().out.split())
