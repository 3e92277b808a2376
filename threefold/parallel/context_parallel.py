"""Context parallelism: every layer's sequence split over the cp ranks.

Each of the cp ranks holds ``seq_len / cp`` tokens of every sequence, for every layer. Nothing
but attention mixes tokens, so everything else (embedding, norms, MLP, loss) runs on a rank's
tokens as it would on the whole sequence. Attention is the one place a rank needs the others'
keys and values; the attention core (``blocks.{i}.attn.core``, the model's seam) is replaced by
one of three cores below that attend over the split sequence and return this rank's outputs.

The split (load-balanced zigzag). Cut the sequence into 2·cp equal chunks; rank r holds chunks
r and 2·cp−1−r, with their tokens, labels and rotary positions. Under a causal mask the chunk i
of queries attends to chunks 0..i, so chunk i costs i+1 chunk-pair blocks; the zigzag gives
every rank (r+1) + (2·cp−r) = 2·cp+1 blocks. The plain contiguous split (rank r holds chunks 2r
and 2r+1) gives rank r 4r+3 blocks: the last rank works (4·cp−1)/3 times as long as the first,
and every rank waits for it. ``ContextParallelCore.blocks`` counts the blocks a rank computed.

Here B_kv is the key/value bytes of one rank's tokens and the formulas are in
threefold/plan/context.py, which the planner uses; these cores send exactly those bytes.

``ring`` (Liu et al. 2023, ring attention; the zigzag of Megatron-LM and ring-flash-attention).
    The key/value block of each rank travels once around the cp ring: at step t a rank attends
    its queries to the block that started on rank r−t, while it already sends that block on to
    r+1 and receives the next from r−1 (asynchronous send/recv, so the transfer hides behind
    the block's products). Each step gives a partial output and its log-sum-exp per query; the
    partials are merged exactly (softmax over a union of key sets). The backward, written out
    as an ``autograd.Function`` as flash and ring attention implementations do, sends the
    key/value blocks around again (they were not kept: keeping them would cost cp · B_kv of
    memory per layer) and with each block the gradient of its keys and values, to which every
    rank adds its share; after cp steps the gradient takes one more hop, home. The
    probabilities are recomputed from the log-sum-exp saved in forward. Bytes: forward (cp−1)
    B_kv, backward (cp−1) B_kv + cp B_kv: (3·cp−2) · B_kv per layer.
``allgather`` (Llama 3's choice: under grouped-query attention keys and values are small).
    The key/value of every rank are all-gathered once per layer, each rank attends its queries
    to the whole sequence, and in backward the key/value are gathered again and their
    gradients reduce-scattered: 3 · (cp−1) · B_kv. No overlap; one collective per direction.
``ulysses`` (DeepSpeed-Ulysses, Jacobs et al. 2023). An all-to-all turns sequence-split q, k, v
    into head-split ones: each rank gets the whole sequence for heads/cp of the heads (and
    kv_heads/cp of the key/value heads, which must divide too), attends with plain causal
    attention, and an all-to-all turns the output back. 2 · (cp−1)/cp · (2·B_q + B_kv).

Grouped-query attention: q is (b, h, s, d) and k, v (b, h_kv, s, d), never repeated to h heads
(that would multiply the bytes on the ring by h/h_kv); the block kernels take them as they are
and a key/value head's gradient sums over its group of query heads.

Composition (the engine does it, not this file): ``apply_cp(model, comm, method)`` swaps the
cores, ``context_parallel_batch`` gives this rank its tokens, targets and positions, the loss is
this rank's mean (equal token counts, so the mean over cp ranks is the global mean), and weight
gradients are reduced over dp × cp together (``comm.all_reduce(g, ("dp", "cp"))``).

Mixture of Experts: routing is per token, so an MoE block runs on this rank's tokens unchanged;
``apply_cp`` gives it a ``SplitMicroBatch`` (below), through which the statistics that are over
the micro-batch's tokens — the balance loss's f, the capacity rule — are the whole
micro-batch's, as on one process. Under expert parallelism the tokens of this rank's share are
dispatched within its ep group (ranks of the same cp coordinate); the experts' gradients are
reduced over edp × cp, the ranks holding the same experts. With the ep group folded over cp and
tp (``parallel.expert_tp = 1``) the cp ranks hold different experts, and the experts' gradients
are reduced over edp alone.
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from threefold.config import CP_METHODS, ConfigError
from threefold.distributed.comm import Comm, all_to_all_autograd, ring_pass
from threefold.distributed.mesh import ParallelMesh
from threefold.models.llama import Llama, attention_core
from threefold.models.moe import MoE, MicroBatch, capacity_keep, expert_capacity
from threefold.words import plural

METHODS = CP_METHODS  # ring, allgather, ulysses
LAYOUTS = ("zigzag", "contiguous")  # contiguous is the unbalanced split, kept to show why not


# ---------------------------------------------------------------------------------------------
# The split: which tokens a rank holds, and putting a split sequence back together
# ---------------------------------------------------------------------------------------------

def chunk_ids(cp: int, rank: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two chunks, of 2·cp equal chunks of the sequence, that ``rank`` holds."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"unknown sequence layout {layout!r}; the layouts are {LAYOUTS}")


def split_positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Positions in the sequence of the tokens ``rank`` holds, in the order it holds them."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {plural(seq_len, 'token')} does not split into 2·cp = {2 * cp} equal chunks")
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * size, (i + 1) * size) for i in chunk_ids(cp, rank, layout)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """``rank``'s part of ``x`` along its sequence dimension ``dim``."""
    return x.index_select(dim, split_positions(x.shape[dim], cp, rank, layout).to(x.device))


