"""The planner's expert placement over tp (``Layout.expert_tp``): threefold's engine (0: experts whole
on every tp rank) against Megatron-Core's expert grid (1: whole experts, ep folded over tp·cp·dp;
tp: each expert split over the tp ranks, its default). Each memory term is checked against its
count from the model's shape, so a wrong grid fails by whole tensors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from threefold import config
from threefold.cli import main
from threefold.models.presets import get_preset
from threefold.plan import costs
from threefold.plan.hardware import get_gpu

MIXTRAL = get_preset("mixtral-8x7b")  # 32 blocks, every one MoE, 8 experts of 3·4096·14336, top-2, no shared experts
EXPERT_NUMEL = 3 * MIXTRAL.hidden * MIXTRAL.moe_ffn_hidden


def estimate(**sizes):
    work = costs.Workload(MIXTRAL, global_batch=64)
    layout = costs.Layout.named(micro_batch=1, **sizes)
    costs.check_layout(MIXTRAL, layout, 64, int(layout.tp * layout.pp * layout.dp * layout.cp))
    return costs.estimate(work, layout, get_gpu("h100-sxm"))


def test_megatron_split_experts_hold_one_tp_share_of_the_experts_weights_and_gradients():
    """ETP = tp: each tp rank holds 1/tp of its E/ep experts; the engine holds them whole."""
    engine = estimate(tp=2, dp=8, ep=8, sequence_parallel=True, zero=1, expert_tp=0)
    split = estimate(tp=2, dp=8, ep=8, sequence_parallel=True, zero=1, expert_tp=2)
    halved = MIXTRAL.layers * (MIXTRAL.moe_experts // 8) * EXPERT_NUMEL / 2  # per rank: 32 blocks × 1 expert × ½
    assert engine["params_bytes"] - split["params_bytes"] == pytest.approx(halved * 2)  # bf16 weights
    assert engine["grads_bytes"] - split["grads_bytes"] == pytest.approx(halved * 4)  # fp32 gradients
    # ZeRO-1 over the expert replicas, dp/ep = 1 on both: the states follow the weights
    assert engine["optimizer_bytes"] - split["optimizer_bytes"] == pytest.approx(halved * 12)


def test_megatron_whole_experts_fold_ep_over_tp_and_shard_their_states_over_tp_too():
    """ETP = 1 at ep 8 over tp 2 × dp 4: ep larger than dp runs (the engine refuses it), each rank
    holds one whole expert a block, and ZeRO-1 shards its states over tp·dp/ep = 1 rank… and at
    dp 8 over tp·dp/ep = 2 ranks, where the engine's replicas are dp/ep = 1."""
    with pytest.raises(config.ConfigError, match="does not divide --dp 4"):
        estimate(tp=2, dp=4, ep=8, sequence_parallel=True, zero=1, expert_tp=0)
    folded = estimate(tp=2, dp=4, ep=8, sequence_parallel=True, zero=1, expert_tp=1)
    engine = estimate(tp=2, dp=8, ep=8, sequence_parallel=True, zero=1, expert_tp=0)
    whole = estimate(tp=2, dp=8, ep=8, sequence_parallel=True, zero=1, expert_tp=1)
    expert_states = MIXTRAL.layers * EXPERT_NUMEL * 12  # fp32 master, two moments: one expert a block
    assert engine["params_bytes"] == whole["params_bytes"] == folded["params_bytes"]
    assert engine["optimizer_bytes"] - whole["optimizer_bytes"] == pytest.approx(expert_states / 2)
    # the engine sums its experts' gradients over tp once a step; Megatron-Core's grid reduces them
    # with their replicas, and only the router's sum over tp remains
    router = MIXTRAL.layers * MIXTRAL.moe_experts * MIXTRAL.hidden / 8  # ZeRO-1 over dp 8: this rank's share
    assert whole["tp_partial_bytes"] == pytest.approx(2 * (2 - 1) / 2 * router * 4)
    assert engine["tp_partial_bytes"] > 1000 * whole["tp_partial_bytes"]


