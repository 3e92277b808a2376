"""Tensor parallelism (with and without sequence parallelism, alone and under DP/ZeRO) against
the single-process engine, on gloo worker pools.

The reference is ``Engine`` on one process with the same global batches and the same seed.

Every layout runs through tests/equivalence.py's ``case`` and is compared by its
``assert_same_training``, whose tolerances are justified there, once for all strategies.
"""
from __future__ import annotations


import pytest

import equivalence
from equivalence import assert_same_training, global_batches, my_micro_batches, new_engine
from threefold.config import ConfigError
from threefold.configure import load_config
from threefold.models.llama import Llama
from threefold.plan import costs
from threefold.train.engine import Engine
from threefold.train.metrics import ActivationMeter

# 8 heads and 4 kv heads split over tp 2 and 4; vocabulary 250 is padded to 252 and 252/256.
TINY = ["model.layers=2", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.vocab_size=250",
        "model.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.lr=1e-3", "train.grad_clip=0.5",
        "parallel.bucket_mb=0.1", "parallel.timeout_s=60"]


def layout(tp: int = 1, dp: int = 1, zero: int = 0, sp: bool = False, *extra: str) -> tuple[str, ...]:
    return tuple(TINY + [f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.zero={zero}",
                         f"parallel.sequence_parallel={str(sp).lower()}", *extra])


def make_config(tp: int = 1, dp: int = 1, zero: int = 0, sp: bool = False, *extra: str):
    return load_config(None, list(layout(tp, dp, zero, sp, *extra)))


def case(distributed, tp: int, dp: int, zero: int, sp: bool, *extra: str) -> list[dict]:
    """Each layout runs once; the equivalence and ledger tests read the same run."""
    return equivalence.case(distributed, layout(tp, dp, zero, sp, *extra))


def reference(*extra: str) -> dict:
    return equivalence.reference(layout(1, 1, 0, False, *extra))


# --- functions the workers run ------------------------------------------------------------------
def run_activations(tp: int, sp: bool, recompute: str, kv_heads: int, *extra: str) -> float:
    """One block's bytes saved for backward on this rank, by one micro-batch's forward: the
    difference between a 3-layer and a 1-layer model, halved."""
    peaks = []
    for layers in (3, 1):
        cfg = make_config(tp, 1, 0, sp, f"model.kv_heads={kv_heads}", f"model.layers={layers}",
                          f"train.recompute={recompute}", *extra)
        if tp > 1:
            engine = new_engine(cfg)
        else:
            model = Llama(cfg.model)
            model.init_weights(cfg.train.seed)
            model.set_recompute(recompute)
            engine = Engine(model, cfg)
        engine.activation_meter = ActivationMeter(engine.parameter_storages)
        engine.forward_backward(my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:1])
        engine.shutdown()
        peaks.append(engine.activation_meter.peak)
    return (peaks[0] - peaks[1]) / 2


LAYOUTS = [  # tp, dp, zero, sequence parallel
    (2, 1, 0, False), (2, 1, 0, True), (4, 1, 0, False), (4, 1, 0, True),
    (2, 2, 1, False), (2, 2, 1, True), (2, 2, 2, True), (2, 2, 3, False), (2, 2, 3, True),
]


@pytest.mark.parametrize("tp,dp,zero,sp", LAYOUTS)
def test_matches_single_process(distributed, tp, dp, zero, sp):
    assert_same_training(case(distributed, tp, dp, zero, sp), reference())


@pytest.mark.parametrize("sp", [False, True])
def test_untied_embeddings_and_full_recompute(distributed, sp):
    extra = ("model.tie_embeddings=false", "train.recompute=full")
    assert_same_training(case(distributed, 2, 1, 0, sp, *extra), reference(*extra))


# --- communication --------------------------------------------------------------------------------
def planned_tp_bytes(cfg, tp: int, sp: bool, recompute: str) -> dict:
    """The planner's bytes per optimizer step on the tp axis for this run (fp32), by ledger key."""
    b, s = cfg.train.micro_batch, cfg.model.seq_len
    return {"tp": costs.tp_bytes_per_step(cfg.model.layers, cfg.microbatches, b, s, cfg.model.hidden, tp, sp, recompute),
            "tp.loss": costs.tp_loss_bytes_per_step(cfg.microbatches, b, s, tp)}


def assert_ledger(step: dict, want: dict) -> None:
    assert step["tp"] == round(want["tp"])
    assert step["tp.loss"] == round(want["tp.loss"])


@pytest.mark.parametrize("tp,dp,zero,sp", LAYOUTS)
def test_ledger(distributed, tp, dp, zero, sp):
    cfg = make_config(tp, dp, zero, sp)
    want = planned_tp_bytes(cfg, tp, sp, "none")
    for r in case(distributed, tp, dp, zero, sp):
        for step in r["comm"]:
            assert_ledger(step, want)
            # SP: the norm gains' gradients this rank holds after the dp reduction, summed over tp.
            assert step.get("tp.partial_grads", 0) == (round(2 * (tp - 1) / tp * 4 * r["partial_numel"]) if sp else 0)
            assert step["tp.scalar"] == round(2 * (tp - 1) / tp * 4)  # the gradient norm's squares
            assert set(step) <= {"tp", "tp.loss", "tp.partial_grads", "tp.scalar", "dp", "dp.scalar"}
        assert "tp.eval" in r["eval_comm"] and set(r["eval_comm"]) <= {"tp.eval", "dp.eval"}  # not the step's


