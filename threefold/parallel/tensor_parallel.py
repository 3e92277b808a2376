"""Tensor parallelism (Megatron-LM) with sequence parallelism, composed with data parallelism.

The tp ranks of a group hold different slices of every weight matrix and compute one layer
together. A transformer sublayer is two matrix products, so (Shoeybi et al. 2019):

    column-parallel  y_r = x · A_rᵀ       A's rows (output features) split: rank r gets its own
                                           heads of q/k/v, its own columns of SwiGLU's gate and up;
                                           the input x must be whole on every rank.
    row-parallel     z   = Σ_r y_r · B_rᵀ  B's columns (input features) split to match: rank r
                                           multiplies its own y_r; the partial sums are added.

Between the two everything is local (rotary, attention over the rank's heads, silu·up), so a
sublayer needs one collective forward, ``g`` (all-reduce of the partial sums), and one backward,
``f`` (all-reduce of dL/dx, to which every rank's slice contributes). ``f`` and ``g`` are
conjugate: each is the identity in one direction and an all-reduce in the other.

Sequence parallelism (Korthikanti et al. 2022). Outside the column…row pairs, the norms and
residual adds are replicated work on replicated activations. SP splits them along the sequence
instead: ``g`` becomes a reduce-scatter (each rank keeps the sum for its s/t positions) and
``f`` an all-gather (the full sequence, just before the column-parallel linears). A ring
all-reduce *is* a reduce-scatter followed by an all-gather, so the bytes are the same; what
SP buys is memory: the norm region's activations shrink by tp. The column-parallel linears
save only this rank's part of their input and gather it again in backward (Megatron does the
same), one extra all-gather per sublayer.

Overlap (``parallel.tp_overlap``, SP only). Each sublayer's all-gather and the column-parallel
products after it become one operation, a ring of t−1 sends in which every rank multiplies the
sequence chunk it holds while the next chunk travels; the row-parallel product and the
reduce-scatter after it become the reverse ring, each rank computing its addend for one chunk
while the previous chunk's running sum travels. Backward runs the same rings on the gradients.
The bytes are those of the collectives, counted as the sends they are. Without SP there is
nothing to pipeline (the all-gather half of an all-reduce has no product beside it).

Vocabulary. The embedding table and the output head are split by rows of the vocabulary,
padded with zero rows to a multiple of tp (the padding never enters the loss). A rank looks up
the tokens it owns and zeros the others, then ``g`` sums. The loss never materialises the full
logits: each rank holds the logits of its vocabulary slice, and three per-token numbers cross
the group (the max, the sum of exponentials and the target's logit). With tied embeddings the
head and the table are the same shard.

The plan, ``TENSOR_PARALLEL_PLAN``, maps module names of the plain model to styles, as
torchtitan does; ``parallelize`` applies it in place to a full model that every rank built from
the same seed, so each rank keeps exactly its slice of the single-process model's weights.

Communication per micro-batch on the tp axis (B = micro_batch · seq_len · hidden · 4 bytes,
``a`` = 2(t−1)/t, the ring factor of an all-reduce), counted by the CommLedger under "tp":
  without SP  (4·L + 2) · a · B: f and g of both sublayers of each layer, g after the
              embedding, f before the head;
  with SP     (5·L + 2.5) · a · B: the same as reduce-scatter/all-gather pairs, plus the
              backward re-gather of each column-parallel input (two per layer, one for the head);
  recompute=full adds the block's forward once more, up to its last saved tensor (PyTorch's
              checkpoint stops recomputing there, so the MLP's g is not repeated): L · a · B
              without SP, 1.5 · L · a · B with SP.
Under "tp.loss": per micro-batch, an all-reduce of 3 fp32 numbers per token. Under
"tp.partial_grads" (SP only): once per step, the gradients this rank holds of the norm gains and
of the MoE blocks (router, experts, shared experts: ``SequenceSplitMoE``; with the experts folded
over tp the router alone: ``SequenceShareMoE``), summed over tp (each rank saw only its part of
the sequence).

Composition: ``apply_tp`` is the first transformation of the plain model (train/engine.py
applies them in order). It returns each parameter's ``Placement`` (the slice it keeps, or
replicated; with SP the norm gains' gradients are partial sums over tp), from which the
gradient norm, the full state dict and the checkpoint pieces are computed for every layout
(placements.py); the engine's loss is ``vocab_parallel_cross_entropy``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from threefold.config import ConfigError
from threefold.distributed.comm import Comm, ring_pass, ring_reduce_scatter
from threefold.models.llama import Llama
from threefold.models.moe import MoE, Routing
from threefold.parallel.placements import Placement
from threefold.words import plural


# ---------------------------------------------------------------------------------------------
# The tensor-parallel group, and moving a sequence between whole and split
# ---------------------------------------------------------------------------------------------

@dataclass
class TensorParallelGroup:
    """This rank's place in its tp group, and what the layers ask of the group."""
    comm: Comm
    rank: int
    size: int
    sequence_parallel: bool
    vocab_size: int  # of the plain model; the shards hold it padded to a multiple of ``size``
    overlap: bool = False  # parallel.tp_overlap: SP's collectives as rings pipelined with the products
    experts_folded: bool = False  # parallel.expert_tp = 1: the MoE blocks are SequenceShareMoE (FoldedMoE)
    ring_ends: list[list[float]] = field(default_factory=list)  # the last overlapped operation's
    # rings: when each chunk's product ended (to set beside the sends' launch times in the ledger)