def test_tp_collectives_of_an_moe_block_on_each_placement():
    """Per micro-batch, in all-reduces of the activations, one MoE block (SP) and the head's 1½:
    the engine's 3½ (the attention's 2½ and the router's gathered sequence); Megatron-Core's
    whole experts the attention's 2½; its split experts 2½ and the dispatched rows' gather and
    reduce-scatter, forward and backward, each k times the activations: 2½ + 2k."""
    one = dict(layers=1, sequence_parallel=True, recompute="none", embedding=False, moe_layers=1)
    assert costs.tp_collectives_per_microbatch(**one) == 3.5 + 1.5
    assert costs.tp_collectives_per_microbatch(**one, expert_tp=1, top_k=2) == 2.5 + 1.5
    assert costs.tp_collectives_per_microbatch(**one, expert_tp=4, top_k=2) == 2.5 + 4 + 1.5
    # full recomputation repeats the attention's gather and reduce-scatter, and the k of split experts
    one["recompute"] = "full"
    assert costs.tp_collectives_per_microbatch(**one, expert_tp=4, top_k=2) == 2.5 + 1 + 4 + 2 + 1.5
    # the engine's bytes are unchanged by the default
    assert costs.tp_bytes_per_step(4, 2, 1, 4096, 4096, 2, True, "none", 2, moe_layers=4) == \
        costs.tp_bytes_per_step(4, 2, 1, 4096, 4096, 2, True, "none", 2, moe_layers=4, expert_tp=0, top_k=2)


def _estimate_json(capsys, *flags):
    config.note_once.cache_clear()
    assert main(["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "256",
                 "--micro-batch", "1", "--json", *flags]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


@pytest.mark.parametrize("flags, expert_tp", [
    (["--num-gpus", "64", "--tp", "2", "--ep", "8", "--sequence-parallel"], 2),  # Megatron-Core's default: tp
    (["--num-gpus", "64", "--tp", "4", "--pp", "4", "--ep", "8", "--sequence-parallel"], 1),  # ep > dp 4: folded
    (["--num-gpus", "64", "--ep", "8"], 0),  # tp 1: the engine's, alike
    (["--num-gpus", "32", "--cp", "2", "--pp", "4", "--ep", "8"], 1),  # ep over cp 2 × dp 4: folded, at tp 1 too
    (["--num-gpus", "64", "--tp", "2", "--ep", "8", "--sequence-parallel", "--expert-tp", "0"], 0),
])
def test_estimate_defaults_to_megatron_cores_expert_grid(capsys, flags, expert_tp):
    result, err = _estimate_json(capsys, *flags)
    assert result["layout"]["expert_tp"] == expert_tp and err == ""


def test_megatron_core_turns_sequence_parallelism_on_for_moe_under_tp_and_says_so(capsys):
    result, err = _estimate_json(capsys, "--num-gpus", "64", "--tp", "2", "--ep", "8")
    assert result["layout"]["sequence_parallel"] and result["layout"]["expert_tp"] == 2
    assert err.strip() == ("note: Megatron-Core runs an MoE model under --tp only with --sequence-parallel; "
                           "estimating with it (--expert-tp 0 prices threefold's engine, which runs without)")
    with_sp, err = _estimate_json(capsys, "--num-gpus", "64", "--tp", "2", "--ep", "8", "--sequence-parallel")
    assert err == "" and with_sp["step_time_s"] == result["step_time_s"]


@pytest.mark.parametrize("flags, message", [
    (["--model", "mixtral-8x7b", "--tp", "2", "--expert-tp", "4"], "--expert-tp: must be 0 (threefold's engine), "
                                                                 "1 or --tp 2, got 4"),
    (["--model", "llama3-8b", "--tp", "2", "--expert-tp", "1"], "--expert-tp: set without --moe-experts"),
    (["--model", "mixtral-8x7b", "--tp", "4", "--pp", "4", "--ep", "8", "--sequence-parallel", "--expert-tp", "4"],
     "--ep: 8 does not divide --cp × --dp = 4"),
])
def test_bad_expert_tp_is_one_line_and_exit_2(capsys, flags, message):
    config.note_once.cache_clear()
    code = main(["estimate", "--gpu", "h100-sxm", "--global-batch", "256", "--num-gpus", "64", "--micro-batch", "1",
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_batch_line_takes_expert_tp(tmp_path, capsys):
    lines = tmp_path / "rows.jsonl"
    row = {"model": "mixtral-8x7b", "gpu": "h100-sxm", "num_gpus": 64, "global_batch": 256, "tp": 2, "ep": 8,
           "sequence_parallel": True, "micro_batch": 1}
    lines.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, expert_tp=0)) + "\n")
    assert main(["estimate", "--batch", str(lines)]) == 0
    megatron, engine = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (megatron["layout"]["expert_tp"], engine["layout"]["expert_tp"]) == (2, 0)
    assert megatron["memory_gib"]["params"] < engine["memory_gib"]["params"]


