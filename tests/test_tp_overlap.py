"""parallel.tp_overlap: sequence parallelism's all-gathers and reduce-scatters as rings of sends
pipelined with the column- and row-parallel products (tensor_parallel.py's AllGatherColumnMatmuls
and RowMatmulReduceScatter, over comm.py's ring_pass and ring_reduce_scatter).

Checked: training equals one process and plain tp with SP (tests/equivalence.py's tolerances),
the tp bytes equal the planner's ``tp_bytes_per_step`` (and plain tp's ledger) exactly, each
operation alone equals its unfused form, and its sends overlap its products (the ledger's launch
times against the rings' product end times). Bad input: one line, exit 2.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import equivalence
from equivalence import assert_same_training
from threefold.config import ConfigError
from threefold.configure import load_config
from test_tensor_parallel import TINY, assert_ledger, planned_tp_bytes, run_activations
from threefold.plan import costs

# The fused operations sum the same terms in another order (a weight gradient chunk by chunk,
# a reduce-scatter's addends around the ring): fp32 rounding, a few ulps of the largest entry
# (measured: at most 2.2e-7 at tp=2, 5.0e-7 at tp=4).
RTOL = 5e-6  # a wrong chunk, a lost addend or a chunk added twice moves entries by 1e-2 or more


def layout(tp: int, overlap: bool, *extra: str) -> tuple[str, ...]:
    return tuple(TINY + [f"parallel.tp={tp}", "parallel.sequence_parallel=true",
                         f"parallel.tp_overlap={str(overlap).lower()}", *extra])


# --- the whole model, 5 steps ------------------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_equals_one_process_and_plain_tp(distributed, tp):
    overlapped = equivalence.case(distributed, layout(tp, True))
    plain = equivalence.case(distributed, layout(tp, False))
    assert_same_training(overlapped, equivalence.reference(layout(tp, False)))
    assert_same_training(overlapped, plain[0])


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_bytes_equal_the_planner_and_plain_tp(distributed, tp):
    cfg = load_config(None, list(layout(tp, True)))
    want = planned_tp_bytes(cfg, tp, True, "none")
    overlapped = equivalence.case(distributed, layout(tp, True))
    plain = equivalence.case(distributed, layout(tp, False))
    for r, p in zip(overlapped, plain):
        assert r["comm"] == p["comm"]  # every key, every step
        for step in r["comm"]:
            assert_ledger(step, want)
        assert r["eval_comm"] == p["eval_comm"]  # evaluation's rings are tagged "eval", as its collectives


@pytest.mark.parametrize("extra", [("parallel.dp=2", "parallel.zero=1"), ("train.recompute=selective",),
                                   ("parallel.pp=2", "parallel.schedule=zb-h1")])
def test_composes(distributed, extra):
    """With dp and ZeRO; with selective recomputation (the attention core: no tp traffic); in a
    zero-bubble pipeline, whose W pass reuses the output gradient the row-parallel ring gathered in B."""
    overlapped = equivalence.case(distributed, layout(2, True, *extra))
    assert_same_training(overlapped, equivalence.reference(layout(2, False, *extra)))
    plain = equivalence.case(distributed, layout(2, False, *extra))
    assert [r["comm"] for r in overlapped] == [r["comm"] for r in plain]


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_saves_the_activations_plain_tp_saves(distributed, recompute):
    """The fused operations save what the unfused ones do (a column-parallel input's sequence
    shard, a row-parallel product's input): the planner's block bytes, to the byte."""
    cfg = load_config(None, list(layout(2, True, f"train.recompute={recompute}")))
    want = costs.block_activation_bytes(cfg.model, cfg.train.micro_batch * cfg.model.seq_len, 2, True, recompute,
                                        dtype_bytes=4)
    saved = distributed.run(2, run_activations, 2, True, recompute, 4, "parallel.tp_overlap=true")
    assert saved == [want, want]


def test_bf16_autocast(distributed):
    """bf16 products over fp32 weights (the fused operations cast as the unfused ones do): the
    same losses as one process to bf16 precision, as plain tp's test asks."""
    extra = ("train.dtype=bfloat16",)
    ref = equivalence.reference(layout(2, False, *extra))
    for r in equivalence.case(distributed, layout(2, True, *extra)):
        assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3)


