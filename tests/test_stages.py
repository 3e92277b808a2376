"""Balanced pipeline stages: the split that minimises the slowest stage on measured or modelled
costs (schedule.balanced_split, PipeDream's partitioner), under a memory limit; the split by
hand (``parallel.stage_layers``), validated; the measurement itself (stages.py)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from threefold.config import ConfigError
from threefold.configure import load_config
from threefold.parallel.layout import check_pipeline
from threefold.parallel.pipeline.schedule import LayerCosts, balanced_split, describe_split, partition, spans_of

TINY = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.vocab_size=64", "model.seq_len=16",
        "train.micro_batch=2", "train.global_batch=8", "parallel.timeout_s=60"]


def costs(blocks, head, embed=0.0, **extra) -> LayerCosts:
    return LayerCosts(embed, tuple(blocks), head, source="test", **extra)


def test_the_slowest_stage_is_as_fast_as_it_can_be():
    assert balanced_split(costs([1, 1, 1, 1], 0.2), 2) == (2, 2)  # a cheap head: even blocks
    assert balanced_split(costs([1, 1, 1, 1], 1.5), 2) == (3, 1)  # a head worth 1.5 blocks
    assert balanced_split(costs([1, 1, 1, 1], 0.0, embed=1.5), 2) == (1, 3)  # an expensive embedding
    assert balanced_split(costs([4, 1, 1, 1, 1], 0.0), 2) == (1, 4)  # uneven blocks: 4 | 4
    assert balanced_split(costs([1] * 8, 1.0), 4) == (2, 2, 2, 2)  # 2, 2, 2, 3: no split does better


def test_memory_limit_constrains_the_split():
    # the first stage holds 3 micro-batches of activations (1F1B on pp=2 with m ≥ 2: 2), the last 1
    tight = costs([1, 1, 1, 1], 2.0, block_state_bytes=(10,) * 4, block_activation_bytes=(5,) * 4)
    assert balanced_split(tight, 2) == (3, 1)  # time alone: the head is worth two blocks
    assert balanced_split(tight, 2, memory_limit=45, in_flight=[2, 1]) == (2, 2)  # 3 blocks need 60 bytes there
    with pytest.raises(ConfigError, match="no split of the 4 blocks over 2 stages fits"):
        balanced_split(tight, 2, memory_limit=10, in_flight=[2, 1])


def test_describe_names_the_bottleneck_and_by_how_much():
    line = describe_split(spans_of([3, 1]), costs([1, 1, 1, 1], 0.0), unit="", scale=1.0)
    assert line.startswith("stage 0: embedding + blocks 0-2 3; stage 1: block 3 + head 1")
    assert "stage 0 is the slowest, 50% above the mean" in line


@pytest.mark.parametrize("stage_layers", ["[1,3]", "[[0],[1,2,3]]", "1,3"])  # 1,3: as estimate's --stage-layers
def test_stage_layers_set_the_split(stage_layers):
    cfg = load_config(None, TINY + ["parallel.pp=2", f"parallel.stage_layers={stage_layers}"])
    spans = partition(cfg.model, 2, 1, cfg.parallel.stage_layers)
    assert [list(s.blocks) for s in spans] == [[0], [1, 2, 3]]


@pytest.mark.parametrize("stage_layers, message", [
    ("[2,1]", "parallel.stage_layers: [2, 1] must give every stage at least one block and add up to the model's 4"),
    ("[4,0]", "parallel.stage_layers: [4, 0] must give every stage at least one block"),
    ("[1,1,2]", "parallel.stage_layers: needs one entry per stage, 2 (pp × virtual_stages), got 3"),
    ("[[0,1],[3,2]]", "parallel.stage_layers: [[0, 1], [3, 2]] must cover every block 0..3 once, in order"),
    ("[[0,1],[1,2,3]]", "parallel.stage_layers: [[0, 1], [1, 2, 3]] must cover every block 0..3 once"),
    ("[[0,1],[]]", "parallel.stage_layers: expected a block count per stage"),
    ('"2,x"', "parallel.stage_layers: expected a list, got '2,x'"),
])
def test_bad_stage_layers_are_one_line(stage_layers, message):
    with pytest.raises(ConfigError) as err:
        check_pipeline(load_config(None, TINY + ["parallel.pp=2", f"parallel.stage_layers={stage_layers}"]))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_stage_layers_without_a_pipeline_is_refused():
    with pytest.raises(ConfigError, match="parallel.stage_layers: sets the blocks of each pipeline stage; it needs"):
        load_config(None, TINY + ["parallel.stage_layers=[2,2]"])


def test_bad_stage_layers_exit_2_before_any_process_starts():
    args = [sys.executable, "-m", "threefold.cli", "train", "--nproc", "2", "--no-progress"]
    args += [f"--set={o}" for o in TINY + ["parallel.pp=2", "parallel.stage_layers=[3,3]"]]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "parallel.stage_layers: [3, 3]" in done.stderr


def test_measured_costs_of_a_plain_model():
    """Every part is timed (positive), identical blocks get one cost, and a block's saved bytes
    are its activations: more than the hidden state it takes in, and not its weights."""
    from threefold.models.llama import Llama, cross_entropy
    from threefold.parallel.pipeline.stages import measure_layer_costs

    cfg = load_config(None, TINY)
    with torch.device("meta"):
        model = Llama(cfg.model)
    measured = measure_layer_costs(model, cfg, torch.device("cpu"), (2, 16, 32), cross_entropy)
    assert measured.embed > 0 and measured.head > 0 and len(set(measured.blocks)) == 1 and measured.blocks[0] > 0
    hidden_bytes = 2 * 16 * 32 * 4
    assert all(hidden_bytes < a < 100 * hidden_bytes for a in measured.block_activation_bytes)
    assert all(q.is_meta for q in model.parameters()) and model.head.weight is model.embed.weight  # left as it was


def test_on_a_cpu_a_parts_time_off_the_core_is_not_its_cost():
    """Timed by the process's CPU clock: a head whose loss sleeps 50 ms (as a rank waits for its
    turn on a shared core) costs what it computes, not the wall's 50 ms more."""
    import time

    from threefold.models.llama import Llama, cross_entropy
    from threefold.parallel.pipeline.stages import measure_layer_costs

    cfg = load_config(None, TINY)
    with torch.device("meta"):
        model = Llama(cfg.model)

    def sleepy_loss(logits, targets):
        time.sleep(0.05)
        return cross_entropy(logits, targets)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second OpenMP thread spin-waits on a loaded machine, on the process's CPU clock
    try:
        measured = measure_layer_costs(model, cfg, torch.device("cpu"), (2, 16, 32), sleepy_loss)
    finally:
        torch.set_num_threads(threads)
    assert 0 < measured.head < 0.025 and "CPU time" in measured.source