def test_plan_prices_megatron_cores_grid_and_the_engines_for_a_config(tmp_path, capsys):
    flags = ["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "32", "--global-batch", "64",
             "--tp", "2", "--pp", "1", "--json"]
    assert main(flags) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["layouts"] and all(row["layout"]["expert_tp"] in (1, 2) and row["layout"]["sequence_parallel"]
                                    for row in found["layouts"])
    path = tmp_path / "moe.toml"
    config.note_once.cache_clear()
    assert main(flags + ["--config-out", str(path)]) == 0
    engine = json.loads(capsys.readouterr().out)
    # the engine runs the folding (expert_tp 1 with ep a multiple of tp) and its own placement, not
    # experts split over tp: the config is the fastest of those
    written = engine["config_out"]
    assert written["layout"].startswith("TP=2") and "ETP=2" not in written["layout"]
    assert path.exists() and "tp = 2" in path.read_text()
    for flag in (["--expert-tp", "0"], ["--expert-tp", "1"]):  # either placement, fixed, is written as it is
        config.note_once.cache_clear()
        assert main(flags + flag + ["--config-out", str(path)]) == 0
        found = json.loads(capsys.readouterr().out)
        assert all(row["layout"]["expert_tp"] == int(flag[1]) for row in found["layouts"])
        assert ("expert_tp = 1" in path.read_text()) == (flag[1] == "1")


def test_the_search_never_prices_megatron_cores_grid_under_tp_without_sp():
    work = costs.Workload(MIXTRAL, global_batch=64)
    from threefold.plan import search

    layouts = search.candidate_layouts(work, 16, {"pp": 1})
    tp, sp, expert_tp = (np.asarray(getattr(layouts, k)) for k in ("tp", "sequence_parallel", "expert_tp"))
    under_tp = tp > 1  # both of Megatron-Core's placements, split (expert_tp = tp) and whole (1), with SP only
    assert under_tp.any() and np.all(sp[under_tp]) and set(expert_tp[under_tp] == tp[under_tp]) == {True, False}
    assert np.all((expert_tp[under_tp] == tp[under_tp]) | (expert_tp[under_tp] == 1))
    engine = search.candidate_layouts(work, 16, {"pp": 1, "expert_tp": 0})
    assert (~np.asarray(engine.sequence_parallel)[np.asarray(engine.tp) > 1]).any()


@pytest.mark.parametrize("flags, message", [
    (["--tp", "2", "--no-sequence-parallel"], "--no-sequence-parallel: Megatron-Core, whose experts plan prices by "
                                              "default, runs an MoE model under tp only with sequence parallelism; "
                                              "add --expert-tp 0 for threefold's engine"),
    (["--tp", "2", "--expert-tp", "4"], "--expert-tp: must be 0 (threefold's engine), 1 or --tp 2, got 4"),
    (["--expert-tp", "-1"], "--expert-tp: must be 0 (threefold's engine), 1 or a tp size, got -1"),
])
def test_bad_expert_tp_in_plan_is_one_line_and_exit_2(capsys, flags, message):
    code = main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "64", "--global-batch", "256",
                 *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: {message}", err


