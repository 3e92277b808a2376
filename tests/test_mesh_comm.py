"""The mesh (coordinates and groups), counted communication, failures, and the torchrun relaunch."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from threefold.config import ConfigError, ParallelConfig
from threefold.configure import load_config
from threefold.distributed.comm import ring_bytes
from threefold.distributed.launch import relaunch, torchrun_args, without_nproc
from threefold.distributed.mesh import AXES, ParallelMesh
from dist_pool import RankFailure


# --- the mesh without processes ------------------------------------------------------------------
def test_grid_order_puts_tp_innermost_and_pp_outermost():
    mesh = ParallelMesh({"dp": 2, "tp": 2, "pp": 2}, rank=5)
    assert mesh.coords == {"pp": 1, "dp": 0, "edp": 0, "dpr": 0, "dps": 0, "ep": 0, "cp": 0, "tp": 1}
    assert mesh.ranks("tp") == [4, 5] and mesh.ranks("dp") == [5, 7] and mesh.ranks("pp") == [1, 5]
    assert mesh.ranks("dp", "tp") == [4, 5, 6, 7] and mesh.coord("dp", "tp") == 1
    assert (mesh.size("dp"), mesh.coord("dp"), mesh.coord("tp"), mesh.coord("pp")) == (2, 0, 1, 1)


@pytest.mark.parametrize("sizes", [{"dp": 2, "tp": 2, "pp": 2}, {"dp": 3, "cp": 2}, {"tp": 2, "dp": 4, "ep": 2, "pp": 3}])
def test_every_axis_partitions_the_world(sizes):
    world = 1
    for axis, n in sizes.items():
        world *= n if axis != "ep" else 1  # ep splits dp: not a factor of the world
    edp = sizes.get("dp", 1) // sizes.get("ep", 1)
    for axis in AXES + ("edp",):
        groups = {tuple(ParallelMesh(sizes, rank=r).ranks(axis)) for r in range(world)}
        assert sorted(r for g in groups for r in g) == list(range(world))  # disjoint, covering
        assert all(len(g) == (edp if axis == "edp" else sizes.get(axis, 1)) for g in groups)
        for r in range(world):  # coord is the position inside the group
            mesh = ParallelMesh(sizes, rank=r)
            assert mesh.ranks(axis)[mesh.coord(axis)] == r


def test_folded_experts_make_the_ep_group_consecutive_ranks_over_tp_and_cp():
    """expert_tp=1: ep 8 over tp 2 · cp 2 and 2 of the 4 dp ranks (world 16): ep groups of 8
    consecutive ranks, edp the 2 ranks 8 apart; the ledger names the grid's epd "ep"."""
    mesh = ParallelMesh({"dp": 4, "tp": 2, "cp": 2, "ep": 8}, rank=13, expert_tp=1)
    assert mesh.folded and mesh.dims["epd"] == 2 and mesh.size("ep") == 8 and mesh.size("edp") == 2
    assert mesh.ranks("ep") == list(range(8, 16)) and mesh.coord("ep") == 5 and mesh.ranks("edp") == [5, 13]
    assert mesh.ranks("dp") == [1, 5, 9, 13] and mesh.ranks("tp") == [12, 13] and mesh.ranks("cp") == [13, 15]
    assert mesh.label("ep") == "ep" and mesh.label("epd") == "ep" and mesh.label("edp") == "dp"
    assert "ep folded over tp, cp" in repr(mesh)
    unfolded = ParallelMesh({"dp": 4, "tp": 2, "cp": 2, "ep": 2}, rank=13)
    assert not unfolded.folded and unfolded.ranks("ep") == [9, 13] and unfolded.label("epd") == "ep"
    with pytest.raises(ValueError, match="folded ep=2 must be tp·cp=4 times a divisor of dp=4"):
        ParallelMesh({"dp": 4, "tp": 2, "cp": 2, "ep": 2}, expert_tp=1)