@pytest.mark.parametrize("tp,sp,recompute", [(tp, sp, recompute) for tp in (2, 4) for sp in (False, True)
                                             for recompute in ("selective", "full")])
def test_ledger_with_recompute(distributed, tp, sp, recompute):
    """Selective recomputation reruns the attention core, which has no collective; full
    recomputation reruns each block's forward up to its last saved tensor (costs.py explains)."""
    extra = (f"train.recompute={recompute}",)
    want = planned_tp_bytes(make_config(tp, 1, 0, sp, *extra), tp, sp, recompute)
    for r in case(distributed, tp, 1, 0, sp, *extra):
        for step in r["comm"]:
            assert_ledger(step, want)


@pytest.mark.parametrize("sp", [False, True])
def test_ledger_with_untied_embeddings(distributed, sp):
    extra = ("model.tie_embeddings=false", "train.recompute=full")
    want = planned_tp_bytes(make_config(2, 1, 0, sp, *extra), 2, sp, "full")
    for r in case(distributed, 2, 1, 0, sp, *extra):
        for step in r["comm"]:
            assert_ledger(step, want)


def test_sequence_parallel_moves_the_all_reduce_volume(distributed):
    """Per layer, SP's reduce-scatter/all-gather pairs move what the all-reduces did; the
    difference is exactly the backward re-gathers (two per layer, one for the head)."""
    cfg = make_config(2)
    plain, seq = (case(distributed, 2, 1, 0, sp)[0]["comm"][0]["tp"] for sp in (False, True))
    gather = 1 / 2 * cfg.train.micro_batch * cfg.model.seq_len * cfg.model.hidden * 4
    assert seq - plain == pytest.approx(cfg.microbatches * (2 * cfg.model.layers + 1) * gather)


# --- activation memory ------------------------------------------------------------------------------
_activations: dict = {}


def block_bytes(distributed, tp: int, sp: bool, recompute: str, kv_heads: int) -> float:
    """Measured once per case; every tp rank must save the same."""
    key = (tp, sp, recompute, kv_heads)
    if key not in _activations:
        ranks = (distributed.run(tp, run_activations, tp, sp, recompute, kv_heads) if tp > 1
                 else [run_activations(tp, sp, recompute, kv_heads)])
        assert len(set(ranks)) == 1, ranks
        _activations[key] = ranks[0]
    return _activations[key]


ACTIVATION_CASES = [(tp, sp, recompute, kv_heads) for tp, sp in ((1, False), (2, False), (2, True), (4, False), (4, True))
                    for recompute in ("none", "selective", "full") for kv_heads in (8, 4)]


@pytest.mark.parametrize("tp,sp,recompute,kv_heads", ACTIVATION_CASES)
def test_block_activations_equal_the_planner(distributed, tp, sp, recompute, kv_heads):
    """To the byte: costs.block_activation_bytes in fp32 is what one block saves on a rank,
    with 8 heads and 8 kv heads or 4 (grouped-query: the core saves k and v repeated)."""
    cfg = make_config(tp, 1, 0, sp, f"model.kv_heads={kv_heads}")
    tokens = cfg.train.micro_batch * cfg.model.seq_len
    want = costs.block_activation_bytes(cfg.model, tokens, tp, sp, recompute, dtype_bytes=4)
    assert block_bytes(distributed, tp, sp, recompute, kv_heads) == want


def test_sequence_parallel_divides_the_norm_region(distributed):
    cfg = make_config(2, 1, 0, True, "model.kv_heads=8")
    for recompute in ("none", "selective", "full"):
        saved = block_bytes(distributed, 2, False, recompute, 8) - block_bytes(distributed, 2, True, recompute, 8)
        tokens = cfg.train.micro_batch * cfg.model.seq_len
        # The norm region is what SP splits: 2·(12h + 4) bytes per token (fp32: each norm's input,
        # x·rsqrt, rsqrt, output), or the block's input (4h) under full recompute.
        region = tokens * (4 * cfg.model.hidden if recompute == "full" else 2 * (3 * 4 * cfg.model.hidden + 4))
        assert saved == region / 2


# --- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=3", "model.heads=8", "model.kv_heads=None", "model.hidden=48"], "does not divide model.heads=8"),
    (["parallel.tp=4", "model.heads=8", "model.kv_heads=2"], "does not divide the 2 key/value heads"),
    (["parallel.tp=4", "model.ffn=90"], "does not divide the FFN width 90"),
    (["parallel.tp=4", "model.vocab_size=3"], "vocabulary of 3 tokens"),
    (["parallel.tp=4", "model.seq_len=30", "parallel.sequence_parallel=true"], "does not divide model.seq_len=30"),
])
def test_layouts_tp_cannot_split(overrides, message):
    """Refused when the config is loaded, before any process starts."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, TINY + overrides)
    assert "\n" not in str(err.value)


def test_bf16_autocast(distributed):
    """bf16 compute over fp32 weights, sequence parallel, under ZeRO-3: the same losses as one
    process to bf16 precision (both round the same products to bf16, in other orders)."""
    extra = ("train.dtype=bfloat16",)
    ref = reference(*extra)
    for r in case(distributed, 2, 2, 3, True, *extra):
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3)
