"""Exposed communication: the ledger counts the time a rank was blocked (in a synchronous
collective, or in ``wait()``), not the time from issuing to completion. One rank arrives late on
purpose (a sleep), so how long the other must wait is known."""
from __future__ import annotations

import time

import pytest
import torch

from threefold.config import ParallelConfig
from threefold.distributed.mesh import ParallelMesh

LATE_S = 0.4  # rank 1 joins each collective this late
COMPUTE_S = 0.25  # rank 0's "compute" between issuing a collective and waiting for it


def late_partner() -> dict:
    from threefold.distributed.comm import Comm
    from threefold.train.metrics import least_exposed

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, timeout_s=30))
    comm = Comm(mesh)
    x = torch.ones(1000)
    out = {}

    def partner_late():
        comm.barrier()
        if mesh.rank == 1:
            time.sleep(LATE_S)

    # Synchronous: rank 0 sits in the call until rank 1 arrives.
    comm.ledger.take_step()
    partner_late()
    comm.all_reduce(x, "dp")
    sent, blocked, calls = comm.ledger.take_step_calls()
    out["sync"] = sent, blocked
    out["least"] = least_exposed(comm, calls)  # the late rank's wait, on both ranks
    out["least_counted"] = comm.ledger.take()

    # The late rank alternates: each rank waits once, so each rank's step total holds one
    # partner's lateness, and only the call-by-call least is the transfers alone.
    for late in (1, 0):
        comm.barrier()
        if mesh.rank == late:
            time.sleep(LATE_S)
        comm.all_reduce(x, "dp")
    out["alternating"] = sent, blocked, calls = comm.ledger.take_step_calls()
    out["alternating_least"] = least_exposed(comm, calls)
    out["alternating_counted"] = comm.ledger.take()

    # Asynchronous, hidden in part: rank 0 issues, computes COMPUTE_S, then waits the rest.
    partner_late()
    pending = comm.all_reduce(x, "dp", async_op=True)
    if mesh.rank == 0:
        time.sleep(COMPUTE_S)
    pending.wait()
    out["async_seconds"] = pending.record.seconds
    out["async"] = comm.ledger.take_step()

    # Asynchronous, hidden entirely: the partner is on time, rank 0 computes longer than the transfer.
    comm.barrier()
    pending = comm.all_reduce(x, "dp", async_op=True, tag="scalar")
    time.sleep(COMPUTE_S)
    pending.wait()
    out["hidden"] = comm.ledger.take_step()
    comm.barrier()
    mesh.shutdown()
    return out


def test_exposed_time_is_the_wait_not_the_flight(distributed):
    rank0, rank1 = distributed.run(2, late_partner)
    sent, blocked = rank0["sync"]
    assert sent == {"dp": 4000} and set(blocked) == {"dp"}
    assert blocked["dp"] > 0.8 * LATE_S, blocked  # blocked while its partner slept
    assert rank1["sync"][1]["dp"] < 0.5 * LATE_S, rank1  # the late rank found its partner waiting

    # The group's least, of the totals and call by call: the late rank's, the same on both; the
    # calls' count, its negative and the total (3 floats), then the one call's wait, under dp.metrics.
    late = {"dp": pytest.approx(rank1["sync"][1]["dp"])}
    assert rank0["least"] == rank1["least"] == (late, late)
    assert rank0["least_counted"] == {"dp.metrics": 24 + 8}

    # In flight about LATE_S, waited only what COMPUTE_S did not cover.
    assert rank0["async_seconds"] > 0.8 * LATE_S
    waited = rank0["async"][1]["dp"]
    assert 0.3 * (LATE_S - COMPUTE_S) < waited < LATE_S - 0.5 * COMPUTE_S, waited

    # Nothing to wait for: exposed near zero, under its own key.
    sent, blocked = rank0["hidden"]
    assert set(blocked) == {"dp.scalar"} and blocked["dp.scalar"] < 0.5 * COMPUTE_S, blocked


def test_the_call_by_call_least_leaves_out_a_skew_that_alternates(distributed):
    rank0, rank1 = distributed.run(2, late_partner)
    for out in (rank0, rank1):
        sent, blocked, calls = out["alternating"]
        assert sent == {"dp": 8000} and len(calls["dp"]) == 2 and blocked["dp"] == pytest.approx(sum(calls["dp"]))
        assert blocked["dp"] > 0.8 * LATE_S  # each rank waited once for its partner
    per_step, per_call = rank0["alternating_least"]
    assert rank1["alternating_least"] == (per_step, per_call)
    assert per_step["dp"] > 0.8 * LATE_S  # the least of the totals still holds one lateness
    expected = sum(min(a, b) for a, b in zip(rank0["alternating"][2]["dp"], rank1["alternating"][2]["dp"]))
    assert per_call["dp"] == pytest.approx(expected) and per_call["dp"] < 0.25 * LATE_S
    # the count, its negative and the total (3 floats), then the 2 calls' waits
    assert rank0["alternating_counted"] == {"dp.metrics": 24 + 16}