def traffic_tag(training: str | None = None) -> str | None:
    """The ledger tag of a forward collective: evaluation's are counted apart from training's
    (the planner predicts the latter), under "eval"."""
    return training if torch.is_grad_enabled() else "eval"


def all_gather_stacked(local: torch.Tensor, tp: TensorParallelGroup, tag: str | None) -> torch.Tensor:
    """(t, …): every rank's ``local``, in rank order (gathered flat: gloo cannot fill a stacked output)."""
    flat = local.new_empty((tp.size * local.shape[0], *local.shape[1:]))
    tp.comm.all_gather(flat, local.contiguous(), "tp", tag=tag)
    return flat.view(tp.size, *local.shape)


def all_gather_sequence(shard: torch.Tensor, tp: TensorParallelGroup, tag: str | None) -> torch.Tensor:
    """(b, s/t, …) on each rank → (b, s, …): the ranks' parts of the sequence, in rank order."""
    parts = all_gather_stacked(shard, tp, tag)
    return parts.movedim(0, 1).reshape(shard.shape[0], -1, *shard.shape[2:])


def reduce_scatter_sequence(full: torch.Tensor, tp: TensorParallelGroup, tag: str | None) -> torch.Tensor:
    """(b, s, …) partial sums on each rank → (b, s/t, …): this rank's positions, summed over ranks."""
    b, s = full.shape[:2]
    if s % tp.size:
        raise ConfigError(f"parallel.sequence_parallel: a sequence of {plural(s, 'token')} does not split over tp={tp.size}")
    piece = (s // tp.size, *full.shape[2:])
    # Rank-major and flat, as gloo wants the input: rank r's part of every sequence is block r.
    parts = full.reshape(b, tp.size, *piece).movedim(1, 0).reshape(tp.size * b, *piece)
    out = full.new_empty((b, *piece))
    tp.comm.reduce_scatter(out, parts, "tp", tag=tag)
    return out


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that a collective may overwrite (autograd may share a gradient between nodes)."""
    return t.clone(memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# The conjugate operators
# ---------------------------------------------------------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f: enter a tensor-parallel region. Forward: identity (every rank holds the whole input).
    Backward: all-reduce, since every rank's slice of the weights contributes a part of dL/dx."""

    @staticmethod
    def forward(ctx, x, tp: TensorParallelGroup):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = _fresh(grad)
        ctx.tp.comm.all_reduce(grad, "tp")
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: leave a tensor-parallel region. Forward: all-reduce the ranks' partial sums.
    Backward: identity (the sum's gradient reaches every addend unchanged)."""

    @staticmethod
    def forward(ctx, partial, tp: TensorParallelGroup, tag: str | None):
        total = _fresh(partial)
        tp.comm.all_reduce(total, "tp", tag=tag)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class ReduceScatterSequence(torch.autograd.Function):
    """g under SP: forward reduce-scatter the partial sums along the sequence (each rank keeps the
    sum for its s/t positions). Backward: all-gather the gradient along the sequence."""

    @staticmethod
    def forward(ctx, partial, tp: TensorParallelGroup, tag: str | None):
        ctx.tp = tp
        return reduce_scatter_sequence(partial, tp, tag)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.tp, None), None, None


class SequenceGathered:
    """One forward pass's all-gathered sublayer input, shared by the sublayer's column-parallel
    linears. During forward they read ``shard`` and save it, not the gathered input; in backward
    the first of them to need the whole input gathers it again, and the rest reuse it until the
    gather's own backward (which runs after all of theirs) drops it."""

    def __init__(self, shard: torch.Tensor, tp: TensorParallelGroup):
        self.shard, self.tp = shard, tp
        self.full: torch.Tensor | None = None

    def regather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.full = all_gather_sequence(shard, self.tp, None)
        return self.full


class GatherSequence(torch.autograd.Function):
    """f under SP: forward all-gather along the sequence. Backward: reduce-scatter the gradient
    (the sum over ranks of their slices' contributions, each rank keeping its positions)."""

    @staticmethod
    def forward(ctx, shard, gathered: SequenceGathered, tag: str | None):
        ctx.gathered = gathered
        return all_gather_sequence(shard, gathered.tp, tag)

    @staticmethod
    def backward(ctx, grad):
        ctx.gathered.full = None
        return reduce_scatter_sequence(grad, ctx.gathered.tp, None), None, None


class ColumnParallelMatmul(torch.autograd.Function):
    """x·Wᵀ on the gathered input, saving this rank's sequence shard of x instead of x: the
    weight's gradient gathers x again. dL/dx flows back to ``GatherSequence``.

    Each gradient is computed only when the running backward pass will use it, as autograd's
    own nodes do: a zero-bubble pipeline runs this node twice, once for the input gradient
    (B) and once for the weight gradient (W), and each must pay for its half only."""

    @staticmethod
    def forward(ctx, full, shard, weight, gathered: SequenceGathered):
        ctx.save_for_backward(shard, weight)
        ctx.gathered = gathered
        ctx.input_node, ctx.weight_node = full.grad_fn, get_gradient_edge(weight).node
        return F.linear(full, weight)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        grad_input = grad_weight = None
        if _will_run(ctx.input_node):
            grad_input = grad @ weight.to(grad.dtype)
        if _will_run(ctx.weight_node):
            full = ctx.gathered.regather(shard).to(grad.dtype)
            grad_weight = grad.reshape(-1, grad.shape[-1]).t() @ full.reshape(-1, full.shape[-1])
        return grad_input, None, grad_weight, None


def _will_run(node) -> bool:
    """Whether the backward pass now running goes through ``node`` (and so needs its gradient)."""
    return node is not None and torch._C._will_engine_execute_node(node)


def _node(tensor: torch.Tensor):
    """The autograd node a gradient for ``tensor`` flows into (None if it needs none)."""
    return get_gradient_edge(tensor).node if tensor.requires_grad else None


# ---------------------------------------------------------------------------------------------
# The same collectives overlapped with their products (parallel.tp_overlap)
# ---------------------------------------------------------------------------------------------
# The collective-matmul of Wang et al. 2023 ("Overlap communication with dependent computation
# via decomposition"), Megatron-Core's tp_comm_overlap ring exchange and PyTorch's async-TP
# micro-pipelining: an all-gather followed by a product is a ring of t−1 sends, each rank
# multiplying the sequence chunk it holds while the next one travels; a product followed by a
# reduce-scatter is the same ring the other way, each rank computing its addend for one chunk
# while the running sum of the previous chunk travels. Same bytes as the collectives, counted
# as the sends they are (t−1 chunks of B/t each = (t−1)/t·B, the ring convention's figure).

def _rows(chunk: int, size: int) -> slice:
    return slice(chunk * size, (chunk + 1) * size)


class AllGatherColumnMatmuls(torch.autograd.Function):
    """f under SP with tp_overlap, fused with every column-parallel product of one input (q, k, v;
    gate, up; the head). Forward: the ring all-gather of x's sequence shards, each shard
    multiplied by every weight as it arrives, the next in flight meanwhile; returns the gathered
    x and the products. Backward: dL/dx = Σ_i dy_i·W_i as a ring reduce-scatter (each chunk's
    addend computed while the previous chunk's sum travels), and each dW_i = Σ_c dy_i[c]ᵀ·x_c
    from the shards passed around the ring again (only this rank's shard was saved)."""

    @staticmethod
    def forward(ctx, shard, tp: TensorParallelGroup, tag: str | None, *weights):
        ctx.set_materialize_grads(False)
        b, n = shard.shape[:2]
        full = shard.new_empty((b, tp.size * n, *shard.shape[2:]))
        products: list[torch.Tensor | None] = [None] * len(weights)

        def multiply(owner: int, chunk: torch.Tensor) -> None:
            rows = _rows(owner, n)
            full[:, rows] = chunk
            for i, weight in enumerate(weights):
                product = F.linear(chunk, weight)
                if products[i] is None:  # its dtype is the product's (autocast)
                    products[i] = product.new_empty((b, tp.size * n, product.shape[-1]))
                products[i][:, rows] = product

        tp.ring_ends = [ring_pass(tp.comm, shard, "tp", multiply, tag)]
        ctx.save_for_backward(shard, *weights)
        ctx.tp, ctx.input_node, ctx.weight_nodes = tp, _node(shard), [_node(w) for w in weights]
        return (full, *products)

    @staticmethod
    def backward(ctx, grad_full, *grads):
        shard, *weights = ctx.saved_tensors
        tp, n = ctx.tp, shard.shape[1]
        tp.ring_ends = []
        grad_shard = None
        if _will_run(ctx.input_node):
            def addend(chunk: int) -> torch.Tensor:  # this rank's part of dL/dx at rank chunk's positions
                rows = _rows(chunk, n)
                total = None if grad_full is None else grad_full[:, rows].clone()
                for grad, weight in zip(grads, weights):
                    if grad is not None:
                        part = grad[:, rows] @ weight.to(grad.dtype)
                        total = part if total is None else total.add_(part)
                return total

            grad_shard, ends = ring_reduce_scatter(tp.comm, addend, "tp")
            tp.ring_ends.append(ends)
        wanted = [grad is not None and _will_run(node) for grad, node in zip(grads, ctx.weight_nodes)]
        grad_weights: list[torch.Tensor | None] = [None] * len(weights)
        if any(wanted):
            def accumulate(owner: int, chunk: torch.Tensor) -> None:
                rows = _rows(owner, n)
                for i in (i for i, want in enumerate(wanted) if want):
                    grad = grads[i][:, rows]
                    x = chunk.to(grad.dtype).reshape(-1, chunk.shape[-1])
                    part = grad.reshape(-1, grad.shape[-1]).t() @ x
                    grad_weights[i] = part if grad_weights[i] is None else grad_weights[i].add_(part)

            tp.ring_ends.append(ring_pass(tp.comm, shard, "tp", accumulate))
        return (grad_shard, None, None, *grad_weights)


class RowMatmulReduceScatter(torch.autograd.Function):
    """g under SP with tp_overlap, fused with the row-parallel product before it. Forward: this
    rank's addend x[c]·Wᵀ for one chunk of the sequence at a time, each chunk's running sum
    travelling the ring while the next addend is computed (a ring reduce-scatter). Backward: the
    output gradient's shards passed around the ring (an all-gather), each multiplied as it
    arrives for dL/dx and dL/dW. When backward runs in two passes (a zero-bubble pipeline's B,
    then W), the gathered gradient is kept from B for W, as autograd keeps a linear's input."""

    @staticmethod
    def forward(ctx, x, weight, tp: TensorParallelGroup, tag: str | None):
        n = x.shape[1] // tp.size
        out, ends = ring_reduce_scatter(tp.comm, lambda chunk: F.linear(x[:, _rows(chunk, n)], weight), "tp", tag)
        tp.ring_ends = [ends]
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.input_node, ctx.weight_node = tp, _node(x), _node(weight)
        ctx.grad_full = None  # the gathered output gradient, kept from B for W
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp, n = ctx.tp, grad.shape[1]
        want_input, want_weight = _will_run(ctx.input_node), _will_run(ctx.weight_node)
        keep = ctx.weight_node is not None and not want_weight  # W comes later and needs it
        grad_x = x.new_empty(x.shape, dtype=grad.dtype) if want_input else None
        grad_weight = None
        tp.ring_ends = []

        def multiply(owner: int, chunk: torch.Tensor) -> None:
            nonlocal grad_weight
            rows = _rows(owner, n)
            if want_input:
                grad_x[:, rows] = chunk @ weight.to(chunk.dtype)
            if want_weight:
                xs = x[:, rows].to(chunk.dtype).reshape(-1, x.shape[-1])
                part = chunk.reshape(-1, chunk.shape[-1]).t() @ xs
                grad_weight = part if grad_weight is None else grad_weight.add_(part)
            if keep:
                ctx.grad_full[:, rows] = chunk

        if ctx.grad_full is not None:  # W after B: the gradient is here already
            full, ctx.grad_full = ctx.grad_full, None
            for owner in range(tp.size):
                multiply(owner, full[:, _rows(owner, n)])
        elif want_input or want_weight:
            if keep:
                ctx.grad_full = grad.new_empty((grad.shape[0], tp.size * n, *grad.shape[2:]))
            tp.ring_ends = [ring_pass(tp.comm, grad, "tp", multiply)]
        return grad_x, grad_weight, None, None


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean next-token loss from vocab-sharded logits. Each rank holds the logits of its rows of
    the (padded) vocabulary; per token, the max, the sum of exp(logit − max) and the target's
    logit are reduced over tp, so no rank ever holds a whole row of logits. Padding rows are
    masked out. Backward: softmax − one-hot on this rank's slice, with no communication."""

    @staticmethod
    def forward(ctx, logits, targets, tp: TensorParallelGroup, tag: str | None):
        local_vocab = logits.shape[-1]
        first = tp.rank * local_vocab
        logits = logits.float()
        if first + local_vocab > tp.vocab_size:
            padding = torch.arange(first, first + local_vocab, device=logits.device) >= tp.vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
        row_max = logits.amax(dim=-1)
        tp.comm.all_reduce(row_max, "tp", op=dist.ReduceOp.MAX, tag=tag)
        shifted = logits - row_max.unsqueeze(-1)
        local_target = targets - first
        mine = (local_target >= 0) & (local_target < local_vocab)
        local_target = local_target.clamp(0, local_vocab - 1)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        tp.comm.all_reduce(sums, "tp", tag=tag)
        sum_exp, target_logit = sums
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, mine)
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local_target, mine = ctx.saved_tensors
        scale = grad / local_target.numel()
        grad_logits = softmax * scale
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), (-scale * mine).unsqueeze(-1).to(grad_logits.dtype))
        return grad_logits, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 tp: TensorParallelGroup) -> torch.Tensor:
    """The same number as ``models.llama.cross_entropy`` of the whole logits, from this rank's slice."""
    return VocabParallelCrossEntropy.apply(logits, targets, tp, traffic_tag("loss"))