def test_the_search_folds_ep_where_megatron_cores_grid_allows_it():
    """ep spans cp·dp on Megatron-Core's grid (tp·cp·dp with whole experts); the engine's stays
    within dp. At tp 1 under cp the grid's ep group is consecutive ranks (the engine's cp apart):
    its rows are Megatron-Core's (expert_tp 1), but for ep 1, where the two price alike."""
    from threefold.plan import search

    work = costs.Workload(MIXTRAL, global_batch=64)
    rows = search.candidate_layouts(work, 16, {"pp": 2, "cp": 2, "tp": 1})  # dp 4
    ep, expert_tp = np.asarray(rows.ep), np.asarray(rows.expert_tp)
    assert set(ep) == {1, 2, 4, 8} and set(expert_tp[ep > 1]) == {1} and set(expert_tp[ep == 1]) == {0}
    engine = search.candidate_layouts(work, 16, {"pp": 2, "cp": 2, "tp": 1, "expert_tp": 0})
    assert set(np.asarray(engine.ep)) == {1, 2, 4}
    folded = search.candidate_layouts(work, 16, {"pp": 2, "tp": 2, "expert_tp": 1})  # tp 2 × dp 4
    assert set(np.asarray(folded.ep)) == {1, 2, 4, 8}
    for i in range(0, len(np.asarray(rows.tp)), 97):  # every row is one the layout check takes
        costs.check_layout(MIXTRAL, rows.take(i), 64, 16)


