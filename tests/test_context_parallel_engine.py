"""Context parallelism in the engine (the attention level is tests/test_context_parallel.py; the
equivalence with one process and the bytes per axis are cases of tests/equivalence.py's matrix):
activation memory per rank, evaluation, and the layouts it refuses."""
from __future__ import annotations

import subprocess
import sys

import pytest

from equivalence import global_batches, matrix_config, my_micro_batches, new_engine
from threefold.config import ConfigError
from threefold.plan import costs
from threefold.train.metrics import ActivationMeter

FULL_HEADS = ["model.kv_heads=8"]  # no grouped-query repeats: the plain core and the cp cores save alike


def block_activations(cp: int, method: str, recompute: str) -> float:
    """One block's bytes saved for backward on this rank by one micro-batch's forward: the
    difference between a 3-layer and a 1-layer model, halved (what lies outside the blocks,
    embedding, head and loss, cancels)."""
    peaks = []
    for layers in (3, 1):
        cfg = matrix_config(*FULL_HEADS, f"model.layers={layers}", f"train.recompute={recompute}",
                            f"parallel.cp={cp}", f"parallel.cp_method={method}")
        engine = new_engine(cfg)
        engine.activation_meter = ActivationMeter(engine.parameter_storages)
        engine.forward_backward(my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:1])
        engine.shutdown()
        peaks.append(engine.activation_meter.peak)
    return (peaks[0] - peaks[1]) / 2


@pytest.mark.parametrize("method", ["ring", "allgather"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_block_activations_per_rank_are_a_quarter_at_cp4(distributed, method, recompute):
    """The attention and MLP regions of a block, as the ActivationMeter measures them: at cp=4
    each rank saves a quarter of what one process saves, which is the planner's figure for a
    quarter of the tokens."""
    single = block_activations(1, method, recompute)
    ranks = distributed.run(4, block_activations, 4, method, recompute)
    cfg = matrix_config(*FULL_HEADS)
    tokens = cfg.train.micro_batch * cfg.model.seq_len
    assert single == costs.block_activation_bytes(cfg.model, tokens, 1, False, recompute, dtype_bytes=4)
    for measured in ranks:
        assert measured == single / 4
        assert measured == costs.block_activation_bytes(cfg.model, tokens // 4, 1, False, recompute, dtype_bytes=4)


def eval_losses(*overrides: str) -> float:
    cfg = matrix_config(*overrides)
    engine = new_engine(cfg)
    batches = my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:3]
    loss = engine.eval_loss(batches)
    engine.shutdown()
    return loss


@pytest.mark.parametrize("layout", [["parallel.cp=2", "parallel.cp_method=ulysses"],
                                    ["parallel.pp=2", "parallel.cp=2", "parallel.cp_method=ring"]])
def test_eval_loss_is_the_whole_sequences_mean(distributed, layout):
    """Every cp rank evaluates its share of the same batches; their mean is one process's loss."""
    single = eval_losses()
    ranks = distributed.run(4 if "parallel.pp=2" in layout else 2, eval_losses, *layout)
    assert ranks == pytest.approx([single] * len(ranks), rel=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=3", "model.seq_len=32"], r"^parallel\.cp: the zigzag split cuts model\.seq_len=32 into 2·cp = 6"),
    (["parallel.cp=4", "model.seq_len=36"], r"^parallel\.cp: .* 36 is not divisible by 8"),
    (["parallel.cp=2", "parallel.cp_method=ulysses", "model.heads=8", "model.kv_heads=1"],
     r"^parallel\.cp_method: ulysses splits each rank's 8 heads and 1 key/value head "),
    (["parallel.cp=2", "parallel.tp=4", "parallel.cp_method=ulysses", "model.heads=8", "model.kv_heads=4"],
     r"^parallel\.cp_method: ulysses .* \(after tp=4\) over cp=2"),
    (["parallel.cp=2", "parallel.cp_method=tree"], r"^parallel\.cp_method: must be one of ring, allgather, ulysses"),
    (["parallel.cp=2", "parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=20"],
     r"^parallel\.sequence_parallel: tp=4 does not divide the 10 tokens each cp rank holds"),
])
def test_layouts_cp_cannot_run(overrides, message):
    """Refused when the config is read, before any process starts, in one line."""
    with pytest.raises(ConfigError, match=message) as err:
        matrix_config(*overrides)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_in_one_line_with_exit_code_2(tmp_path):
    run = subprocess.run([sys.executable, "-m", "threefold.cli", "train", "--config", "configs/long_context.toml",
                          "--set", "parallel.cp=3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.cp: the zigzag split" in lines[0], run.stderr