def test_hybrid_sharding_splits_dp_into_replicas_of_consecutive_shard_groups():
    """dp = 4 as dpr 2 × dps 2 (tp 2 inside): the shard groups are consecutive dp ranks, the
    replicate groups hold the same dps coordinate; both count as dp in the ledger."""
    mesh = ParallelMesh({"dp": 4, "tp": 2, "dpr": 2}, rank=5)  # dp coordinate 2, tp coordinate 1
    assert (mesh.coord("dp"), mesh.coord("dpr"), mesh.coord("dps")) == (2, 1, 0)
    assert mesh.ranks("dp") == [1, 3, 5, 7] and mesh.ranks("dps") == [5, 7] and mesh.ranks("dpr") == [1, 5]
    assert mesh.ranks("edp") == mesh.ranks("dp") and mesh.size("dps", "dpr") == 4
    assert mesh.label("dpr") == "dp" and mesh.label("dps") == "dp" and mesh.label("dps", "tp") == "dp+tp"
    for sizes in ({"dp": 4, "dpr": 3}, {"dp": 8, "ep": 4, "dpr": 4}):  # a shard group must hold whole ep groups
        with pytest.raises(ValueError, match="hybrid sharding"):
            ParallelMesh(sizes)


def test_hybrid_sharding_with_expert_parallelism_keeps_the_ep_groups_inside_a_shard_group():
    """dp = 8 as dpr 2 × dps 2 × ep 2: the dense weights shard over a group's dps × ep (four
    consecutive dp ranks), the experts over its dps ranks with the same ep coordinate; every group
    counts as dp in the ledger, dps × ep too."""
    mesh = ParallelMesh({"dp": 8, "ep": 2, "dpr": 2}, rank=5)
    assert (mesh.coord("dpr"), mesh.coord("dps"), mesh.coord("ep")) == (1, 0, 1)
    assert mesh.ranks("dps", "ep") == [4, 5, 6, 7] and mesh.ranks("dps") == [5, 7] and mesh.ranks("dpr") == [1, 5]
    assert mesh.ranks("ep") == [4, 5] and mesh.ranks("edp") == [1, 3, 5, 7]
    assert mesh.label("dps", "ep") == "dp" and mesh.label("ep") == "ep"
    with_cp = ParallelMesh({"dp": 8, "ep": 2, "cp": 2, "dpr": 2}, rank=5)
    assert with_cp.label("dps", "ep", "cp") == "dp+cp" and with_cp.label("dps", "cp") == "dp+cp"
    assert with_cp.ranks("dps", "ep", "cp") == list(range(8))  # rank 5 is in the first replica group (dpr 0)


def test_without_data_parallelism_the_experts_group_is_the_cp_group_in_the_ledger():
    """dp = 1, cp = 2: the experts' own sync over edp × cp counts under "cp", as the dense
    gradients' does (the planner's key); with dp > 1 and ep = dp (edp of one rank), "dp+cp"."""
    assert ParallelMesh({"cp": 2}).label("edp", "cp") == "cp" and ParallelMesh({"cp": 2}).label("edp") == "dp"
    assert ParallelMesh({"dp": 2, "ep": 2, "cp": 2}).label("edp", "cp") == "dp+cp"


def test_world_of_one_needs_no_process_group():
    mesh = ParallelMesh.from_config(ParallelConfig())
    assert mesh.world_size == 1 and mesh.group("dp") is None and mesh.size("dp", "cp") == 1
    from threefold.models.llama import Llama
    from threefold.train.engine import build_engine
    from threefold.train.engine import Engine

    cfg = load_config(None, ["model.layers=1", "model.hidden=32", "model.heads=2", "model.vocab_size=64"])
    assert type(build_engine(Llama(cfg.model), cfg)) is Engine


def test_expert_parallelism_is_carved_out_of_dp():
    """ep splits the dp ranks (edp × ep, ep inner): the world is dp·tp·pp·cp."""
    mesh = ParallelMesh({"dp": 4, "ep": 2}, rank=3)
    assert mesh.world_size == 4 and mesh.ranks("dp") == [0, 1, 2, 3]
    assert mesh.ranks("ep") == [2, 3] and mesh.ranks("edp") == [1, 3]
    assert (mesh.coord("dp"), mesh.coord("ep"), mesh.coord("edp")) == (3, 1, 1)
    assert (mesh.label("dp"), mesh.label("ep"), mesh.label("edp")) == ("dp", "ep", "dp")
    assert ParallelMesh({"dp": 2, "ep": 2}, rank=1).label("dp") == "dp"  # edp = 1: dp is the ep group
    assert load_config(None, ["model.layers=1", "model.hidden=32", "model.heads=2", "model.vocab_size=64",
                              "model.moe_experts=4", "model.moe_top_k=2", "parallel.dp=4",
                              "parallel.ep=2", "train.micro_batch=4"]).parallel.world_size == 4


