"""Routing imbalance under expert parallelism: the engine's step metric ``ep_max_over_mean``, the
planner's ``--moe-imbalance`` (the busiest ep rank's routed rows over the mean, which every rank
waits for at each MoE block's combine), and ``compare`` pricing a run at the imbalance it
measured. Each priced difference is checked against its count from the shapes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from threefold import config
from threefold.cli import main
from threefold.models.moe import routing_statistics
from threefold.models.presets import get_preset
from threefold.plan import costs
from threefold.plan.compare import measured_imbalance
from threefold.plan.hardware import get_gpu

MIXTRAL = get_preset("mixtral-8x7b")  # 32 blocks, all MoE, 8 experts of SwiGLU 4096 → 14336, top-2
H100 = get_gpu("h100-sxm")


def estimate(imbalance: float, **sizes) -> dict:
    work = costs.Workload(MIXTRAL, global_batch=64, moe_imbalance=imbalance)
    return costs.estimate(work, costs.Layout.named(micro_batch=1, **sizes), H100)


def test_the_busiest_ep_ranks_rows_over_the_mean_summed_over_layers():
    # 2 layers, 4 experts on ep 2 (experts 0-1 on rank 0, 2-3 on rank 1):
    # layer 0 loads (10, 10), layer 1 loads (16, 4): (10 + 16) / (10 + 10)
    counts = torch.tensor([[10, 0, 5, 5], [8, 8, 0, 4]])
    assert routing_statistics(counts, 0, 0.0, 1, ep=2)["ep_max_over_mean"] == pytest.approx(26 / 20)
    assert routing_statistics(counts, 0, 0.0, 1, ep=4)["ep_max_over_mean"] == pytest.approx((10 + 8) / (5 + 5))
    assert "ep_max_over_mean" not in routing_statistics(counts, 0, 0.0, 1)  # one rank holds every expert


def test_the_busiest_ranks_experts_take_its_rows_and_every_rank_waits_for_them():
    """The MoE block's products grow by exactly the expert products at the busiest rank's rows;
    the attention, router and dense parts are unchanged."""
    layout = costs.Layout.named(micro_batch=1, dp=8, ep=8)
    balanced, busy = (costs.part_seconds(costs.Workload(MIXTRAL, 64, moe_imbalance=r), layout, H100)
                      for r in (1.0, 1.5))
    rows = MIXTRAL.seq_len * MIXTRAL.moe_top_k_experts * 8 / MIXTRAL.moe_experts  # this rank's one expert's
    h, f = MIXTRAL.hidden, MIXTRAL.moe_ffn_hidden

    def expert_s(m):  # one expert's forward products: gate, up (h → f) and down (f → h)
        return 2 * costs.matmul_seconds(m, h, f, H100) + costs.matmul_seconds(m, f, h, H100)

    local = MIXTRAL.moe_experts / 8
    assert busy["moe_block"]["math"] - balanced["moe_block"]["math"] == pytest.approx(
        3 * local * (expert_s(1.5 * rows) - expert_s(rows)), rel=1e-9)
    assert busy["block"] == balanced["block"] and busy["head"] == balanced["head"]


def test_the_busiest_ranks_saved_rows_grow_with_its_load():
    """What the busiest rank saves for backward: what its experts save of its k·load routed rows,
    their input (h) and SwiGLU internals (4·f) a row, in 16-bit. The combine's output and its
    weighted copy are of its own tokens' rows, and the router's and the sort's bytes, unchanged."""
    tokens, k, h, f = 4096, MIXTRAL.moe_top_k_experts, MIXTRAL.hidden, MIXTRAL.moe_ffn_hidden
    extra = (costs.moe_activation_bytes(MIXTRAL, tokens, 1, False, "none", load=1.25)
             - costs.moe_activation_bytes(MIXTRAL, tokens, 1, False, "none"))
    assert extra == pytest.approx(tokens * 0.25 * k * 2 * (4 * f + h))
    with_shared = dataclasses.replace(MIXTRAL, moe_shared_experts=1)  # a shared expert runs every token, once
    assert (costs.moe_activation_bytes(with_shared, tokens, 1, False, "none", load=1.25)
            - costs.moe_activation_bytes(with_shared, tokens, 1, False, "none")) == pytest.approx(extra)
    kept = (costs.moe_weight_input_bytes(MIXTRAL, tokens, 1, False, "none", load=1.25)
            - costs.moe_weight_input_bytes(MIXTRAL, tokens, 1, False, "none"))
    assert kept == pytest.approx(tokens * 0.25 * k * 2 * (h + f))  # what W reads: the rows and the products
    assert estimate(1.25, dp=8, ep=8)["activations_bytes"] > estimate(1.0, dp=8, ep=8)["activations_bytes"]
    # a split backward holds the gate, up and output gradients B captured for the busiest rank's rows
    captured = [costs.captured_gradient_bytes(MIXTRAL, tokens, 1, False, load=r)[1] for r in (1.0, 1.25)]
    assert captured[1] - captured[0] == pytest.approx(tokens * 0.25 * k * 2 * (2 * f + h))
    for schedule in ("zb-h1", "dualpipev", "1f1b"):
        busy, balanced = (estimate(r, pp=2, dp=8, ep=8, schedule=schedule)["activations_bytes"] for r in (1.25, 1.0))
        assert busy > balanced, schedule