def join_sequence(parts: list[torch.Tensor], dim: int = 1, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's part (in rank order): the inverse of ``split_sequence``."""
    cp = len(parts)
    held = torch.cat([split_positions(parts[0].shape[dim] * cp, cp, r, layout) for r in range(cp)])
    return torch.cat(parts, dim).index_select(dim, torch.argsort(held).to(parts[0].device))


def context_parallel_batch(tokens: torch.Tensor, targets: torch.Tensor, mesh: ParallelMesh, layout: str = "zigzag"):
    """This rank's (tokens, targets, positions) of a micro-batch of whole sequences (batch, seq)."""
    cp, rank = mesh.size("cp"), mesh.coord("cp")
    positions = split_positions(tokens.shape[1], cp, rank, layout).to(tokens.device)
    return tokens.index_select(1, positions), targets.index_select(1, positions), positions


# ---------------------------------------------------------------------------------------------
# One block: a chunk of queries against a chunk of keys, forward and backward
# ---------------------------------------------------------------------------------------------
# q (b, h, c, d), k and v (b, h_kv, c, d). A block is either whole (every key precedes every
# query) or diagonal (the same chunk of the sequence: causal inside). Its forward gives the
# output of a softmax over the block's keys only and each query's log-sum-exp; its backward
# takes the *final* output and log-sum-exp of the queries, so the probabilities it recomputes
# are those of the softmax over the whole sequence.
#
# Two kernels compute them. On CPU, PyTorch's flash attention for CPU (the kernel behind
# scaled_dot_product_attention, which also returns the log-sum-exp and takes grouped-query
# key/value heads as they are), as ring-flash-attention calls flash_attn's forward and
# backward. Elsewhere, or with ``FLASH = False``, the same arithmetic written out below; it is
# the reference the tests hold the flash kernel to, about ten times slower on this CPU.

FLASH = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _use_flash(q: torch.Tensor) -> bool:
    return FLASH and q.device.type == "cpu"


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(b, h, c, …) → (b, h_kv, h/h_kv, c, …): query head i belongs to key/value head i // (h/h_kv)."""
    return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _scores(qg, k, diagonal: bool) -> torch.Tensor:
    s = torch.einsum("bkgqd,bkjd->bkgqj", qg, k) / math.sqrt(qg.shape[-1])
    if diagonal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def block_forward(q, k, v, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, h, c, d), lse (b, h, c)) of one block."""
    if _use_flash(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal)
    s = _scores(_grouped(q, k.shape[1]), k, diagonal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bkgqj,bkjd->bkgqd", torch.exp(s - lse[..., None]), v)
    return out.reshape(q.shape), lse.reshape(q.shape[:-1])


def block_backward(q, k, v, out, dout, lse, diagonal: bool):
    """(dq, dk, dv) of one block, from the queries' final ``out``, ``dout`` and ``lse``."""
    if _use_flash(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, diagonal)
    kv_heads, scale = k.shape[1], 1 / math.sqrt(q.shape[-1])
    qg, dout, lse = _grouped(q, kv_heads), _grouped(dout, kv_heads), _grouped(lse, kv_heads)
    delta = (dout * _grouped(out, kv_heads)).sum(-1)  # rowsum(dout · out)
    p = torch.exp(_scores(qg, k, diagonal) - lse[..., None])
    dv = torch.einsum("bkgqj,bkgqd->bkjd", p, dout)  # sums over the group of query heads
    ds = p * (torch.einsum("bkgqd,bkjd->bkgqj", dout, v) - delta[..., None])
    dq = torch.einsum("bkgqj,bkjd->bkgqd", ds, k) * scale
    dk = torch.einsum("bkgqj,bkgqd->bkjd", ds, qg) * scale
    return dq.reshape(q.shape), dk, dv