def test_ring_bytes_follow_nccl_tests():
    assert ring_bytes("all_reduce", 1000, 4) == 1500
    assert ring_bytes("reduce_scatter", 1000, 4) == 750
    assert ring_bytes("all_gather", 1000, 4) == 750
    assert ring_bytes("all_reduce", 1000, 1) == 0


# --- on gloo workers ---------------------------------------------------------------------------
def collectives_dp2_tp2() -> dict:
    """World 4 as dp=2 × tp=2: every op's result against arithmetic, and what the ledger saw."""
    from threefold.distributed.comm import Comm

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, tp=2, timeout_s=30))
    comm = Comm(mesh)
    r = mesh.rank
    x = torch.full((1000,), float(r))
    comm.all_reduce(x, "tp")
    tp_sum = sum(mesh.ranks("tp"))
    full = torch.arange(8.0) * (r + 1)
    chunk = torch.empty(4)
    pending = comm.reduce_scatter(chunk, full, "dp", async_op=True)
    pending.wait()
    want_sum = torch.arange(8.0) * sum(q + 1 for q in mesh.ranks("dp"))
    gathered = torch.empty(8)
    comm.all_gather(gathered, torch.full((4,), float(r)), "dp")
    want_gather = torch.cat([torch.full((4,), float(q)) for q in mesh.ranks("dp")])
    comm.all_reduce(torch.ones(1), "dp", tag="scalar")
    record = pending.record
    comm.barrier()
    mesh.shutdown()
    return {"ok": bool(torch.all(x == tp_sum)) and torch.equal(chunk, want_sum[4 * mesh.coord("dp"):][:4])
            and torch.equal(gathered, want_gather),
            "bytes": comm.ledger.take(), "after_take": comm.ledger.take(),
            "timed": record.seconds is not None and record.seconds >= record.waited >= 0}


def test_collectives_are_correct_and_counted(distributed):
    for result in distributed.run(4, collectives_dp2_tp2):
        assert result["ok"] and result["timed"]
        # tp: all-reduce of 4000 B over 2 → 4000; dp: reduce-scatter of 32 B + all-gather of 32 B → 16 + 16.
        assert result["bytes"] == {"tp": 4000, "dp": 32, "dp.scalar": 4}
        assert result["after_take"] == {}