def _reduced_costs_with_one_slow_rank():
    """run_stage_costs on a dp2 × pp2 mesh, each rank's measurement replaced by a known one: rank
    3's head took 10× the others' (a rank descheduled through its repeats)."""
    import torch.distributed as dist

    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.pipeline import stages

    rank = dist.get_rank()
    measured = LayerCosts(0.5, (1.0 + rank / 100,) * 4, 10.0 if rank == 3 else 1.0 + rank / 100, source="test",
                          block_activation_bytes=(8.0,) * 4)
    real, stages.measure_layer_costs = stages.measure_layer_costs, lambda *args, **kwargs: measured
    try:
        mesh = ParallelMesh({"dp": 2, "pp": 2}, rank=rank, timeout_s=30)
        got = stages.run_stage_costs(None, load_config(None, TINY + ["parallel.pp=2", "parallel.dp=2"]), mesh,
                                     Comm(mesh), None, (2, 16, 32))
    finally:
        stages.measure_layer_costs = real
    return got.embed, got.blocks, got.head, got.block_activation_bytes


def test_every_rank_balances_the_median_ranks_costs_not_the_slowest(distributed):
    """The stages are cut on the median over each mesh axis in turn (of two ranks, their mean):
    one slow rank moves it by a fraction, where the maximum took that rank's 10×."""
    results = distributed.run(4, _reduced_costs_with_one_slow_rank)
    assert all(r == results[0] for r in results)  # every rank cuts the model the same way
    embed, blocks, head, activation_bytes = results[0]
    assert embed == 0.5 and activation_bytes == (8.0,) * 4
    assert blocks == pytest.approx((1.015,) * 4)  # the four ranks' mean
    assert head == pytest.approx((1.00 + 1.01 + 1.02 + 10.0) / 4) and head < 4  # not 10


