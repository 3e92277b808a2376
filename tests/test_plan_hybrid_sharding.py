"""Hybrid sharding (HSDP, --dp-shard) in the planner: the same formulas as the engine's bytes
(tests/test_equivalence.py holds the engine to them), the memory of a shard group, the
all-reduce between the groups on its own link, the search and the config it writes."""
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


def estimate(dp_shard, dp=512, cp=1, global_batch=1024, gpu=H100):
    layout = costs.Layout.named(recompute="op", dp=dp, cp=cp, zero=3, micro_batch=1, dp_shard=dp_shard)
    return costs.estimate(costs.Workload(LLAMA3_8B, global_batch), layout, gpu)


def test_one_shard_group_of_all_ranks_is_zero3():
    """dp_shard = dp is ZeRO-3 itself, to the last digit of every figure."""
    plain, whole = estimate(0), estimate(512)
    for key, value in plain.items():
        if isinstance(value, float):
            assert whole[key] == pytest.approx(value, rel=1e-12), key


@pytest.mark.parametrize("dp_shard, cp", [(8, 1), (64, 1), (4, 2)])
def test_states_shard_over_the_group_and_bytes_add_the_all_reduce_between_groups(dp_shard, cp):
    """States: ZeRO-3 over dp_shard × cp ranks. Bytes: costs.dp_bytes_per_step(shard=…), the
    formula the engine's ledger equals: ZeRO-3 over the group plus, per micro-batch, each shard
    all-reduced between the dp / dp_shard groups."""
    dp = 512 // cp
    est, plain = estimate(dp_shard, dp=dp, cp=cp), estimate(0, dp=dp, cp=cp)
    states = lambda e: e["optimizer_bytes"]  # noqa: E731 (the gathered units add to params and grads alike)
    assert states(est) == pytest.approx(states(plain) * dp / dp_shard)
    numel = plain["dp_bytes"] / costs.dp_bytes_per_step(1, dp * cp, 3, est["microbatches"], 4, 2)
    assert est["dp_bytes"] == pytest.approx(costs.dp_bytes_per_step(numel, dp * cp, 3, est["microbatches"], 4, 2,
                                                                     shard=dp_shard * cp))
    between = costs.hsdp_all_reduce_bytes(numel, dp_shard * cp, dp / dp_shard, est["microbatches"])
    assert between == pytest.approx(2 * (dp / dp_shard - 1) / (dp / dp_shard) * numel / (dp_shard * cp) * 4
                                    * est["microbatches"])


@pytest.mark.parametrize("zero", [1, 2])
def test_zero1_and_2_shard_over_the_group_and_all_reduce_the_steps_shards_once(zero):
    """ZeRO-1, 2 over groups of 8 of 512 replicas (Megatron-Core's distributed optimizer
    instances): the optimizer states over 8 ranks, not 512; the bytes those of ZeRO over 8 and one
    all-reduce of the step's shard between the 64 groups (the engine's ledger equals the same
    formula: tests/test_equivalence.py's dp4-zero1-shard2 and dp4-zero2-shard2). Not faster at 512:
    a ring over the nodes sends through all eight NICs of a node at once, and the all-reduce
    between the groups, each GPU over its own NIC, moves more a NIC (0.30 s of collectives against
    0.16 at ZeRO-1). At 8,192 replicas it is: Megatron-Core's bucket, 1M parameters a replica,
    outgrows the model, so plain ZeRO reduces one bucket after the whole backward, while a group of
    8 reduces 40M-parameter buckets behind it (dp exposed 0.16 s against 0.003 s at ZeRO-1)."""
    def one(dp_shard, dp=512, global_batch=1024):
        layout = costs.Layout.named(recompute="op", dp=dp, zero=zero, micro_batch=1, dp_shard=dp_shard)
        return costs.estimate(costs.Workload(LLAMA3_8B, global_batch), layout, H100)

    plain, hybrid = one(0), one(8)
    assert hybrid["optimizer_bytes"] == pytest.approx(plain["optimizer_bytes"] * 64)
    m = hybrid["microbatches"]
    numel = plain["dp_bytes"] / costs.dp_bytes_per_step(1, 512, zero, m, 4, 2)
    in_group = costs.dp_bytes_per_step(numel, 8, zero, m, 4, 2)
    between = 2 * 63 / 64 * numel / 8 * 4  # once a step, not once a micro-batch
    assert hybrid["dp_bytes"] == pytest.approx(in_group + between)
    assert hybrid["dp_bytes"] == pytest.approx(costs.dp_bytes_per_step(numel, 512, zero, m, 4, 2, shard=8))
    assert hybrid["dp_s"] > plain["dp_s"]
    plain, hybrid = one(0, 8192, 16384), one(8, 8192, 16384)
    assert hybrid["dp_exposed_s"] < plain["dp_exposed_s"] / 10 and hybrid["step_time_s"] < plain["step_time_s"]
    assert "shard=8" in costs.Layout.named(dp=512, zero=zero, dp_shard=8).describe()