def _merge(out, lse, block_out, block_lse):
    """Two partial softmax outputs over disjoint key sets → the output over their union."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


def _pairs(q_chunks, kv_chunks):
    """(query half, key half, diagonal) of the blocks causality leaves: a key chunk after the
    query chunk is skipped."""
    return [(a, b, qi == kj) for a, qi in enumerate(q_chunks) for b, kj in enumerate(kv_chunks) if kj <= qi]


def _halves(x: torch.Tensor, dim: int = -2) -> list[torch.Tensor]:
    return list(x.chunk(2, dim=dim))


def attend_blocks(q, kv, q_chunks, kv_chunks, outs, lses) -> int:
    """Merge the blocks of one rank's keys/values ``kv`` (2, b, h_kv, s, d) into the running
    outputs of this rank's two query halves; returns the number of blocks computed."""
    qs, ks, vs = _halves(q), _halves(kv[0]), _halves(kv[1])
    pairs = _pairs(q_chunks, kv_chunks)
    for a, b, diagonal in pairs:
        outs[a], lses[a] = _merge(outs[a], lses[a], *block_forward(qs[a], ks[b], vs[b], diagonal))
    return len(pairs)


def attend_blocks_backward(q, kv, out, dout, lse, q_chunks, kv_chunks, dq) -> torch.Tensor:
    """Add the blocks' query gradients into ``dq``; return the gradient of ``kv``."""
    dkv = torch.zeros_like(kv)
    qs, ks, vs, outs, douts = _halves(q), _halves(kv[0]), _halves(kv[1]), _halves(out), _halves(dout)
    dqs, dks, dvs, lse_s = _halves(dq), _halves(dkv[0]), _halves(dkv[1]), _halves(lse, -1)
    for a, b, diagonal in _pairs(q_chunks, kv_chunks):
        dq_block, dk_block, dv_block = block_backward(qs[a], ks[b], vs[b], outs[a], douts[a], lse_s[a], diagonal)
        dqs[a] += dq_block  # views: these add into dq and dkv
        dks[b] += dk_block
        dvs[b] += dv_block
    return dkv


# ---------------------------------------------------------------------------------------------
# The cores
# ---------------------------------------------------------------------------------------------

class ContextParallelCore(nn.Module):
    """An ``AttentionCore`` over a sequence split across the cp ranks: q, k, v and ``positions``
    of this rank's tokens in, this rank's outputs of causal attention over the whole sequence
    out. Counts the attention blocks it computes (``blocks``; ring and all-gather, which skip
    the blocks causality masks out; Ulysses attends the whole causal triangle for heads/cp
    heads, balanced by construction) and, per step of its last call, when that step's products
    ended (``compute_ends``), so load balance and overlap can be checked."""

    method = ""

    def __init__(self, comm: Comm, layout: str = "zigzag"):
        super().__init__()
        chunk_ids(1, 0, layout)  # an unknown layout fails here
        self.comm, self.layout = comm, layout
        self.recompute = False  # selective recomputation, set by Llama.set_recompute
        self.blocks = 0
        self.compute_ends: dict[str, list[float]] = {"forward": [], "backward": []}

    @property
    def cp(self) -> int:
        return self.comm.mesh.size("cp")

    @property
    def rank(self) -> int:
        return self.comm.mesh.coord("cp")

    def chunks(self, rank: int) -> tuple[int, int]:
        return chunk_ids(self.cp, rank, self.layout)

    def forward(self, q, k, v, positions):
        # Only the shape is checked: comparing the values would copy them to the host in every
        # layer (a device sync on a GPU, and impossible on meta or fake tensors). The engine cuts
        # the batch with context_parallel_batch, which gives this rank the zigzag positions.
        if isinstance(positions, range) or positions.shape[-1] != q.shape[-2]:
            raise ValueError(f"{self.method} attention on cp rank {self.rank} expects the {self.layout} split's "
                             f"{plural(q.shape[-2], 'position')}; pass the batch through context_parallel_batch")
        return self.attend(q, k, v)

    def attend(self, q, k, v):
        raise NotImplementedError

    def recomputed(self, fn, *args):
        """``fn(*args)``, recomputed in backward under selective recomputation."""
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)