def next_axes_ops(sizes: dict) -> dict:
    """A group over dp and cp, uneven all-to-all (plain, async, through autograd) and broadcast."""
    import torch.distributed as dist

    from threefold.distributed.comm import Comm, all_to_all_autograd

    mesh = ParallelMesh(sizes, rank=dist.get_rank(), timeout_s=30)
    comm, axes = Comm(mesh), ("dp", "cp")
    n, me, r = mesh.size(*axes), mesh.coord(*axes), mesh.rank
    checks = {}
    x = torch.full((1000,), float(r))
    comm.all_reduce(x, axes)
    checks["all_reduce"] = bool(torch.all(x == sum(mesh.ranks(*axes))))
    bytes_all_reduce = comm.ledger.take()
    # Rank i sends i + 2j + 1 rows of 3 numbers, each 100·i + j, to rank j: uneven and asymmetric.
    send_rows = [me + 2 * j + 1 for j in range(n)]
    recv_rows = [j + 2 * me + 1 for j in range(n)]
    rows = torch.cat([torch.full((k, 3), 100.0 * me + j) for j, k in enumerate(send_rows)])
    want = torch.cat([torch.full((k, 3), 100.0 * j + me) for j, k in enumerate(recv_rows)])
    out = torch.empty(sum(recv_rows), 3)
    comm.all_to_all(out, rows, axes, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    checks["all_to_all"] = torch.equal(out, want)
    bytes_all_to_all = comm.ledger.take()
    out.zero_()
    comm.all_to_all(out, rows, axes, output_split_sizes=recv_rows, input_split_sizes=send_rows,
                    async_op=True).wait()
    checks["all_to_all_async"] = torch.equal(out, want)
    bytes_async = comm.ledger.take()
    leaf = rows.clone().requires_grad_()
    y = all_to_all_autograd(comm, leaf, axes, output_split_sizes=recv_rows, input_split_sizes=send_rows)
    bytes_autograd_forward = comm.ledger.take()
    (y * (me + 1.0)).sum().backward()  # so the gradient of a row sent to rank j is j + 1
    checks["autograd_values"] = torch.equal(y.detach(), want)
    checks["autograd_grad"] = torch.equal(leaf.grad, torch.cat([torch.full((k, 3), j + 1.0)
                                                                for j, k in enumerate(send_rows)]))
    bytes_autograd_backward = comm.ledger.take()
    b = torch.full((10,), float(r))
    comm.broadcast(b, axes, src=1)
    checks["broadcast"] = bool(torch.all(b == mesh.ranks(*axes)[1]))
    pending = comm.broadcast(b.fill_(r), axes, src=0, async_op=True)
    pending.wait()
    checks["broadcast_async"] = bool(torch.all(b == mesh.ranks(*axes)[0]))
    bytes_broadcast = comm.ledger.take()
    mesh.shutdown()
    return {"checks": checks, "n": n, "me": me, "all_reduce": bytes_all_reduce, "all_to_all": bytes_all_to_all,
            "async": bytes_async, "autograd_forward": bytes_autograd_forward,
            "autograd_backward": bytes_autograd_backward, "broadcast": bytes_broadcast}


@pytest.mark.parametrize("world, sizes, key", [(2, {"dp": 2}, "dp"), (4, {"dp": 2, "cp": 2}, "dp+cp")])
def test_next_axes_ops_are_correct_and_counted(distributed, world, sizes, key):
    """With cp=1 the (dp, cp) group is the dp group and keeps its key; at dp2·cp2 it is "dp+cp"."""
    for result in distributed.run(world, next_axes_ops, sizes):
        assert all(result["checks"].values()), result["checks"]
        n, me = result["n"], result["me"]
        assert n == world
        assert result["all_reduce"] == {key: round(2 * (n - 1) / n * 4000)}
        # Exactly the rows this rank sends to the others, 12 bytes each; the backward sends the
        # gradient rows back along the transposed splits.
        forward = sum(me + 2 * j + 1 for j in range(n) if j != me) * 12
        backward = sum(j + 2 * me + 1 for j in range(n) if j != me) * 12
        assert forward != backward
        assert result["all_to_all"] == result["async"] == result["autograd_forward"] == {key: forward}
        assert result["autograd_backward"] == {key: backward}
        assert result["broadcast"] == {key: 2 * 40}  # B on every rank, twice


def test_the_ledger_key_joins_the_axes_of_size_above_one():
    mesh = ParallelMesh({"dp": 2, "cp": 2}, rank=0)
    assert mesh.label("cp", "dp") == "dp+cp" and mesh.label("dp", "tp") == "dp" and mesh.label("tp") == "tp"
    assert ring_bytes("all_to_all", 1000, 4) == 750 and ring_bytes("broadcast", 1000, 4) == 1000


def test_in_a_group_of_one_an_out_of_place_op_copies_its_input():
    from threefold.distributed.comm import Comm

    comm = Comm(ParallelMesh({}))
    for op in (comm.all_gather, comm.reduce_scatter, comm.all_to_all):
        out = torch.zeros(6)
        op(out, torch.arange(6.0), ("dp", "cp"))
        assert torch.equal(out, torch.arange(6.0)), op.__name__
    assert comm.ledger.take() == {}  # nothing crossed a process boundary
    with pytest.raises(ValueError, match=r"^all_to_all over 'dp\+cp': input_split_sizes \[2, 4\] must have 1 "
                                         r"entry summing to the input's 6 rows$"):
        comm.all_to_all(torch.zeros(6), torch.zeros(6), ("dp", "cp"), input_split_sizes=[2, 4])


def wrong_world() -> str:
    with pytest.raises(ConfigError) as err:
        ParallelMesh.from_config(ParallelConfig(dp=4))
    return str(err.value)


def test_world_size_must_match_the_layout(distributed):
    for message in distributed.run(2, wrong_world):
        assert message == "parallel: the layout dp×tp×pp×cp = 4×1×1×1 = 4 ranks, but 2 processes are running"


def one_rank_fails() -> None:
    from threefold.distributed.comm import Comm

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, timeout_s=2))
    if mesh.rank == 1:
        raise ValueError("rank 1 lost its data")
    Comm(mesh).all_reduce(torch.ones(10), "dp")  # rank 1 never comes


def test_a_failing_rank_does_not_hang_the_others(distributed):
    began = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        distributed.run(2, one_rank_fails)
    elapsed = time.monotonic() - began
    report = str(failure.value)
    assert "ValueError: rank 1 lost its data" in report
    assert "CommError: all_reduce of 40 bytes over mesh axis 'dp' failed on rank 0" in report
    assert "rank 1 of the group [0, 1] did not reach it (dead, or stuck elsewhere)" in report
    assert elapsed < 30  # bounded by the 2 s timeout, not gloo's default 30 minutes
    assert distributed.run(2, collectives_noop) == [0, 1]  # the next test gets a working pool


