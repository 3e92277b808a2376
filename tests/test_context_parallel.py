"""Context parallelism at the attention level (every method against full causal attention, its
bytes against the planner's formulas, load balance, the ring's overlap), apply_cp on the tiny
model at cp=2 and at dp2·cp2 against one process, and the refusals.

Tolerance, fp32. The reference is scaled_dot_product_attention over the whole sequence; ring
and all-gather compute the same softmax in another order: per block (PyTorch's flash kernel for
CPU, or the same arithmetic written out), merging partial outputs through logaddexp, and the
gradients from the saved log-sum-exp (the flash attention backward). An entry of the output or
of dq is a sum over at most seq_len = 32 keys, one of dk or dv over 32 queries times the group
of query heads, of O(1) terms (q, k, v and the output's weights drawn from N(0, 1)); reordering
such sums moves them by a few ulps of fp32 (ε = 1.2e-7) times their size. Measured at these
sizes, cp 2 and 4, both layouts: at most 2.3e-6 (Ulysses: 0, it runs the very same kernel on
head-split inputs). We allow 1e-5; a wrong mask, a lost or doubled block or a missing 1/√d
moves entries by 1e-2 or more.
"""
from __future__ import annotations

import pytest
import torch

from threefold.parallel.context_parallel import chunk_ids, join_sequence, split_positions, split_sequence
from threefold.plan.context import cp_bytes_per_layer, recompute_bytes_per_layer, qkv_bytes

ATOL = 1e-5  # see the module docstring
CASES = [("ring", 8, 4), ("ring", 4, 1), ("allgather", 8, 4), ("allgather", 4, 1), ("ulysses", 8, 4)]


# --- the split, without processes ----------------------------------------------------------------
def test_zigzag_holds_chunks_r_and_2cp_minus_1_minus_r():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert split_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    assert split_positions(16, 4, 1, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_split_then_join_gives_the_sequence_back(layout):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    parts = [split_sequence(x, 3, r, dim=1, layout=layout) for r in range(3)]
    assert sorted(torch.cat(parts, 1)[0, :, 0].tolist()) == x[0, :, 0].tolist()  # each token on one rank
    assert torch.equal(join_sequence(parts, dim=1, layout=layout), x)


def test_a_sequence_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split into 2·cp = 8 equal chunks"):
        split_positions(12, 4, 0)


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_at_cp1_each_core_is_plain_causal_attention(method):
    """A world of one: no process group; the cores still attend (nothing to exchange)."""
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import attention_core
    from threefold.parallel.context_parallel import CORES

    gen = torch.Generator().manual_seed(0)
    q, weight = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 8, generator=gen) for _ in range(2))
    results = []
    for attend in (attention_core, lambda *x: CORES[method](Comm(ParallelMesh({})))(*x, torch.arange(16))):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        (out * weight).sum().backward()
        results.append([out, *(x.grad for x in leaves)])
    for want, got in zip(*results):
        assert (want - got).abs().max() < ATOL