def test_the_why_column_places_the_ep_group_on_megatron_cores_grid(capsys):
    """Folded over cp, EP=8 is eight consecutive ranks, one node: not "crosses nodes" (tp·cp·ep,
    the engine's spacing, would be 64 ranks)."""
    assert main(["plan", "--model", "mixtral-8x7b", "--global-batch", "1024", "--gpu", "h100-sxm", "--num-gpus", "64",
                 "--pp", "2", "--dp", "4", "--cp", "8", "--ep", "8", "--top", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layouts"][0]
    assert "ETP=1" in row["describe"] and "EP=8 within a node" in row["why"], row


def test_shared_experts_on_megatron_cores_grid_are_a_tensor_parallel_mlp():
    """Megatron-Core's shared experts are a dense MLP over tp: its 2½ collectives (1½ of residual
    width) join the MoE block's; the engine's shared experts are whole on every tp rank (none)."""
    one = dict(layers=1, sequence_parallel=True, recompute="none", embedding=False, moe_layers=1)
    assert costs.tp_collectives_per_microbatch(**one, expert_tp=1, shared_experts=1) == 2.5 + 2.5 + 1.5
    assert costs.tp_residual_collectives_per_microbatch(**one, expert_tp=1, shared_experts=1) == 1.5 + 1.5 + 1.5
    assert costs.tp_collectives_per_microbatch(**one, expert_tp=0, shared_experts=1) == 3.5 + 1.5
    with_shared = dataclasses.replace(MIXTRAL, moe_shared_experts=1)
    layout = costs.Layout.named(tp=2, dp=8, ep=8, sequence_parallel=True, micro_batch=1, expert_tp=1)
    tp_bytes = [costs.estimate(costs.Workload(model, 64), layout, get_gpu("h100-sxm"))["tp_bytes"]
                for model in (MIXTRAL, with_shared)]
    microbatches, activations = 64 // 8, MIXTRAL.seq_len * MIXTRAL.hidden * 2  # bf16
    assert tp_bytes[1] - tp_bytes[0] == pytest.approx(microbatches * MIXTRAL.layers * 2.5 * 1 * activations)


def test_tp_comm_overlap_leaves_split_experts_gathers_exposed():
    """Megatron-Core's --tp-comm-overlap rings the tp linear layers' collectives, not its token
    dispatcher's gathers of the dispatched rows: with split experts those stay exposed."""
    gpu, tp_s = get_gpu("h100-sxm"), {}
    for overlap in (False, True):
        work = dataclasses.replace(costs.Workload(MIXTRAL, 256), tp_comm_overlap=overlap)
        for expert_tp in (1, 2):
            layout = costs.Layout.named(tp=2, dp=32, ep=8, sequence_parallel=True, zero=1, micro_batch=1,
                                        expert_tp=expert_tp)
            est = costs.estimate(work, layout, gpu)
            tp_s[overlap, expert_tp] = est["tp_s"], est["tp_exposed_s"]
    whole, split = tp_s[True, 1], tp_s[True, 2]
    assert whole[1] < 0.02 * whole[0]  # whole experts: everything is ringed behind the products
    assert split[1] > 0.5 * (split[0] - whole[0]) > 0  # split experts: their gathers' time stays exposed


def test_estimate_refuses_megatron_cores_grid_without_sp_only_when_both_are_given(capsys):
    config.note_once.cache_clear()
    flags = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "256", "--num-gpus", "64",
             "--micro-batch", "1", "--tp", "2", "--ep", "8", "--no-sequence-parallel"]
    assert main(flags + ["--expert-tp", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --no-sequence-parallel: Megatron-Core's expert grid (--expert-tp 2) runs an MoE model under --tp only "
        "with sequence parallelism; --expert-tp 0 for threefold's engine, which runs without")
    assert main(flags + ["--json"]) == 0  # a run that says no SP and not its grid: Megatron-Core's needed SP
    out, err = capsys.readouterr()
    assert json.loads(out)["layout"]["sequence_parallel"] and "estimating with it" in err


def test_experts_too_narrow_to_split_default_to_whole_experts(capsys):
    """A width tp does not divide cannot be split (Megatron-Core refuses it): the default takes
    whole experts (expert_tp 1), in estimate and in plan."""
    result, _ = _estimate_json(capsys, "--num-gpus", "64", "--tp", "2", "--ep", "8", "--sequence-parallel",
                               "--moe-ffn", "1407")
    assert result["layout"]["expert_tp"] == 1
    from threefold.plan import search

    narrow = dataclasses.replace(MIXTRAL, moe_ffn=1407)
    layouts = search.candidate_layouts(costs.Workload(narrow, 64), 16, {"pp": 1, "tp": 2})
    assert set(np.asarray(layouts.expert_tp)) == {1}


def test_split_backward_keeps_the_grids_gathered_rows():
    """What B keeps for W on Megatron-Core's grid: no gathered sequence for the router (it reads
    this rank's positions), and with split experts the k dispatched rows of the tp group."""
    tokens, t, k, h = 4096, 2, MIXTRAL.moe_top_k_experts, MIXTRAL.hidden
    engine, whole, split = (costs.moe_weight_input_bytes(MIXTRAL, tokens, t, True, "none", 2, expert_tp)
                            for expert_tp in (0, 1, 2))
    router_gathered = tokens * (h * 2 - h * 2 / t)  # the engine's router reads the whole sequence
    assert engine - whole == pytest.approx(router_gathered)
    assert split - whole == pytest.approx(tokens * 2 * k * h * (1 - 1 / t))


def test_split_backward_captures_the_grids_gradients():
    """What B captures for W on Megatron-Core's grid (costs.captured_gradient_bytes): the router's
    logits' gradient of this rank's positions only; the shared experts' output gradient whole (a
    tp MLP's partial sum); with split experts their output rows of the tp group's gathered rows."""
    shared = dataclasses.replace(MIXTRAL, moe_shared_experts=1)
    tokens, t, d, h, k, e = 4096, 2, 2, MIXTRAL.hidden, MIXTRAL.moe_top_k_experts, MIXTRAL.moe_experts
    engine, whole, split = (costs.captured_gradient_bytes(shared, tokens, t, True, d, 4, expert_tp)[1]
                            for expert_tp in (0, 1, 2))
    assert whole - engine == pytest.approx(tokens * (d * h * (1 - 1 / t) - 4 * e * (1 - 1 / t)))
    assert split - whole == pytest.approx(tokens * d * h * (1 - 1 / t) * k)


def test_op_level_recomputation_gathers_the_grids_attention_input_again():
    one = dict(layers=1, sequence_parallel=True, embedding=False, moe_layers=1, expert_tp=1)
    assert costs.tp_collectives_per_microbatch(recompute="op", **one) == \
        costs.tp_collectives_per_microbatch(recompute="none", **one) + 0.5


def test_zero3_gathers_folded_experts_where_the_dense_weights_have_one_replica():
    """tp 2 · dp 1 with whole experts: the experts have tp·dp/ep = 2 replicas, the dense weights
    one. ZeRO-3 shards and gathers the experts' units alone: two blocks' experts gathered, one
    block's gradients, beside ZeRO-1's whole experts."""
    work, gpu = costs.Workload(MIXTRAL, 64), get_gpu("h100-sxm")
    states = {}
    for zero in (1, 3):
        layout = costs.Layout.named(tp=2, dp=1, sequence_parallel=True, zero=zero, micro_batch=1, expert_tp=1)
        est = costs.estimate(work, layout, gpu)
        states[zero] = est["params_bytes"], est["grads_bytes"]
    experts = MIXTRAL.layers * MIXTRAL.moe_experts * EXPERT_NUMEL  # every expert, whole on both tp ranks
    block = MIXTRAL.moe_experts * EXPERT_NUMEL
    assert states[1][0] - states[3][0] == pytest.approx(experts / 2 * 2 - 2 * block * 2)  # bf16 weights
    assert states[1][1] - states[3][1] == pytest.approx(experts / 2 * 4 - block * 4)  # fp32 gradients


def test_rank_0_counts_the_moe_blocks_of_each_chunk_it_holds():
    """DeepSeek-V3-like's first three blocks are dense. At pp 16 rank 0 holds blocks 0-3 under
    1F1B (1 MoE block); under interleaving with 2 chunks blocks 0-1 and 32-33 (2); DualPipeV's V
    gives it blocks 0-1 and 59-60 (2)."""
    model = get_preset("deepseek-v3-like")
    p, v_shape = np.array([16, 16, 16]), np.array([False, False, True])
    assert list(costs.moe_blocks_on_rank_0(model, model.layers, np.array([4, 4, 4]), p, np.array([1, 2, 2]),
                                           v_shape)) == [1, 2, 2]


def test_a_tp_1_grid_over_cp_is_its_own_placement(tmp_path, capsys):
    """At tp 1 under cp Megatron-Core's ep group is consecutive ranks, the engine's default cp apart:
    estimate defaults to the grid and labels it, and plan --config-out writes it as the engine's
    folding (parallel.expert_tp = 1), which the engine's loader takes."""
    result, _ = _estimate_json(capsys, "--num-gpus", "64", "--cp", "8", "--ep", "8", "--zero", "1")
    assert result["layout"]["expert_tp"] == 1
    config.note_once.cache_clear()
    assert main(["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "256", "--num-gpus", "64",
                 "--micro-batch", "1", "--cp", "8", "--ep", "8", "--zero", "1"]) == 0
    assert "EP=8 ETP=1 CP=8" in capsys.readouterr().out
    path = tmp_path / "grid.toml"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "64", "--global-batch", "256",
                 "--tp", "1", "--pp", "1", "--cp", "8", "--ep", "8", "--expert-tp", "1", "--config-out", str(path)]) == 0
    written = path.read_text()
    assert "cp = 8" in written and "ep = 8" in written and "expert_tp = 1" in written
    from threefold.configure import load_config

    parallel = load_config(str(path), []).parallel
    assert parallel.experts_folded and parallel.cp == 8 and parallel.ep == 8