def collectives_noop() -> int:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size()
    return dist.get_rank()


# --- torchrun ------------------------------------------------------------------------------------
def test_nproc_is_removed_from_the_relaunched_command():
    argv = ["train", "--config", "c.toml", "--nproc", "2", "--set", "parallel.dp=2", "--nproc=2"]
    assert without_nproc(argv) == ["train", "--config", "c.toml", "--set", "parallel.dp=2"]
    assert torchrun_args(2, argv, max_restarts=3) == [
        "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT",
        "-m", "threefold.cli",
        "train", "--config", "c.toml", "--set", "parallel.dp=2"]


def test_relaunch_runs_the_command_under_torchrun(capfd):
    assert relaunch(2, ["--version", "--nproc", "2"]) == 0
    assert capfd.readouterr().out.count("version") == 2  # each of the two processes printed it


def test_a_user_error_in_the_ranks_is_one_line_and_exit_code_2(capfd):
    assert relaunch(2, ["train", "--config", "missing.toml", "--nproc", "2"]) == 2
    lines = capfd.readouterr().err.splitlines()
    # One line from each rank that got to say it: torchrun stops the other once the first has exited.
    assert 1 <= lines.count("error: --config: file 'missing.toml' does not exist") <= 2
    assert all(line == "error: --config: file 'missing.toml' does not exist" for line in lines if line.strip())
    assert not any("Traceback" in line or "ChildFailedError" in line for line in lines)  # none from torchrun


FAULTS_OF_LARGE_TENSORS = """
import resource, sys, torch
from threefold.distributed.launch import keep_large_blocks_in_the_heap
kept = keep_large_blocks_in_the_heap() if sys.argv[1] == "kept" else None
def step():  # 40 MB, above glibc's largest dynamic mmap threshold (32 MB), and a small tensor beside it
    torch.empty(10 << 20).fill_(1.0)
    return torch.ones(1000)
for _ in range(10):  # the heap grows to what a step needs
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_tensors_reuse_the_heap_instead_of_fresh_pages():
    """Without keep_large_blocks_in_the_heap every 40 MB tensor is a fresh mapping whose pages
    fault in as they are first written; with it, once the heap has grown to what a step needs,
    freed blocks are reused and (almost) nothing faults."""
    faults = {}
    for mode in ("kept", "default"):
        out = subprocess.run([sys.executable, "-c", FAULTS_OF_LARGE_TENSORS, mode], capture_output=True, text=True,
                             check=True).stdout.split()
        faults[mode] = int(out[1])
        assert out[0] == ("True" if mode == "kept" else "None")
    assert faults["default"] >= 10 * 20  # at least one fault per 2 MB huge page, per tensor
    assert faults["kept"] * 10 < faults["default"], faults


LATE_JOINER = """
import os, sys, time, torch, torch.distributed as dist
from threefold.config import ParallelConfig
from threefold.distributed.mesh import ParallelMesh
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(4)  # starts 4 s after rank 0, past the 2 s timeout of each collective
mesh = ParallelMesh.from_config(ParallelConfig(dp=2, timeout_s=2))
total = torch.ones(1)
dist.all_reduce(total)
print("sum", int(total.item()), flush=True)
if rank == 0:  # a collective rank 1 never joins still fails at the 2 s timeout
    began = time.time()
    try:
        dist.all_reduce(torch.ones(1))
    except Exception:
        print("failed after", round(time.time() - began), flush=True)
else:
    time.sleep(6)  # alive until rank 0's collective has timed out
"""


def test_a_rank_that_starts_late_joins_and_collectives_keep_their_timeout():
    """Joining the group waits at least mesh.SETUP_TIMEOUT_S, however short parallel.timeout_s
    is (a rank 4 s late joined a 2 s group; it had failed in the join before); each collective is
    still bounded by timeout_s."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, "-c", LATE_JOINER], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = [rank.communicate(timeout=120) for rank in ranks]
    assert all("sum 2" in out for out, _ in outs), outs
    failed = [line for line in outs[0][0].splitlines() if line.startswith("failed after")]
    assert failed and 2 <= int(failed[0].split()[-1]) <= 6, outs[0]