def test_the_exchange_waits_for_the_busiest_rank_and_its_bytes_stay_the_mean():
    """The all-to-alls' transfer time grows linearly with the load, their latency does not (on
    links too fast to take time, the load changes nothing); rank 0's sent bytes, the planner's
    formula for a balanced rank, do not change."""
    ep_s = {r: float(estimate(r, dp=16, ep=8)["ep_exposed_s"]) for r in (1.0, 2.0, 3.0)}
    assert ep_s[2.0] > ep_s[1.0]
    assert ep_s[3.0] - ep_s[2.0] == pytest.approx(ep_s[2.0] - ep_s[1.0], rel=1e-9)
    assert estimate(3.0, dp=16, ep=8)["ep_bytes"] == estimate(1.0, dp=16, ep=8)["ep_bytes"]
    instant = dataclasses.replace(H100, intra_node_bw=1e30, inter_node_bw=1e30)  # transfers of no time, latency left
    latency = [float(costs.estimate(costs.Workload(MIXTRAL, 64, moe_imbalance=r), costs.Layout.named(
        micro_batch=1, dp=16, ep=8), instant)["ep_exposed_s"]) for r in (1.0, 3.0)]
    assert latency[0] > 0 and latency[1] == pytest.approx(latency[0], rel=1e-6)


def test_split_experts_gathers_carry_the_busiest_ranks_rows():
    """On Megatron-Core's grid with the experts split over tp, the dispatched rows' gathers and
    reduce-scatters over tp take the busiest rank's rows: longer, the bytes a balanced rank's."""
    busy, balanced = (estimate(r, tp=2, dp=8, ep=8, expert_tp=2, sequence_parallel=True) for r in (1.3, 1.0))
    assert busy["tp_exposed_s"] > balanced["tp_exposed_s"] and busy["tp_bytes"] == balanced["tp_bytes"]
    whole = [estimate(r, tp=2, dp=8, ep=8, expert_tp=1, sequence_parallel=True)["tp_exposed_s"] for r in (1.3, 1.0)]
    assert whole[0] == whole[1]  # whole experts: no tp collective carries routed rows