def test_hybrid_sharding_on_the_grid_needs_whole_ep_groups_of_its_own_ranks():
    """Megatron-Core's grid: (tp / expert-tp)·cp·dp_shard ranks must hold whole ep groups; the
    engine's rule (dp_shard a multiple of ep) would refuse tp 2 · dp 32 · ep 8 at dp_shard 4."""
    costs.check_hybrid_sharding(4, 1, 32, 8, tp=2, cp=1, expert_tp=1)  # 2·4 = 8: whole ep groups
    with pytest.raises(config.ConfigError, match="multiple of --ep 8"):
        costs.check_hybrid_sharding(2, 1, 32, 8, tp=2, cp=1, expert_tp=1)
    with pytest.raises(config.ConfigError, match="a multiple of --ep 8, got 4"):
        costs.check_hybrid_sharding(4, 1, 32, 8)  # the engine's rule


def test_the_table_says_which_placement_it_estimates(capsys):
    """Without --json, estimate says once that it took Megatron-Core's grid (the title's ETP=2),
    and how to estimate the engine's; nothing where the grid prices as the engine's."""
    flags = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--global-batch", "256", "--num-gpus", "64",
             "--micro-batch", "1", "--ep", "8"]
    config.note_once.cache_clear()
    assert main(flags + ["--tp", "2", "--sequence-parallel"]) == 0
    out, err = capsys.readouterr()
    assert "EP=8 ETP=2" in out and err.strip() == (
        "note: --expert-tp not given: estimating Megatron-Core's expert grid, ETP=2 (each expert split over the tp "
        "ranks); --expert-tp 0 estimates threefold's engine's default, experts whole on every tp rank (it runs "
        "ETP=1 too, parallel.expert_tp = 1, where ep is a multiple of tp × cp)")
    config.note_once.cache_clear()
    assert main(flags) == 0 and capsys.readouterr().err == ""  # tp 1, cp 1: alike