# ---------------------------------------------------------------------------------------------
# Parallel layers
# ---------------------------------------------------------------------------------------------

class PreparedInput:
    """The first input of a module whose column-parallel linears all read it (attention: q, k, v;
    SwiGLU: gate, up; the head). A forward pre-hook makes it whole on every rank: f without SP,
    an all-gather along the sequence with SP."""

    def __init__(self, tp: TensorParallelGroup):
        self.tp = tp
        self.gathered: SequenceGathered | None = None  # SP: this forward's, while it runs
        self.linears: list[ColumnParallelLinear] = []  # the column-parallel linears that read it
        self.products: dict[ColumnParallelLinear, torch.Tensor] = {}  # tp_overlap: this forward's
        self.full: torch.Tensor | None = None  # tp_overlap: the gathered input they are products of

    def before(self, module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        if not self.tp.sequence_parallel:
            return (CopyToTensorParallel.apply(x, self.tp), *rest)
        if self.tp.overlap:
            self.full, *products = AllGatherColumnMatmuls.apply(x, self.tp, traffic_tag(),
                                                                *(linear.weight for linear in self.linears))
            self.products = dict(zip(self.linears, products))
            return (self.full, *rest)
        self.gathered = SequenceGathered(x.detach(), self.tp)
        return (GatherSequence.apply(x, self.gathered, traffic_tag()), *rest)

    def after(self, module: nn.Module, args: tuple, output) -> None:
        if self.gathered is not None:
            self.gathered.shard = None  # the linears saved it; do not keep it alive here
            self.gathered = None
        self.products, self.full = {}, None


class ColumnParallelLinear(nn.Module):
    """y_r = x·W_rᵀ with W_r this rank's rows of the weight (output features). ``input`` is the
    PreparedInput that makes x whole (set when the plan attaches it)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight
        self.input: PreparedInput | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is self.input.full:  # tp_overlap: computed with the gather
            return self.input.products.pop(self)
        gathered = self.input.gathered
        if gathered is not None and torch.is_grad_enabled():
            return ColumnParallelMatmul.apply(x, gathered.shard, self.weight, gathered)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"local out_features={self.weight.shape[0]}, in_features={self.weight.shape[1]}"


class RowParallelLinear(nn.Module):
    """z = Σ_r x_r·W_rᵀ with W_r this rank's columns (input features): a local product, then g
    (all-reduce; with SP, reduce-scatter along the sequence)."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallelGroup):
        super().__init__()
        self.weight, self.tp = weight, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.overlap:
            return RowMatmulReduceScatter.apply(x, self.weight, self.tp, traffic_tag())
        return leave_tensor_parallel(F.linear(x, self.weight), self.tp)

    def extra_repr(self) -> str:
        return f"out_features={self.weight.shape[0]}, local in_features={self.weight.shape[1]}"


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the (padded) table: it looks up the tokens it owns, zeros for the
    others, and g sums the ranks' lookups (with SP: reduce-scatters them along the sequence)."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallelGroup):
        super().__init__()
        self.weight, self.tp = weight, tp

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = tokens - self.tp.rank * rows
        outside = (local < 0) | (local >= rows)
        found = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tensor_parallel(found, self.tp)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"local rows={rows} (from {self.tp.rank * rows}), dim={dim}"


def leave_tensor_parallel(partial: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    """g: sum the ranks' partial results (SP: each rank keeps its part of the sequence)."""
    if tp.sequence_parallel:
        return ReduceScatterSequence.apply(partial, tp, traffic_tag())
    return ReduceFromTensorParallel.apply(partial, tp, traffic_tag())


# ---------------------------------------------------------------------------------------------
# The plan: module name → style
# ---------------------------------------------------------------------------------------------

class Slicer:
    """Applies styles to one model: cuts parameters (a tied one once) and records each placement."""

    def __init__(self, tp: TensorParallelGroup):
        self.tp = tp
        self.placements: dict[str, Placement] = {}  # state-dict key → where this rank's tensor sits
        self._shards: dict[int, nn.Parameter] = {}  # id of a plain parameter → its shard

    def slice(self, key: str, param: nn.Parameter, dim: int | None, pad: bool = False) -> nn.Parameter:
        """This rank's slice of ``param`` along ``dim`` (None: the parameter itself, replicated;
        under SP its gradient is a partial sum over tp, each rank having seen part of the sequence)."""
        full = tuple(param.shape)
        if dim is None:
            self.placements[key] = Placement(full, partial=("tp",) if self.tp.sequence_parallel else ())
            return param
        if id(param) not in self._shards:
            if full[dim] % self.tp.size and not pad:
                raise ConfigError(f"parallel.tp: {self.tp.size} does not divide {key} along dimension {dim} ({full[dim]})")
            self._shards[id(param)] = nn.Parameter(rank_slice(param.detach(), dim, self.tp).clone())
        local = self._shards[id(param)].shape[dim]
        self.placements[key] = Placement(full, dim, self.tp.rank * local, sharded=("tp",))
        return self._shards[id(param)]


def rank_slice(full: torch.Tensor, dim: int, tp: TensorParallelGroup) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim``, zero-padded first to a multiple of tp."""
    size = full.shape[dim]
    piece = -(-size // tp.size)
    if piece * tp.size != size:
        padding = list(full.shape)
        padding[dim] = piece * tp.size - size
        full = torch.cat([full, full.new_zeros(padding)], dim=dim)
    return full.narrow(dim, tp.rank * piece, piece)


class ColumnParallel:
    """Split the output features (rows of the weight). ``padded``: the vocabulary (the head),
    padded to a multiple of tp; everything else must divide."""

    def __init__(self, padded: bool = False):
        self.padded = padded

    def apply(self, name: str, linear: nn.Linear, slicer: Slicer) -> nn.Module:
        return ColumnParallelLinear(slicer.slice(f"{name}.weight", linear.weight, 0, pad=self.padded))


class RowParallel:
    """Split the input features (columns of the weight); the partial outputs are summed by g."""

    def apply(self, name: str, linear: nn.Linear, slicer: Slicer) -> nn.Module:
        return RowParallelLinear(slicer.slice(f"{name}.weight", linear.weight, 1), slicer.tp)


class VocabParallel:
    """Split the embedding table's rows (the padded vocabulary)."""

    def apply(self, name: str, embedding: nn.Embedding, slicer: Slicer) -> nn.Module:
        return VocabParallelEmbedding(slicer.slice(f"{name}.weight", embedding.weight, 0, pad=True), slicer.tp)


class Replicated:
    """Every rank holds the whole module (the norms). With SP it runs on this rank's part of the
    sequence, so its gradient is a partial sum over tp (recorded in its placement)."""

    def apply(self, name: str, module: nn.Module, slicer: Slicer) -> nn.Module:
        for attr, param in module.named_parameters(recurse=False):
            slicer.slice(f"{name}.{attr}", param, None)
        return module


class PrepareInput:
    """Make the module's first input whole for the column-parallel linears in it (f, or the SP
    all-gather), and hook it up to them. Applied after the styles that replace modules."""

    def apply(self, name: str, module: nn.Module, slicer: Slicer) -> nn.Module:
        prepared = PreparedInput(slicer.tp)
        module.register_forward_pre_hook(prepared.before)
        module.register_forward_hook(prepared.after)
        for sub in module.modules():
            if isinstance(sub, ColumnParallelLinear):
                sub.input = prepared
                prepared.linears.append(sub)
        return module


class SequenceWhole(torch.autograd.Function):
    """The sequence an MoE block routes under SP: forward, all-gather it; backward, reduce-scatter
    the gradient (the router's, which every tp rank computes for the whole sequence, and each
    rank's own positions' combine, summed), each rank keeping its positions'."""

    @staticmethod
    def forward(ctx, shard, tp: TensorParallelGroup, tag: str | None):
        ctx.tp = tp
        return all_gather_sequence(shard, tp, tag)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad.contiguous(), ctx.tp, None), None, None


def positions_of(routing: Routing, batch_shape: tuple[int, int], tp: TensorParallelGroup) -> Routing:
    """The rows of ``routing``, over the (batch, positions) tokens of ``batch_shape``, for this
    rank's s/t positions of each sequence (SP's split)."""
    b, s = batch_shape
    piece = s // tp.size

    def mine(rows: torch.Tensor | None) -> torch.Tensor | None:
        if rows is None:
            return None
        return rows.view(b, s, *rows.shape[1:]).narrow(1, tp.rank * piece, piece).reshape(b * piece, *rows.shape[1:])

    return Routing(*(mine(getattr(routing, f.name)) for f in fields(Routing)))


class SequenceSplitMoE(MoE):
    """An MoE block under sequence parallelism (the class ``ReplicatedMoE`` gives it). Every tp
    rank routes the whole sequence, all-gathered (``SequenceWhole``), so routing, capacity, the
    balance loss and the step's counters are exactly one process's, and the same on every tp
    rank; then it runs the experts (dispatched under ep) and the shared experts on its own s/t
    positions only, so the experts' work is split over tp, not repeated. The router is whole on
    every rank (E·h per token, small). Its weights, the experts' and the shared experts' see
    this rank's positions, so their gradients are partial sums over tp, summed once a step
    (placements); the balance loss's gradient, which every rank computes in full, is given back
    1/t on each (``grad_share``), so that sum counts it once. Per block and micro-batch: one
    all-gather forward and one reduce-scatter backward, the bytes of the replicated block's."""

    tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        whole = SequenceWhole.apply(x, self.tp, traffic_tag())
        batch_shape = tuple(whole.shape[:-1])
        routing = self.route(whole.reshape(-1, whole.shape[-1]), batch_shape)
        tokens = x.reshape(-1, x.shape[-1])
        out = self.compute(tokens, positions_of(routing, batch_shape, self.tp)).view(*x.shape)
        if self.training and torch.is_grad_enabled():
            out = self._attach_aux_loss(out, routing, grad_share=1 / self.tp.size)
        return out


class ReplicatedMoE:
    """An MoE block's weights stay whole on every tp rank: its router, experts (or this rank's ep
    slice of them, expert_parallel.py), shared experts and routing bias are replicated over tp
    (Megatron-LM splits each expert over tp instead; not done here). Without SP each tp rank
    holds the whole sequence and runs the block on all of it, as one process would: the experts'
    work is repeated on every tp rank, and their gradients are the same there. With SP the block
    becomes a ``SequenceSplitMoE``: each rank runs the experts on its own positions, and their
    gradients are partial sums over tp."""

    def apply(self, name: str, module: nn.Module, slicer: Slicer) -> nn.Module:
        split = slicer.tp.sequence_parallel
        parameters = {key for key, _ in module.named_parameters()}
        for key, tensor in module.state_dict(keep_vars=True).items():
            partial = ("tp",) if split and key in parameters else ()
            slicer.placements[f"{name}.{key}"] = Placement(tuple(tensor.shape), partial=partial)
        if split:
            module.__class__ = SequenceSplitMoE  # as FSDP2's fully_shard swaps a module's class: same keys
            module.tp = slicer.tp
        return module


class SequenceShareMoE(MoE):
    """An MoE block whose ep group is folded over tp (``parallel.expert_tp = 1``; the class
    ``FoldedMoE`` gives it), as Megatron-Core runs MoE under SP at expert-tp 1: each tp rank routes
    its own s/t positions, no gather; their rows go to the experts' ranks of the folded ep group
    (expert_parallel.py); the shared experts are a tensor-parallel SwiGLU, their input gathered
    and their output reduce-scattered as a dense MLP's. What is over the micro-batch's tokens
    (the balance loss's f, the capacity rule) is reduced over the tp ranks (and cp's) by its
    ``micro_batch`` seam (context_parallel.SplitMicroBatch), so the same tokens drop as on one
    process. Each rank's balance and z losses are its share's: their mean over tp is the
    micro-batch's, so each gives back 1/t of its gradient (the router's gradient is summed over
    tp). Per block and micro-batch on tp: the shared experts' 2½ all-reduces' worth with SP, none
    for the routed experts."""

    tp: TensorParallelGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens, tuple(x.shape[:-1]))
        out = self.routed(tokens, routing).view(*x.shape)
        if self.training and torch.is_grad_enabled():
            out = self._attach_aux_loss(out, routing, grad_share=1 / self.tp.size)
        # last, as in a dense block: a full recomputation stops at the shared experts' last saved
        # input, before their reduce-scatter, so it repeats their gather only
        return out if self.shared is None else out + self.shared(x)