def test_at_thousands_of_ranks_hybrid_sharding_saves_the_rings_latency():
    """ZeRO-3 over 8,192 ranks pays a 8,191-step ring per gather and reduce-scatter; shard groups
    of 8 (a node) ring over 7 NVLink steps and all-reduce between 1,024 groups by NCCL's tree:
    less time in the collectives, for 1/8 of the states instead of 1/8,192."""
    fsdp, hsdp = estimate(0, dp=8192, global_batch=16384), estimate(8, dp=8192, global_batch=16384)
    assert hsdp["dp_s"] < fsdp["dp_s"] / 2 and hsdp["step_time_s"] < fsdp["step_time_s"]
    assert hsdp["optimizer_bytes"] == pytest.approx(1024 * fsdp["optimizer_bytes"])
    no_latency = H100.__class__(**{**H100.__dict__, "intra_node_latency_s": 0.0, "inter_node_latency_s": 0.0})
    fsdp_bare = estimate(0, dp=8192, global_batch=16384, gpu=no_latency)
    assert fsdp["dp_s"] - fsdp_bare["dp_s"] > 1.0  # the rings' latency is what hybrid sharding saves


def test_the_search_offers_every_shard_group_at_zero3_and_a_given_one_at_every_zero_stage():
    work = costs.Workload(LLAMA3_8B, 1024)
    layouts = search.candidate_layouts(work, 64, {"tp": 1, "pp": 1, "cp": 1})
    shards = np.asarray(layouts.dp_shard)
    assert set(shards[shards > 0]) == {2, 4, 8, 16, 32}  # every divisor of dp = 64 from 2 up, below 64
    assert set(np.asarray(layouts.zero)[shards > 0]) == {3}
    fixed = search.candidate_layouts(work, 64, {"tp": 1, "pp": 1, "cp": 1, "dp_shard": 8})
    assert set(np.asarray(fixed.dp_shard)) == {8} and set(np.asarray(fixed.zero)) == {1, 2, 3}
    moe = costs.Workload(costs.ModelConfig(layers=4, hidden=512, heads=8, vocab_size=1000, seq_len=256, moe_experts=8,
                                           moe_top_k=2), 64)
    found = search.candidate_layouts(moe, 64, {})
    hybrid = np.asarray(found.dp_shard) > 0
    shard, ep = np.asarray(found.dp_shard)[hybrid], np.asarray(found.ep)[hybrid]
    assert (ep > 1).any() and not (shard % ep).any()  # a shard group holds whole ep groups
    fixed = search.candidate_layouts(work, 64, {"tp": 1, "pp": 1, "cp": 1, "dp_shard": 64})
    assert not np.asarray(fixed.dp_shard).any() and len(np.asarray(fixed.dp))  # one group of all 64: plain ZeRO-3


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("flags, message", [
    (["--zero", "0", "--dp-shard", "8"], "--dp-shard: hybrid sharding splits ZeRO's states over groups of 8 dp ranks; "
                                         "it needs --zero 1, 2 or 3, got 0 (DDP keeps every state whole)"),
    (["--zero", "3", "--dp-shard", "3"], "--dp-shard: must divide --dp 64 and be at least 2"),
    (["--zero", "3", "--dp-shard", "1"], "--dp-shard: must divide --dp 64 and be at least 2"),
    (["--zero", "3", "--dp-shard", "-8"], "--dp-shard: must not be negative"),
    (["--zero", "3", "--dp-shard", "4", "--ep", "8", "--model", "mixtral-8x7b"],
     "--dp-shard: a shard group holds whole expert-parallel groups, so it must be a multiple of --ep 8, got 4"),
])
def test_bad_hybrid_sharding_is_one_line(capsys, flags, message):
    model = [] if "--model" in flags else ["--model", "llama3-8b"]
    code, out, err = run(capsys, "estimate", *model, "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "64",
                         *flags)
    lines = err.strip().splitlines()
    assert code == 2 and not out and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("zero", [3, 2])
