"""Balanced pipeline stages: the split that minimises the slowest stage on measured or modelled
costs (schedule.balanced_split, PipeDream's partitioner), under a memory limit; the split by
hand (``parallel.stage_layers``), validated; the measurement itself (stages.py)."""
from __future__ import annotations

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


@pytest.mark.parametrize("stage_layers", ["[1,3]", "[[0],[1,2,3]]"])
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
    ('"2,2"', "parallel.stage_layers: expected a list, got '2,2'"),
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