# --- on gloo workers: one attention call, forward and backward ------------------------------------
def attention_against_full(method: str, heads: int, kv_heads: int, layout: str = "zigzag", flash: bool = True) -> dict:
    import torch.distributed as dist

    from threefold.parallel import context_parallel

    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import attention_core
    from threefold.parallel.context_parallel import CORES

    mesh = ParallelMesh({"cp": dist.get_world_size()}, rank=dist.get_rank(), timeout_s=30)
    comm = Comm(mesh)
    cp, rank = mesh.size("cp"), mesh.coord("cp")
    batch, seq, dim = 2, 8 * cp, 8
    gen = torch.Generator().manual_seed(0)  # the same full tensors on every rank
    q, weight = (torch.randn(batch, heads, seq, dim, generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    full_out = attention_core(*full)
    (full_out * weight).sum().backward()

    def mine(x):
        return split_sequence(x, cp, rank, dim=2, layout=layout)

    local = [mine(x).requires_grad_() for x in (q, k, v)]
    core = CORES[method](comm, layout)
    saved, context_parallel.FLASH = context_parallel.FLASH, flash and context_parallel.FLASH
    try:  # the kernel for this call's forward and backward
        out = core(*local, split_positions(seq, cp, rank, layout))
        forward_records = list(comm.ledger.records)
        (out * mine(weight)).sum().backward()
    finally:
        context_parallel.FLASH = saved
    backward_records = comm.ledger.records[len(forward_records):]
    errors = {"out": (out - mine(full_out)).abs().max().item()}
    for name, x, y in zip("qkv", local, full):
        errors[f"d{name}"] = (x.grad - mine(y.grad)).abs().max().item()
    b_q, b_kv = qkv_bytes(batch, seq, heads, kv_heads, dim, cp)
    result = {"errors": errors, "bytes": comm.ledger.take(), "b_q": b_q, "b_kv": b_kv, "blocks": core.blocks,
              "sends": {"forward": [r.started for r in forward_records if r.op == "send"],
                        "backward": [r.started for r in backward_records if r.op == "send"]},
              "compute_ends": core.compute_ends}
    mesh.shutdown()
    return result


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method, heads, kv_heads", CASES)
def test_each_method_equals_full_causal_attention(distributed, cp, method, heads, kv_heads):
    for result in distributed.run(cp, attention_against_full, method, heads, kv_heads):
        assert max(result["errors"].values()) < ATOL, result["errors"]
        # One call, forward and backward: the bytes threefold/plan/context.py predicts.
        assert result["bytes"] == {"cp": round(cp_bytes_per_layer(method, cp, result["b_q"], result["b_kv"]))}


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_the_written_out_kernel_gives_the_same_attention(distributed, method):
    """The block arithmetic written out (the kernel off CPU) instead of PyTorch's flash kernel."""
    for result in distributed.run(2, attention_against_full, method, 8, 4, "zigzag", False):
        assert max(result["errors"].values()) < ATOL, result["errors"]


def test_the_ring_sends_3cp_minus_2_kv_blocks_forward_cp_minus_1_backward_2cp_minus_1(distributed):
    """(3·cp−2)·B_kv is exactly what the ring sends: cp−1 key/value blocks forward; backward the
    cp−1 key/value blocks again and cp gradient blocks (the last hop takes each home)."""
    cp = 4
    for result in distributed.run(cp, attention_against_full, "ring", 8, 4):
        assert len(result["sends"]["forward"]) == cp - 1
        assert len(result["sends"]["backward"]) == (cp - 1) + cp
        assert result["bytes"]["cp"] == (3 * cp - 2) * result["b_kv"]


@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_zigzag_balances_the_blocks_and_the_contiguous_split_does_not(distributed, method):
    cp = 4
    zigzag = [r["blocks"] for r in distributed.run(cp, attention_against_full, method, 8, 4, "zigzag")]
    contiguous = distributed.run(cp, attention_against_full, method, 8, 4, "contiguous")
    assert zigzag == [2 * cp + 1] * cp  # chunks r and 2cp−1−r: (r + 1) + (2cp − r) blocks
    assert [r["blocks"] for r in contiguous] == [4 * r + 3 for r in range(cp)]  # 3, 7, 11, 15
    assert all(max(r["errors"].values()) < ATOL for r in contiguous)  # unbalanced, but still correct


def test_the_ring_sends_the_next_block_before_the_current_product_ends(distributed):
    """Forward step t launches the send of the block it is computing before that block's
    products end, and after step t−1's ended (so it is this step's transfer, hidden behind it).
    Backward: the key/value send of step t is the first of its step's two sends."""
    cp = 4
    for result in distributed.run(cp, attention_against_full, "ring", 8, 4):
        ends, sends = result["compute_ends"]["forward"], result["sends"]["forward"]
        assert len(ends) == cp
        for step, started in enumerate(sends):
            assert started < ends[step]
            assert step == 0 or started > ends[step - 1]
        ends, kv_sends = result["compute_ends"]["backward"], result["sends"]["backward"][0:2 * (cp - 1):2]
        for step, started in enumerate(kv_sends):
            assert started < ends[step] and (step == 0 or started > ends[step - 1])


# --- apply_cp on the tiny model --------------------------------------------------------------------
def tiny_model_step(method: str, recompute: str, dp: int = 1) -> dict:
    """One forward and backward of the tiny model on this rank's tokens (its dp share of the
    two sequences, its cp part of each), and the single-process loss and gradients of the same
    batch, computed on every rank."""
    import torch.distributed as dist

    from threefold.configure import load_config
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import Llama, cross_entropy
    from threefold.parallel.context_parallel import apply_cp, attention_blocks, context_parallel_batch

    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=512"]).model
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)

    reference = Llama(cfg)
    reference.init_weights(seed=0)
    reference_loss = cross_entropy(reference(tokens), targets)
    reference_loss.backward()

    mesh = ParallelMesh({"dp": dp, "cp": dist.get_world_size() // dp}, rank=dist.get_rank(), timeout_s=60)
    comm = Comm(mesh)
    model = Llama(cfg)
    model.init_weights(seed=0)
    model.set_recompute(recompute)
    apply_cp(model, comm, method)
    mine = slice(mesh.coord("dp") * 2 // dp, (mesh.coord("dp") + 1) * 2 // dp)  # this dp rank's sequences
    my_tokens, my_targets, positions = context_parallel_batch(tokens[mine], targets[mine], mesh)
    loss = cross_entropy(model(my_tokens, positions), my_targets)  # this rank's mean: equal token counts
    loss.backward()
    attention_bytes = comm.ledger.take()
    ranks = mesh.size("dp", "cp")
    comm.all_reduce(mean := loss.detach().clone(), ("dp", "cp"), tag="loss")
    grad_error = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        g = p.grad.clone()
        comm.all_reduce(g, ("dp", "cp"), tag="grads")  # the engine's weight-gradient reduction over dp × cp
        grad_error = max(grad_error, (g / ranks - q.grad).abs().max().item())
    b_q, b_kv = qkv_bytes(2 // dp, cfg.seq_len, cfg.heads, cfg.n_kv_heads, cfg.head_dim, mesh.size("cp"))
    keys = sorted(comm.ledger.take())
    mesh.shutdown()
    return {"loss": mean.item() / ranks, "reference_loss": reference_loss.item(),
            "grad_error": grad_error, "bytes": attention_bytes, "b_q": b_q, "b_kv": b_kv,
            "layers": cfg.layers, "blocks": attention_blocks(model), "reduction_keys": keys}


@pytest.mark.parametrize("method, recompute", [
    ("ring", "none"), ("ring", "selective"), ("ring", "full"), ("allgather", "none"), ("allgather", "selective"),
    ("ulysses", "none"), ("ulysses", "selective"), ("ulysses", "full")])
def test_apply_cp_on_the_tiny_model_equals_one_process(distributed, method, recompute):
    """Loss and every weight gradient of one step at cp=2 against one process, fp32. Measured:
    the loss (≈ 6.2) within one ulp, 4.8e-7; the gradients within 6e-8. We allow 1e-5, as above."""
    cp = 2
    for result in distributed.run(cp, tiny_model_step, method, recompute):
        assert abs(result["loss"] - result["reference_loss"]) < 1e-5
        assert result["grad_error"] < 1e-5
        per_layer = cp_bytes_per_layer(method, cp, result["b_q"], result["b_kv"])
        per_layer += recompute_bytes_per_layer(method, recompute, cp, result["b_q"], result["b_kv"])
        assert result["bytes"] == {"cp": round(result["layers"] * per_layer)}


# --- bad layouts: one line naming the key ---------------------------------------------------------
@pytest.mark.parametrize("sets, cp, method, message", [
    (["model.seq_len=36"], 4, "ring",
     "parallel.cp: the zigzag split cuts model.seq_len=36 into 2·cp = 8 equal chunks; 36 is not divisible by 8"),
    (["model.heads=6", "model.kv_heads=2"], 4, "ulysses",
     "parallel.cp_method: ulysses splits the heads over cp=4, but this rank has 6 heads and 2 key/value heads"),
    ([], 2, "stripes", "parallel.cp_method: 'stripes' is not one of ring, allgather, ulysses"),
])
def test_a_layout_context_parallelism_cannot_run_is_refused_in_one_line(sets, cp, method, message):
    from threefold.config import ConfigError
    from threefold.configure import load_config
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.models.llama import Llama
    from threefold.parallel.context_parallel import apply_cp

    cfg = load_config(None, ["model.layers=1", "model.hidden=48", "model.heads=4", "model.vocab_size=64",
                             "model.seq_len=32", *sets])
    with pytest.raises(ConfigError) as err:
        apply_cp(Llama(cfg.model), Comm(ParallelMesh({"cp": cp}, rank=0)), method)  # no process starts
    assert str(err.value) == message


def wrong_positions() -> str:
    import torch.distributed as dist

    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.context_parallel import RingAttention

    mesh = ParallelMesh({"cp": 2}, rank=dist.get_rank())
    q = torch.zeros(1, 2, 8, 4)
    try:
        RingAttention(Comm(mesh))(q, q, q, torch.arange(16))  # the whole sequence's positions: a batch not split
    except ValueError as err:
        return str(err)
    finally:
        mesh.shutdown()
    return "no error"


def test_a_batch_not_split_in_zigzag_is_refused(distributed):
    for rank, message in enumerate(distributed.run(2, wrong_positions)):
        assert message == (f"ring attention on cp rank {rank} expects the zigzag split's 8 positions; "
                           "pass the batch through context_parallel_batch")


def test_dp2_cp2_reduces_the_weight_gradients_over_dp_and_cp_together(distributed):
    """World 4 as dp=2 × cp=2: each dp rank one of the two sequences, each cp rank half of it;
    the gradients summed over the (dp, cp) group, counted under "dp+cp", equal one process's."""
    for result in distributed.run(4, tiny_model_step, "ring", "none", 2):
        assert abs(result["loss"] - result["reference_loss"]) < 1e-5
        assert result["grad_error"] < 1e-5
        assert result["bytes"] == {"cp": round(result["layers"] * cp_bytes_per_layer("ring", 2, result["b_q"],
                                                                                      result["b_kv"]))}
        assert result["reduction_keys"] == ["dp+cp.grads", "dp+cp.loss"]