def _running(q):
    """Zero outputs and −∞ log-sum-exps for the two query halves."""
    half = _halves(q)
    return [torch.zeros_like(x) for x in half], [x.new_full(x.shape[:-1], float("-inf")) for x in half]


def _save_for_backward(ctx, core, q, k, v, outs, lses) -> torch.Tensor:
    """Keep the inputs, the output and its log-sum-exp (not the blocks); return the output. The
    output is laid out (b, s, h, d) in memory, as the flash kernel lays out its own, so the
    attention's reshape to (b, s, h·d) for its output projection is a view, not a second copy."""
    b, h, _, d = q.shape
    out = q.new_empty(b, q.shape[-2], h, d).transpose(1, 2)
    torch.cat(outs, dim=-2, out=out)
    lse = torch.cat(lses, dim=-1)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.core = core
    return out


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, core: "RingAttention"):
        outs, lses = _running(q)

        def attend(owner: int, kv: torch.Tensor) -> None:  # while the next block is in flight
            core.blocks += attend_blocks(q, kv, core.chunks(core.rank), core.chunks(owner), outs, lses)

        core.compute_ends["forward"] = ring_pass(core.comm, torch.stack([k, v]), "cp", attend)
        return _save_for_backward(ctx, core, q, k, v, outs, lses)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        core, dout = ctx.core, dout.contiguous()
        comm, cp, rank = core.comm, core.cp, core.rank
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        core.compute_ends["backward"] = []
        receiving_grad = sending_grad = None
        for step in range(cp):
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                sending = comm.send(kv, "cp", (rank + 1) % cp)
                receiving = comm.recv(incoming, "cp", (rank - 1) % cp)
            dkv = attend_blocks_backward(q, kv, out, dout, lse, core.chunks(rank), core.chunks((rank - step) % cp), dq)
            core.compute_ends["backward"].append(time.perf_counter())
            if receiving_grad is not None:  # the gradient of this block from the ranks it visited before
                receiving_grad.wait()
                dkv += incoming_grad
                sending_grad.wait()
            if cp == 1:  # the only block is this rank's own: no hop
                return dq, dkv[0], dkv[1], None
            incoming_grad = torch.empty_like(kv)
            sending_grad = comm.send(dkv, "cp", (rank + 1) % cp)
            receiving_grad = comm.recv(incoming_grad, "cp", (rank - 1) % cp)
            if step < cp - 1:
                sending.wait()
                receiving.wait()
                kv = incoming
        receiving_grad.wait()  # this rank's own block, back home with every rank's share
        sending_grad.wait()
        return dq, incoming_grad[0], incoming_grad[1], None


class RingAttention(ContextParallelCore):
    """Key/value blocks passed around the cp ring, the next in flight during the current block."""

    method = "ring"

    def attend(self, q, k, v):
        return self.recomputed(_Ring.apply, q, k, v, self)  # the ring's forward again, sends included


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, core: "AllGatherAttention"):
        outs, lses = _running(q)
        gathered = core.gather(torch.stack([k, v]))
        for owner in range(core.cp):
            core.blocks += attend_blocks(q, gathered[owner], core.chunks(core.rank), core.chunks(owner), outs, lses)
        core.compute_ends["forward"] = [time.perf_counter()]
        return _save_for_backward(ctx, core, q, k, v, outs, lses)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        core, dout = ctx.core, dout.contiguous()
        dq = torch.zeros_like(q)
        gathered = core.gather(torch.stack([k, v]))  # again: the gathered sequence was not kept
        grads = torch.stack([attend_blocks_backward(q, gathered[owner], out, dout, lse, core.chunks(core.rank),
                                                    core.chunks(owner), dq) for owner in range(core.cp)])
        core.compute_ends["backward"] = [time.perf_counter()]
        mine = torch.empty_like(grads[0])
        core.comm.reduce_scatter(mine.view(-1), grads.view(-1), "cp")
        return dq, mine[0], mine[1], None


class AllGatherAttention(ContextParallelCore):
    """Key/value all-gathered once per layer; their gradients reduce-scattered in backward."""

    method = "allgather"

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        gathered = kv.new_empty(self.cp * kv.numel())  # flat in and out, as gloo wants
        self.comm.all_gather(gathered, kv.reshape(-1), "cp")
        return gathered.view(self.cp, *kv.shape)

    def attend(self, q, k, v):
        return self.recomputed(_AllGather.apply, q, k, v, self)  # the gather again