class FoldedMoE:
    """An MoE block whose experts are split over the ep group folded over tp: the router whole on
    every rank, its gradient a partial sum over tp (each rank routes its own positions); the
    experts left whole here, for ``apply_ep`` to split over the folded group (each expert's
    gradient is then whole on its one rank, not a partial sum); the shared experts' SwiGLU split
    as a dense MLP's. The block becomes a ``SequenceShareMoE``."""

    def apply(self, name: str, module: nn.Module, slicer: Slicer) -> nn.Module:
        from threefold.parallel.context_parallel import SplitMicroBatch

        slicer.slice(f"{name}.router.weight", module.router.weight, None)
        for key, tensor in [("expert_bias", module.expert_bias)] + [(f"experts.{k}", q) for k, q in
                                                                   module.experts.named_parameters()]:
            slicer.placements[f"{name}.{key}"] = Placement(tuple(tensor.shape))
        if module.shared is not None:
            shared = module.shared
            shared.w_gate = ColumnParallel().apply(f"{name}.shared.w_gate", shared.w_gate, slicer)
            shared.w_up = ColumnParallel().apply(f"{name}.shared.w_up", shared.w_up, slicer)
            shared.w_down = RowParallel().apply(f"{name}.shared.w_down", shared.w_down, slicer)
            PrepareInput().apply(f"{name}.shared", shared, slicer)
        module.__class__ = SequenceShareMoE  # as ReplicatedMoE swaps it: same keys
        module.tp = slicer.tp
        module.micro_batch = SplitMicroBatch(slicer.tp.comm, axes=("tp",))
        return module