# --- one operation at a time, on gloo workers --------------------------------------------------
def one_operation(kind: str, batch: int = 2) -> dict:
    """``kind`` ("column" or "row") fused and unfused on the same inputs, forward and backward:
    the largest differences relative to the largest entry of each output and gradient, and per phase the launch times of the sends and the rings' product
    end times."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.tensor_parallel import (AllGatherColumnMatmuls, GatherSequence, ReduceScatterSequence,
                                                    RowMatmulReduceScatter, SequenceGathered, TensorParallelGroup)

    mesh = ParallelMesh({"tp": dist.get_world_size()}, rank=dist.get_rank(), timeout_s=30)
    tp = TensorParallelGroup(Comm(mesh), mesh.coord("tp"), mesh.size("tp"), True, 64, overlap=True)
    t, r = tp.size, tp.rank
    gen = torch.Generator().manual_seed(r)  # each rank its own shard and weights
    seq, hidden = 8 * t, 24
    if kind == "column":
        x = torch.randn(batch, seq // t, hidden, generator=gen)
        weights = [torch.randn(out, hidden, generator=gen) for out in (16, 8)]
        upstream = [torch.randn(batch, seq, out, generator=gen) for out in (16, 8)]
    else:
        x = torch.randn(batch, seq, hidden, generator=gen)
        weights = [torch.randn(32, hidden, generator=gen)]
        upstream = [torch.randn(batch, seq // t, 32, generator=gen)]

    def run(fused: bool) -> tuple[list, dict]:
        leaves = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in weights]
        records = len(tp.comm.ledger.records)
        if kind == "column":
            outs = (AllGatherColumnMatmuls.apply(leaves[0], tp, None, *leaves[1:])[1:] if fused else
                    [F.linear(GatherSequence.apply(leaves[0], SequenceGathered(x, tp), None), w) for w in leaves[1:]])
        else:
            outs = [RowMatmulReduceScatter.apply(leaves[0], leaves[1], tp, None) if fused else
                    ReduceScatterSequence.apply(F.linear(leaves[0], leaves[1]), tp, None)]
        phases = {"forward": (tp.comm.ledger.records[records:], tp.ring_ends)}
        records = len(tp.comm.ledger.records)
        sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
        phases["backward"] = (tp.comm.ledger.records[records:], tp.ring_ends)
        return [*outs, *(leaf.grad for leaf in leaves)], phases

    want, _ = run(False)
    tp.comm.ledger.take()
    got, phases = run(True)
    sent = tp.comm.ledger.take()
    result = {"errors": [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)], "bytes": sent,
              "x_bytes": x.numel() * 4, "upstream_bytes": sum(u.numel() for u in upstream) * 4 // len(upstream),
              "ops": {phase: sorted({rec.op for rec in recs}) for phase, (recs, _) in phases.items()},
              "sends": {phase: [rec.started for rec in recs if rec.op == "send"] for phase, (recs, _) in phases.items()},
              "ends": {phase: ends for phase, (_, ends) in phases.items()}}
    mesh.shutdown()
    return result


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_each_operation_equals_its_collective_and_product(distributed, tp, kind):
    for result in distributed.run(tp, one_operation, kind):
        assert max(result["errors"]) < RTOL, result["errors"]
        assert result["ops"] == {"forward": ["recv", "send"], "backward": ["recv", "send"]}  # no collective left
        # Bytes: column: gather x forward, reduce-scatter dL/dx and gather x again backward;
        # row: reduce-scatter the (b, s, 32) product forward, gather its gradient backward.
        per_ring = (tp - 1) * (result["x_bytes"] if kind == "column" else result["upstream_bytes"])
        assert result["bytes"] == {"tp": (3 if kind == "column" else 2) * per_ring}


def _assert_overlapped(sends: list[float], ends: list[float], gather: bool) -> None:
    """A gather ring launches the send of the chunk in flight during product k before product k
    ends (and after product k−1 ended: it is step k's); a reduce-scatter ring launches the send of
    chunk k's sum after its product ends and before product k+1 ends (it travels meanwhile)."""
    assert len(sends) == len(ends) - 1
    for k, started in enumerate(sends):
        if gather:
            assert started < ends[k] and (k == 0 or started > ends[k - 1])
        else:
            assert ends[k] < started < ends[k + 1]


@pytest.mark.parametrize("kind", ["column", "row"])
def test_each_send_is_in_flight_while_a_product_runs(distributed, kind):
    tp = 4
    for result in distributed.run(tp, one_operation, kind, 4):
        sends, ends = result["sends"], result["ends"]
        assert len(ends["forward"]) == 1
        _assert_overlapped(sends["forward"], ends["forward"][0], gather=kind == "column")
        if kind == "column":  # backward: dL/dx reduce-scattered, then x gathered again for dW
            assert len(ends["backward"]) == 2
            _assert_overlapped(sends["backward"][:tp - 1], ends["backward"][0], gather=False)
            _assert_overlapped(sends["backward"][tp - 1:], ends["backward"][1], gather=True)
        else:  # backward: the output gradient gathered, multiplied chunk by chunk
            assert len(ends["backward"]) == 1
            _assert_overlapped(sends["backward"], ends["backward"][0], gather=True)


# --- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp_overlap=true"], "parallel.tp_overlap: needs tensor parallelism with sequence parallelism"),
    (["parallel.tp_overlap=true", "parallel.tp=2"], "got tp=2, sequence_parallel=false"),
    (["parallel.tp_overlap=true", "parallel.sequence_parallel=true"], "got tp=1, sequence_parallel=true"),
    (["parallel.tp_overlap=true", "parallel.sequence_parallel=true", "parallel.tp=2", "train.recompute=full"],
     "parallel.tp_overlap: not with train.recompute=full"),
])
def test_tp_overlap_without_tp_and_sp_or_with_full_recompute_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, TINY + overrides)
    assert "\n" not in str(err.value)


def test_the_cli_says_it_in_one_line_and_exits_2():
    proc = subprocess.run([sys.executable, "-m", "threefold.cli", "train", "--set", "parallel.tp_overlap=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    said = (proc.stdout + proc.stderr).strip()
    assert len(said.splitlines()) == 1 and "parallel.tp_overlap" in said and "Traceback" not in said