def test_the_imbalance_is_at_most_what_the_busiest_rank_can_take(capsys):
    """min(ep, E/k): Mixtral's 8 experts, top-2: 2 at ep 2, 4 at ep 8. estimate and a plan at a
    given ep refuse more in one line; a plan searching ep prices each at most at its ceiling."""
    work = costs.Workload(MIXTRAL, 64, moe_imbalance=3.0)
    assert [float(costs.routed_load(work, e)) for e in (1, 2, 4, 8)] == [1.0, 2.0, 3.0, 3.0]
    for command, flags in (("estimate", ["--dp", "8", "--ep", "2"]), ("plan", ["--num-gpus", "16", "--ep", "2"])):
        config.note_once.cache_clear()
        assert main([command, "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "64",
                     "--moe-imbalance", "3", *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err == ("error: --moe-imbalance: 3 is more than the busiest of --ep 2 ranks can take, "
                       "min(ep, experts / top-k) = 2 times the mean"), command


def test_without_expert_parallelism_the_imbalance_changes_nothing_and_says_so(capsys):
    assert estimate(1.7, dp=8)["step_time_s"] == estimate(1.0, dp=8)["step_time_s"]
    assert estimate(1.7, dp=8)["activations_bytes"] == estimate(1.0, dp=8)["activations_bytes"]
    config.note_once.cache_clear()
    assert main(["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "64", "--dp", "8",
                 "--micro-batch", "1", "--moe-imbalance", "1.7", "--json"]) == 0
    note = ("note: --moe-imbalance has no effect at --ep 1 (each rank runs every expert on its own tokens, "
            "however they are routed)")
    assert capsys.readouterr().err.strip() == note
    config.note_once.cache_clear()
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "16", "--global-batch", "64",
                 "--ep", "1", "--moe-imbalance", "1.7", "--json"]) == 0
    assert note in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--model", "mixtral-8x7b", "--moe-imbalance", "0.9"], "--moe-imbalance: the busiest rank's routed rows over "
                                                           "the mean, at least 1 (1: balanced), got 0.9"),
    (["--model", "mixtral-8x7b", "--moe-imbalance", "nan"], "got nan"),
    (["--model", "llama3-8b", "--moe-imbalance", "1.2"], "--moe-imbalance: set without --moe-experts (a dense model)"),
])
def test_a_bad_imbalance_is_one_line_and_exit_2(capsys, flags, message):
    config.note_once.cache_clear()
    code = main(["estimate", "--gpu", "h100-sxm", "--global-batch", "64", "--dp", "8", "--ep", "8", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_batch_line_and_plan_take_the_imbalance(tmp_path, capsys):
    lines = tmp_path / "rows.jsonl"
    row = {"model": "mixtral-8x7b", "gpu": "h100-sxm", "global_batch": 64, "dp": 8, "ep": 8, "micro_batch": 1}
    lines.write_text("\n".join(json.dumps(r) for r in (row, dict(row, moe_imbalance=1.4), dict(row, moe_imbalance=0))))
    assert main(["estimate", "--batch", str(lines)]) == 0
    balanced, busy, bad = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert busy["step_time_s"] > balanced["step_time_s"] and "--moe-imbalance" in bad["error"]
    plans = []
    for imbalance in ("1", "1.4"):  # ep fixed at 8: every layout of the search waits for the busiest rank
        assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "16", "--global-batch", "64",
                     "--ep", "8", "--micro-batch", "1", "--moe-imbalance", imbalance, "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out)["layouts"][0])
    assert plans[1]["step_time_s"] > plans[0]["step_time_s"]


def test_compare_prices_a_run_at_the_imbalance_it_measured():
    ep_run = config.Config(parallel=config.ParallelConfig(dp=2, ep=2))
    steps = [{"moe": {"ep_max_over_mean": r}} for r in (1.1, 1.5, 1.3)] + [{"moe": {}}]
    assert measured_imbalance(ep_run, steps) == pytest.approx(1.3)  # the median of the steps that report it
    assert measured_imbalance(config.Config(parallel=config.ParallelConfig(dp=2)), steps) == 1.0  # no ep: balanced
    assert measured_imbalance(ep_run, [{"moe": {}}]) == 1.0  # an older run's metrics: balanced


def test_plan_says_when_its_fastest_layout_is_priced_at_balanced_routing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line
    caveat = ("EP=8 is priced at balanced routing: every rank waits at each MoE block for the busiest ep rank, which "
              "learned routing loads more; --moe-imbalance R (a threefold run's moe.ep_max_over_mean) prices it.")
    plan = ["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "16", "--global-batch", "64",
            "--micro-batch", "1", "--top", "1"]
    for flags, said in ((["--ep", "8"], True), (["--ep", "8", "--moe-imbalance", "1.2"], False), (["--ep", "1"], False)):
        config.note_once.cache_clear()
        assert main(plan + flags) == 0
        assert (caveat in capsys.readouterr().out.splitlines()) == said, flags