# --------------------------------------------------------------------------------------------
# parallel.stage_costs = "planner": the planner's seconds on a catalog GPU (plan/stage_costs.py)

PLANNED = ["parallel.stage_costs=planner", "parallel.stage_costs_gpu=h100-sxm", "train.dtype=bfloat16"]


def planner_config(overrides):
    return load_config(None, overrides + PLANNED)


@pytest.mark.parametrize("preset, layout", [
    ("llama3-8b", ["parallel.pp=4", "parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective"]),
    ("llama3-70b", ["parallel.pp=8", "parallel.tp=8", "train.recompute=full"]),
    # an MoE model with dense first layers: the last stage's blocks are MoE, the first's partly dense
    ("deepseek-v3-like", ["parallel.pp=8", "parallel.dp=8", "parallel.ep=8", "parallel.tp=2"]),
])
def test_planner_stage_costs_are_the_planners_own_figures(preset, layout):
    """The last stage's blocks and head cost, per micro-batch, what ``costs.estimate`` counts as
    that stage's compute and memory-bound time (its ``compute_s + memory_bound_s`` over the
    step's micro-batches), for the same layout on the same GPU."""
    from threefold.plan import costs
    from threefold.plan.compare import run_layout
    from threefold.plan.hardware import CATALOG
    from threefold.plan.stage_costs import planner_layer_costs

    cfg = planner_config([f"model.preset={preset}", "train.micro_batch=1", "train.global_batch=64"] + layout)
    planned = planner_layer_costs(cfg)
    work, layout_ = run_layout(cfg)
    layout_ = dataclasses.replace(layout_, ep=cfg.parallel.ep)
    est = costs.estimate(work, layout_, CATALOG["h100-sxm"])
    last_blocks = -(-cfg.model.layers // cfg.parallel.pp)  # the estimate's busiest stage: ceil(L / pp) blocks
    per_microbatch = (est["compute_s"] + est["memory_bound_s"]) / est["microbatches"]
    assert sum(planned.blocks[-last_blocks:]) + planned.head == pytest.approx(per_microbatch, rel=1e-12)
    assert planned.embed == 0.0 and "planner, h100-sxm bfloat16, micro-batch 1" in planned.source
    if cfg.model.moe_experts:  # dense and MoE blocks cost differently, each its own figure
        assert planned.blocks[0] != planned.blocks[-1] and len(set(planned.blocks)) == 2


def test_a_large_vocabulary_puts_fewer_blocks_on_the_last_stage():
    """Llama-3 8B's shape on 4 H100 stages: its 128K-token head costs about two blocks, so the
    last stage takes 7 of the 32; with a 4K vocabulary the head is cheap and the split is even."""
    from threefold.plan.stage_costs import planner_layer_costs

    def split(vocab):
        cfg = planner_config(["model.preset=llama3-8b", f"model.vocab_size={vocab}", "model.seq_len=8192",
                              "parallel.pp=4", "train.micro_batch=1", "train.global_batch=32"])
        planned = planner_layer_costs(cfg)
        return [len(s.blocks) for s in partition(cfg.model, 4, 1, None, planned)], planned.head / planned.blocks[0]

    (large, head_in_blocks), (small, _) = split(128256), split(4096)
    assert 1.5 < head_in_blocks < 2.5
    assert large[-1] < small[-1] == 8 and sum(large) == 32
    assert small == [8, 8, 8, 8]


def test_the_dry_run_splits_on_the_planner_and_predicts_the_same_split():
    """The engine (here in a dry run: fake tensors, nothing timed) cuts the model on the
    planner's costs and says so; ``dryrun --compare``'s prediction uses the same split, so the
    parameters match exactly. For this tiny model with a 4K vocabulary the planner puts 5 blocks
    before the head's stage (its head is worth 2.7 blocks on an H100, 3.8 by FLOPs) where FLOPs put 6."""
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config, dry_run_rank, stage_split_note

    tiny = ["model.layers=8", "model.hidden=64", "model.heads=4", "model.vocab_size=4096", "model.seq_len=128",
            "parallel.pp=2", "train.micro_batch=2", "train.global_batch=8"]
    cfg = dry_run_config(planner_config(tiny), 2)
    assert [len(s.blocks) for s in partition(cfg.model, 2)] == [6, 2]  # the FLOP model's split
    for rank in (0, 1):
        result = dry_run_rank(cfg, rank)
        assert result["stage_split"].startswith("stage 0: embedding + blocks 0-4 ")
        assert "stage 1: blocks 5-7 + head " in result["stage_split"] and "(planner, h100-sxm bfloat16" in result["stage_split"]
        assert result["memory"]["params"] == predict_rank(cfg, rank)["memory"]["params"]
    assert stage_split_note(cfg) is None
    measured = dry_run_config(load_config(None, tiny), 2)  # the default asks for timing, which fake tensors cannot do
    assert "(flops; " in dry_run_rank(measured, 1)["stage_split"]
    assert stage_split_note(measured).startswith('parallel.stage_costs = "measured": a dry run\'s fake tensors cannot')


@pytest.mark.parametrize("overrides, message", [
    (["parallel.stage_costs=planner", "parallel.stage_costs_gpu=v100"],
     "parallel.stage_costs_gpu: unknown GPU 'v100' (known: a100-40gb, "),
    (["parallel.stage_costs_gpu=h100-sxm"],
     "parallel.stage_costs_gpu: 'h100-sxm' is used only with parallel.stage_costs = \"planner\", got 'measured'"),
    (["parallel.stage_costs=flops", "parallel.stage_costs_gpu=h100-sxm"],
     "parallel.stage_costs_gpu: 'h100-sxm' is used only with parallel.stage_costs = \"planner\", got 'flops'"),
    (["parallel.stage_costs=planner"], 'parallel.stage_costs: "planner" needs parallel.stage_costs_gpu'),
    (["parallel.stage_costs=planner", "parallel.stage_costs_gpu=b200", "train.dtype=float32"],
     "parallel.stage_costs_gpu: the catalog has no float32 peak for b200"),
])
def test_bad_planner_stage_costs_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + ["parallel.pp=2"] + overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_unknown_planned_gpu_exits_2_before_any_process_starts():
    args = [sys.executable, "-m", "threefold.cli", "train", "--nproc", "2", "--no-progress"]
    args += [f"--set={o}" for o in TINY + ["parallel.pp=2", "parallel.stage_costs=planner",
                                           "parallel.stage_costs_gpu=v100"]]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "parallel.stage_costs_gpu: unknown GPU 'v100'" in done.stderr


def test_the_planned_gpu_is_named_as_estimate_names_it():
    """parallel.stage_costs_gpu takes what `threefold estimate --gpu` takes, vendor spellings too."""
    from threefold.plan.stage_costs import planned_gpu

    def gpu(name):
        return planned_gpu(load_config(None, TINY + ["parallel.pp=2", "parallel.stage_costs=planner",
                                                     f"parallel.stage_costs_gpu={name}"]))
    assert gpu("H100-SXM5-80GB") == gpu("h100-sxm") and gpu("h100-sxm").name == "h100-sxm"