class FeedForwardInput:
    """``blocks.*.mlp``: a dense SwiGLU gets its input prepared for its column-parallel linears
    (``PrepareInput``); an MoE block is replicated (``ReplicatedMoE``), or with its experts folded
    over tp split as Megatron-Core splits it (``FoldedMoE``)."""

    def apply(self, name: str, module: nn.Module, slicer: Slicer) -> nn.Module:
        if isinstance(module, MoE):
            style = FoldedMoE() if slicer.tp.experts_folded else ReplicatedMoE()
        else:
            style = PrepareInput()
        return style.apply(name, module, slicer)


# Each pattern's "*" is one layer index. Styles apply in list order, and every parameter of the
# model must be covered by one.
TENSOR_PARALLEL_PLAN: dict[str, list] = {
    "embed": [VocabParallel()],
    "blocks.*.attn_norm": [Replicated()],
    "blocks.*.attn.wq": [ColumnParallel()],
    "blocks.*.attn.wk": [ColumnParallel()],
    "blocks.*.attn.wv": [ColumnParallel()],
    "blocks.*.attn.wo": [RowParallel()],
    "blocks.*.attn": [PrepareInput()],
    "blocks.*.mlp_norm": [Replicated()],
    "blocks.*.mlp.w_gate": [ColumnParallel()],
    "blocks.*.mlp.w_up": [ColumnParallel()],
    "blocks.*.mlp.w_down": [RowParallel()],
    "blocks.*.mlp": [FeedForwardInput()],
    "norm": [Replicated()],
    "head": [ColumnParallel(padded=True), PrepareInput()],
}


def apply_tp(model: Llama, tp: TensorParallelGroup,
             plan: dict[str, list] = TENSOR_PARALLEL_PLAN) -> dict[str, Placement]:
    """Transform the plain ``model`` in place into this rank's tensor-parallel part of it.

    Returns where each parameter (by state-dict key) now sits in the full model.
    """
    slicer = Slicer(tp)
    for pattern, styles in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name, module in list(model.named_modules()):
            if regex.match(name):
                for style in styles:
                    module = style.apply(name, module, slicer)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, module)
    uncovered = [key for key in model.state_dict() if key not in slicer.placements]
    if uncovered:
        raise ValueError(f"the tensor-parallel plan covers no style for {', '.join(uncovered)}")
    return slicer.placements