class UlyssesAttention(ContextParallelCore):
    """All-to-all from sequence-split to head-split, plain causal attention over the whole
    sequence for heads/cp heads, all-to-all back. Autograd differentiates it: the backward of
    an all-to-all is the transposed all-to-all (``all_to_all_autograd``)."""

    method = "ulysses"

    def attend(self, q, k, v):
        cp = self.cp
        if q.shape[1] % cp or k.shape[1] % cp:
            raise ValueError(f"ulysses attention needs heads ({q.shape[1]}) and key/value heads ({k.shape[1]}) "
                             f"divisible by cp={cp}")
        # The gathered sequence comes in rank order; attention wants it in position order.
        held = torch.cat([split_positions(q.shape[2] * cp, cp, r, self.layout) for r in range(cp)]).to(q.device)
        in_order = torch.argsort(held)
        qh, kh, vh = (self._to_heads(x).index_select(2, in_order) for x in (q, k, v))
        out = self.recomputed(attention_core, qh, kh, vh)  # the local attention only: no all-to-all again
        self.compute_ends["forward"] = [time.perf_counter()]
        return self._to_sequence(out.index_select(2, held))

    def _to_heads(self, x):
        """(b, H, s, d) this rank's tokens → (b, H/cp, cp·s, d) every rank's tokens of this rank's heads."""
        b, heads, s, d = x.shape
        cp = self.cp
        send = x.reshape(b, cp, heads // cp, s, d).transpose(0, 1)  # head group j goes to rank j
        got = all_to_all_autograd(self.comm, send, "cp")  # got[i]: rank i's tokens
        return got.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * s, d)

    def _to_sequence(self, y):
        """The inverse of ``_to_heads``."""
        b, heads_here, seq, d = y.shape
        cp = self.cp
        send = y.reshape(b, heads_here, cp, seq // cp, d).permute(2, 0, 1, 3, 4)  # rank j's tokens go to j
        got = all_to_all_autograd(self.comm, send, "cp")  # got[j]: head group j for this rank's tokens
        return got.transpose(0, 1).reshape(b, cp * heads_here, seq // cp, d)


CORES = {"ring": RingAttention, "allgather": AllGatherAttention, "ulysses": UlyssesAttention}


# ---------------------------------------------------------------------------------------------
# Mixture-of-Experts blocks: routing is per token, its statistics are over the micro-batch
# ---------------------------------------------------------------------------------------------

def routing_tag() -> str:
    """Training's routing statistics count under "cp.routing" (apart from the step's counters,
    "cp.moe" or "dp+cp.moe", which ``Engine.end_moe_step`` reduces), evaluation's under "cp.eval"."""
    return "routing" if torch.is_grad_enabled() else "eval"


class SplitMicroBatch(MicroBatch):
    """The ``MoE.micro_batch`` seam of a block whose calls see this rank's share of every sequence
    of the micro-batch (models/moe.py ``MicroBatch``): its zigzag share over cp, and, where the
    experts are folded over tp (``tensor_parallel.SequenceShareMoE``), the tp rank's contiguous
    s/t of that share (``axes`` ("tp",) or ("cp", "tp")). The experts' outputs are per token and
    need nothing; what is over the micro-batch's tokens is reduced over the group of ``axes``:

    - the balance loss's f: this call's routed counts all-reduced (E int64, only when the loss is
      on). P stays the share's mean: the loss is linear in P, and the engine averages the cp
      ranks' gradients (the tp ranks give back 1/t of theirs), so the mean of the shares' losses
      E·Σ f_i·P_i(share) is the micro-batch's loss and the mean of their gradients its gradient
      (``load_balancing_loss``);
    - the capacity rule (factor > 0): C and the priority order are the whole micro-batch's, so
      the chosen experts of every share are all-gathered ((T/n)·k int64 from each of the n
      ranks), put back in sequence order (the tp shares side by side, then ``join_sequence``
      over cp), the single-process rule applied to all of them, and this rank's share of the
      verdict kept; the same tokens drop as on one process;
    - the step's counters (routed, dropped) stay this share's: ``Engine.end_moe_step`` sums them
      over the ranks that route different tokens, which is also what DeepSeek-V3's bias update
      reads.

    Bytes per MoE layer and micro-batch over cp (``plan/context.moe_bytes_per_layer``, under
    "cp.routing"): 2·(cp−1)/cp · E · 8 for the counts, (cp−1) · (T/cp) · k · 8 for the capacity's
    gather; a forward recomputed in full repeats both. Over ("cp", "tp") the same with n = cp·t
    ranks, under "cp+tp.routing"."""

    def __init__(self, comm: Comm, layout: str = "zigzag", axes: tuple[str, ...] = ("cp",)):
        self.comm, self.layout, self.axes = comm, layout, axes

    def routed_counts(self, counts: torch.Tensor) -> torch.Tensor:
        total = counts.clone()
        self.comm.all_reduce(total, self.axes, tag=routing_tag())
        return total

    def capacity_keep(self, experts, batch_shape, num_experts, factor):
        if not factor:  # dropless: nothing to agree on
            return super().capacity_keep(experts, batch_shape, num_experts, factor)
        if len(batch_shape) != 2:
            raise ValueError(f"a sequence-split MoE block takes (batch, positions, hidden), not {batch_shape}")
        comm, top_k, mesh = self.comm, experts.shape[1], self.comm.mesh
        cp, t = (mesh.size(a) if a in self.axes else 1 for a in ("cp", "tp"))
        batch, positions = batch_shape
        gathered = experts.new_empty(cp * t * experts.numel())
        comm.all_gather(gathered, experts.reshape(-1).contiguous(), self.axes, tag=routing_tag())
        # (cp, t, b, s/(cp·t), k) → each cp rank's share with its tp ranks' positions side by side
        shares = gathered.view(cp, t, batch, positions, top_k).movedim(1, 2).reshape(cp, batch, t * positions, top_k)
        whole = join_sequence(list(shares), dim=1, layout=self.layout) if cp > 1 else shares[0]
        capacity = expert_capacity(whole.shape[0] * whole.shape[1], top_k, num_experts, factor)
        kept = capacity_keep(whole.reshape(-1, top_k), num_experts, capacity).view(whole.shape)
        if cp > 1:
            kept = split_sequence(kept, cp, mesh.coord("cp"), dim=1, layout=self.layout)
        tp_rank = mesh.coord("tp") if t > 1 else 0
        return kept.narrow(1, tp_rank * positions, positions).reshape(-1, top_k)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

def check_context_parallel(model: Llama, cp: int, method: str) -> None:
    """The layout constraints, as one line naming the key (ConfigError)."""
    if method not in CORES:
        raise ConfigError(f"parallel.cp_method: {method!r} is not one of {', '.join(METHODS)}")
    if model.cfg.seq_len % (2 * cp):
        raise ConfigError(f"parallel.cp: the zigzag split cuts model.seq_len={model.cfg.seq_len} into 2·cp = "
                          f"{2 * cp} equal chunks; {model.cfg.seq_len} is not divisible by {2 * cp}")
    if method == "ulysses":
        attn = model.blocks[0].attn  # head counts from the weights: tensor parallelism may have sliced them
        heads, kv_heads = attn.wq.weight.shape[0] // attn.head_dim, attn.wk.weight.shape[0] // attn.head_dim
        if heads % cp or kv_heads % cp:
            raise ConfigError(f"parallel.cp_method: ulysses splits the heads over cp={cp}, but this rank has "
                              f"{plural(heads, 'head')} and {plural(kv_heads, 'key/value head')}")


def apply_cp(model: Llama, comm: Comm, method: str = "ring", layout: str = "zigzag") -> Llama:
    """Replace every block's attention core, in place, with ``method``'s context-parallel core
    over the mesh's cp axis (keeping each core's recompute setting), and give every MoE block
    the seam that reduces its micro-batch statistics over cp (``SplitMicroBatch``); returns the
    model."""
    cp = comm.mesh.size("cp")
    check_context_parallel(model, cp, method)
    for block in model.blocks:
        core = CORES[method](comm, layout)
        core.recompute = block.attn.core.recompute
        block.attn.core = core
        if isinstance(block.mlp, MoE):  # experts folded over tp: the tp ranks' shares too
            folded = "tp" in getattr(block.mlp.micro_batch, "axes", ())
            block.mlp.micro_batch = SplitMicroBatch(comm, layout, ("cp", "tp") if folded else ("cp",))
    return model


def attention_blocks(model: nn.Module) -> int:
    """Attention blocks this rank computed, over every context-parallel core of ``model``."""
    return sum(m.blocks for m in model.modules() if isinstance(m, ContextParallelCore))