def test_estimate_and_batch_and_plan_take_the_shard_group(capsys, tmp_path, zero):
    args = ["--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "64", "--zero", str(zero)]
    code, out, _ = run(capsys, "estimate", *args, "--dp-shard", "8", "--json")
    one = json.loads(out)
    assert code == 0 and one["layout"]["dp_shard"] == 8
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps({"model": "llama3-8b", "global_batch": 64, "gpu": "h100-sxm", "num_gpus": 64,
                                 "zero": zero, "dp_shard": 8}) + "\n")
    code, out, _ = run(capsys, "estimate", "--batch", str(batch))
    assert code == 0 and json.loads(out)["step_time_s"] == one["step_time_s"]
    path = tmp_path / "run.toml"
    code, out, err = run(capsys, "plan", *args, "--dp-shard", "8", "--dp", "64", "--top", "1", "--json",
                         "--config-out", str(path))
    assert code == 0, err
    best = json.loads(out)["layouts"][0]
    assert ("hsdp=8" if zero == 3 else "shard=8") in best["describe"] and best["layout"]["dp_shard"] == 8
    cfg = load_config(path)
    assert (cfg.parallel.zero, cfg.parallel.dp_shard, cfg.parallel.dp_replicate) == (zero, 8, cfg.parallel.dp // 8)


@pytest.mark.parametrize("flags, message", [
    (["--dp-shard", "3"], "--dp-shard 3: no ZeRO layout of this model on 64 GPUs has a dp that 3 divides"),
    (["--dp-shard", "8", "--zero", "0"], "it needs --zero 1, 2 or 3, got 0"),
    (["--dp-shard", "1"], "--dp-shard: must be at least 2 (a group of one rank shards nothing), got 1"),
    (["--dp-shard", "-2"], "--dp-shard: must not be negative"),
    (["--dp-shard", "16", "--dp", "8"], "--dp-shard: must divide --dp 8 and be at least 2"),
])
def test_plan_refuses_a_shard_group_no_layout_takes_in_one_line(capsys, flags, message):
    code, _, err = run(capsys, "plan", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm",
                       "--num-gpus", "64", *flags)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_plan_without_hybrid_sharding_when_fixed_at_zero():
    work = costs.Workload(LLAMA3_8B, 1024)
    assert not np.asarray(search.candidate_layouts(work, 64, {"dp_shard": 0}).dp_shard).any()
    assert np.asarray(search.candidate_layouts(work, 64, {}).dp_shard).any()


def test_a_run_of_the_engine_is_priced_with_its_shard_groups():
    """compare (the closed loop) and the preflight's memory read the config's dp_shard."""
    from threefold.plan.compare import run_layout
    from threefold.train.preflight import rank_memory

    sets = ["model.preset=tiny", "model.vocab_size=4096", "parallel.dp=8", "parallel.zero=3", "train.global_batch=16",
            "train.micro_batch=2"]
    plain, hybrid = load_config(None, sets), load_config(None, sets + ["parallel.dp_shard=2"])
    assert int(run_layout(hybrid)[1].dp_shard) == 2 and int(run_layout(plain)[1].dp_shard) == 0
    assert rank_memory(hybrid)["optimizer"] == pytest.approx(4 * rank_memory(plain)["optimizer"])


def test_an_moe_model_at_ep1_is_priced_as_the_engine_runs_it():
    """The experts shard over the same groups as the rest: their states 1/(dp_shard·cp), the
    preflight's memory scaled as the dry run measures it (tests/test_dryrun.py)."""
    from threefold.train.preflight import rank_memory

    sets = ["model.preset=tiny", "model.vocab_size=256", "model.seq_len=32", "model.layers=4", "model.moe_experts=4",
            "model.moe_top_k=2", "parallel.dp=4", "parallel.zero=3", "train.global_batch=16", "train.micro_batch=2"]
    plain, hybrid = rank_memory(load_config(None, sets)), rank_memory(load_config(None, sets + ["parallel.dp_shard=2"]))
    assert hybrid["optimizer"] == pytest.approx(2 * plain["optimizer"])


@pytest.mark.parametrize("dp_shard", [2, 4])
def test_an_moe_model_at_ep2_shards_its_experts_over_the_group_ranks_that_hold_them(dp_shard):
    """dp 8, ep 2: plain ZeRO-3 keeps the dense optimizer states over 8 ranks and the experts'
    over their 4; groups of dp_shard ranks keep the dense over dp_shard and the experts over
    dp_shard / 2, so both are 8 / dp_shard times larger (the dry run holds the engine to the
    same counts, tests/test_dryrun.py)."""
    from threefold.train.preflight import rank_memory

    sets = ["model.preset=tiny", "model.vocab_size=256", "model.seq_len=32", "model.layers=4", "model.moe_experts=4",
            "model.moe_top_k=2", "parallel.dp=8", "parallel.ep=2", "parallel.zero=3", "train.global_batch=32",
            "train.micro_batch=2"]
    plain = rank_memory(load_config(None, sets))
    hybrid = rank_memory(load_config(None, sets + [f"parallel.dp_shard={dp_shard}"]))
    assert hybrid["optimizer"] == pytest.approx(8 / dp_shard * plain["optimizer"])


@pytest.mark.parametrize("extra", [[], ["parallel.dp_shard=4"], ["parallel.dp_shard=2"],
                                   ["parallel.cp=2", "parallel.dp_shard=4"],
                                   ["train.dtype=bfloat16"], ["train.dtype=bfloat16", "parallel.dp_shard=4"],
                                   ["train.dtype=bfloat16", "parallel.zero=1"]])
def test_the_estimates_dp_bytes_of_an_moe_model_at_ep2_are_the_dry_run_predictions(extra):
    """estimate()'s dp bytes (the search's) equal predict_rank's, which the dry run holds the engine
    to (tests/test_dryrun.py): dense and expert gradients, their gathers and the all-reduce between
    the groups, over dp 8 at ep 2, with and without hybrid sharding and context parallelism. In
    bf16 the engine's autocast gathers its fp32 weights (compare's run_layout prices precision
    "autocast"; as "mixed", 16-bit gathers, ZeRO-1 came to 0.75 of the engine's bytes)."""
    from threefold.plan.compare import run_layout
    from threefold.plan.dryrun_predict import predict_rank

    cfg = load_config(None, ["model.preset=tiny-moe", "model.vocab_size=4096", "parallel.dp=8", "parallel.ep=2",
                             "parallel.zero=3", "train.global_batch=16", "train.micro_batch=2"] + extra)
    want = predict_rank(cfg, 0)["comm_bytes"]
    est = costs.estimate(*run_layout(cfg), H100)
    assert est["dp_bytes"] == pytest.approx(sum(v for k, v in want.items() if k in ("dp", "dp+cp")), rel=1e-12)


def test_experts_replicated_between_groups_do_not_change_how_the_dense_units_are_exposed(capsys):
    """At dp_shard = ep the experts are plain data parallelism between the groups and the dense
    weights ZeRO-3 inside them, on other links behind the same backward. One last MoE layer of
    tiny experts (16 wide) in place of a dense FFN may not expose more dp time than the dense
    model: priced with the experts' ZeRO stage, the dense units' exposure had gone 3.35 → 4.40 s."""
    args = ["estimate", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "64", "--global-batch", "128",
            "--zero", "3", "--dp-shard", "8", "--inter-node-gbps", "25", "--json"]
    assert main(args) == 0
    dense = json.loads(capsys.readouterr().out)
    assert main(args + ["--moe-experts", "8", "--moe-first-dense", "31", "--moe-ffn", "16", "--ep", "8"]) == 0
    moe = json.loads(capsys.readouterr().out)
    assert moe["comm"]["dp_bytes"] < dense["comm"]["dp_bytes"]
    assert moe["time_s"]["dp_exposed"] <= dense["time_s"]["dp_exposed"]
