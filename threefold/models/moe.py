"""The Mixture-of-Experts feed-forward block, on one device; no parallel code.

A block replaces the dense SwiGLU of the layers ``sizes.is_moe_layer`` picks. Its tensors,
inside ``blocks.{i}.mlp``: ``router.weight`` (E, h); the E routed experts stacked,
``experts.w_gate`` and ``experts.w_up`` (E, f, h), ``experts.w_down`` (E, h, f); the shared
experts, one SwiGLU of width ``moe_shared_experts · f``, ``shared.{w_gate,w_up,w_down}.weight``;
and the buffer ``expert_bias`` (E,), DeepSeek-V3's routing bias (zeros unless ``moe_bias_rate``).

The forward of T tokens is three separate steps, so that expert parallelism can put an
``all_to_all`` between the first and second and between the second and third:

  1. ``route`` + ``permute``: the router picks each token's top-k experts and their weights and
     the capacity rule drops what exceeds an expert's capacity; the kept (token, expert)
     assignments' rows are gathered sorted by expert: ``x_perm`` (N, h) and ``counts`` (E,).
     The rows for experts 0..E/ep−1 come first, then the next rank's, so the split sizes of
     the dispatch are sums of ``counts``.
  2. ``GroupedExperts``: each expert's SwiGLU on its contiguous rows, as grouped matrix
     products with offsets from ``counts`` (``torch._grouped_mm``; a per-expert loop is the
     reference, and the fallback where the widths break the kernel's 16-byte stride rule).
  3. ``unpermute``: out[t] = Σ_j w_tj · y(t, j), over the kept assignments; plus the shared
     experts' output.

Router (in fp32 whatever the autocast): softmax probabilities over the experts (Mixtral,
Qwen3-MoE) or sigmoid affinities (DeepSeek-V3). The top-k are chosen by score + bias; the
weights are the scores themselves (never the bias), divided by their sum when
``moe_renormalize`` (Mixtral, Qwen3 and DeepSeek-V3 do; with k = 1 that makes the weight 1
and the router learns only from the balance loss, so Switch does not).

Capacity (``moe_capacity_factor`` c > 0): each expert takes at most C = ⌈c · T · k / E⌉
assignments of the T tokens of the micro-batch (before any dispatch; a call sees them all,
unless the ``micro_batch`` seam says it sees a share: see ``MicroBatch``). The drop
rule, deterministic so a reference can drop the same tokens: assignments are served in
priority order — every token's first choice before any token's second choice, and within one
choice rank tokens in order (batch, then position) — and an expert full at C drops the rest.
A dropped assignment contributes nothing (its weight is not handed to the others); the token
keeps its residual, its other experts and the shared ones. c = 0 is dropless.

Load balance, two ways:
- the Switch/GShard auxiliary loss (``load_balancing_loss``), E · Σ_i f_i · P_i with
  coefficient ``moe_aux_loss_coef``, computed per micro-batch as Megatron-LM does: f and P
  are means over that micro-batch's tokens only. Under gradient accumulation the objective is
  therefore the mean over micro-batches of each one's balance loss, not the balance loss of
  the whole batch (a mean of products is not the product of means): smaller micro-batches
  penalise imbalance within fewer tokens. Its gradient enters the graph through
  ``AuxLossAutoScaler`` (Megatron's MoEAuxLossAutoScaler): the block's output is passed on
  unchanged, and its backward adds ``aux_loss_scale`` × d(aux)/dθ, where the trainer sets the
  scale to 1/micro-batches, the factor the engine puts on each micro-batch's loss. So neither
  the loss code nor the pipeline runtime knows about it.
- (not a balance rule, but on the same path) ST-MoE's router z-loss, the mean of each token's
  (logsumexp of the logits)², with coefficient ``moe_router_z_loss_coef``: per micro-batch and
  through ``AuxLossAutoScaler`` like the balance loss, added to it in the ``aux_loss`` metric.
  It depends only on the call's own tokens' logits, so a share of a micro-batch needs nothing
  from the other shares.
- DeepSeek-V3's auxiliary-loss-free bias: after each optimizer step, b_i += γ · sign(mean −
  n_i) from the tokens n_i routed to expert i over the whole step (``end_step``; counts summed
  over ranks by the caller where there are several). It moves only the choice, not the
  weights, and no gradient.

Round-robin routing (``MoE.routing = "round_robin"``): assignment a = t·k + j goes to expert
a mod E, weighted by the scores of those experts, nothing dropped while the capacity holds the
⌈T·k/E⌉ it gives each expert. The load is then known without reading any value, which is what
the dry run needs (fake tensors have shapes, not values: it routes every MoE layer this way) and
what the tests of exact expert-parallel bytes use. The router still gets its gradient.

Statistics: while training, the backward of ``AuxLossAutoScaler`` adds this micro-batch's
routed tokens per expert (before drops), dropped assignments and aux loss to the step's
counters — in the backward, so that a forward recomputed by activation checkpointing is not
counted twice and evaluation forwards not at all. They are this call's own tokens' (a share's,
where the ``micro_batch`` seam says a call sees a share), so summing them over the calls and
ranks of a step counts every token once. Round-robin routing, a rule for loads, is per call.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from threefold.config import ModelConfig


# --- step 1: route and permute ----------------------------------------------------------------


@dataclass
class Routing:
    """Where one call's T tokens go: k assignments each (assignment a = t · k + j)."""

    scores: torch.Tensor  # (T, E) fp32: softmax probabilities or sigmoid affinities
    experts: torch.Tensor  # (T, k) int64: the chosen experts, best first
    weights: torch.Tensor  # (T, k) fp32: the combine weights
    kept: torch.Tensor | None  # (T, k) bool: False where the capacity rule dropped it; None: all kept
    logits: torch.Tensor | None = None  # (T, E) fp32: the router's logits (for the z-loss)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 logits of the tokens ``x`` (T, h) for router weights (E, h), whatever the autocast."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float())


def scores_of(logits: torch.Tensor, router: str) -> torch.Tensor:
    """Softmax probabilities or sigmoid affinities of the router's ``logits``."""
    return logits.softmax(-1) if router == "softmax" else logits.sigmoid()


def router_scores(x: torch.Tensor, weight: torch.Tensor, router: str) -> torch.Tensor:
    """(T, E) fp32 scores of the tokens ``x`` (T, h) for router weights (E, h)."""
    return scores_of(router_logits(x, weight), router)


def select_experts(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts, weights), each (T, k): the top-k of score + bias, weighted by the scores."""
    experts = (scores if bias is None else scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts, weights


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) int64: how often each expert occurs in ``experts`` (``bincount``, with a shape that
    does not depend on the values, so it also runs on fake tensors)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def round_robin_routing(scores: torch.Tensor, top_k: int, capacity: int | None, renormalize: bool = True) -> "Routing":
    """Assignment t·k + j to expert (t·k + j) mod E, weighted by its scores (see the module
    docstring); the capacity rule applies only where it would drop something."""
    tokens, num_experts = scores.shape
    experts = torch.arange(tokens * top_k, device=scores.device).view(tokens, top_k) % num_experts
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    fits = capacity is None or capacity >= -(-tokens * top_k // num_experts)
    return Routing(scores, experts, weights, None if fits else capacity_keep(experts, num_experts, capacity))


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int | None:
    """C = ⌈factor · tokens · k / E⌉ assignments per expert; None (no limit) when factor is 0."""
    return math.ceil(factor * tokens * top_k / num_experts) if factor else None


def capacity_keep(experts: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """(T, k) bool: the drop rule. Assignments in priority order — choice rank j first, then
    token t — fill each expert up to ``capacity``; the rest are dropped."""
    if capacity is None:
        return torch.ones_like(experts, dtype=torch.bool)
    tokens, top_k = experts.shape
    in_priority = experts.t().reshape(-1)  # all first choices, then all second choices, …
    order = torch.argsort(in_priority, stable=True)
    counts = torch.bincount(in_priority, minlength=num_experts)
    first_of_expert = counts.cumsum(0) - counts
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel(), device=order.device) - first_of_expert[in_priority[order]]
    return (place < capacity).view(top_k, tokens).t()


def permute(x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_perm (N, h), counts (E,), order (N,)): the rows of the kept assignments sorted by
    expert (within an expert, by assignment), how many each expert got, and ``order[n]``, the
    assignment (t · k + j) whose row is n."""
    num_experts, top_k = routing.scores.shape[-1], routing.experts.shape[1]
    flat = routing.experts.reshape(-1)
    if routing.kept is None:  # every assignment kept: no value-dependent shape
        order = torch.argsort(flat, stable=True)
        return x[order // top_k], count_per_expert(flat, num_experts), order
    kept = routing.kept.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]
    counts = torch.bincount(flat[kept], minlength=num_experts)
    return x[order // top_k], counts, order


# --- step 2: the experts ----------------------------------------------------------------------


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: the grouped product's
    backward refuses an expanded one (``y.sum().backward()`` sends a stride-0 gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)  # an empty one keeps stride 0


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU on rows offsets[e−1]:offsets[e] of ``x``, all experts in three grouped
    matrix products; no host synchronisation on the counts."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offsets)
    up = torch._grouped_mm(x, w_up.transpose(1, 2), offs=offsets)
    return _ContiguousGrad.apply(torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets))


def looped_swiglu(x: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """The reference: one expert at a time on its rows."""
    outputs = [F.linear(F.silu(F.linear(rows, w_gate[e])) * F.linear(rows, w_up[e]), w_down[e])
               for e, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outputs) if outputs else x.new_zeros(0, w_down.shape[1])


def grouped_mm_fits(x: torch.Tensor, ffn: int) -> bool:
    """``torch._grouped_mm`` needs every row stride a multiple of 16 bytes."""
    row_bytes = (x.shape[1] * x.element_size(), ffn * x.element_size())
    return hasattr(torch, "_grouped_mm") and all(b % 16 == 0 for b in row_bytes)


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights."""

    def __init__(self, num_experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.grouped = True  # False: the per-expert loop (the reference the tests compare with)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` (N, h): rows sorted by expert, ``counts[e]`` of them for expert e → (N, h)."""
        device = x.device.type  # autocast does not cover the grouped product: cast here
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        x = x.to(dtype)
        weights = [w.to(dtype) for w in (self.w_gate, self.w_up, self.w_down)]
        if self.grouped and grouped_mm_fits(x, self.w_gate.shape[1]):
            return grouped_swiglu(x, counts, *weights)
        return looped_swiglu(x, counts, *weights)


# --- step 3: unpermute and combine ------------------------------------------------------------


def unpermute(y: torch.Tensor, order: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, h) in y's dtype: each token's expert outputs summed with its routing weights (fp32)."""
    top_k = routing.experts.shape[1]
    weights = routing.weights.reshape(-1)[order].unsqueeze(1)
    out = y.new_zeros(routing.experts.shape[0], y.shape[1], dtype=torch.float32)
    return out.index_add(0, order // top_k, y.float() * weights).to(y.dtype)


# --- load balance -----------------------------------------------------------------------------


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, router: str = "softmax",
                        routed: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's (Fedus et al. 2021, eq. 4; GShard's with top-k): E · Σ_i f_i · P_i,
    f_i the fraction of the T·k assignments routed to expert i (before capacity drops; a count,
    no gradient), P_i the mean router probability of i over the T tokens. 1 when both are
    uniform. Sigmoid scores are first normalised per token to sum to 1 (as DeepSeek-V3's
    balance loss does).

    ``routed``: the assignments per expert of the whole micro-batch, where these T tokens are
    one of n equal shares of it (``MicroBatch.routed_counts``; default: these tokens' own). f is
    then the micro-batch's, and P stays this share's mean: the loss is linear in P, so the mean
    over the shares of this value is the micro-batch's loss, and the mean of their gradients its
    gradient — which is what averaging the shares' gradients computes. Only f needs the others."""
    num_experts = scores.shape[-1]
    probs = scores if router == "softmax" else scores / scores.sum(-1, keepdim=True)
    routed = count_per_expert(experts, num_experts) if routed is None else routed
    return num_experts * (routed.float() / routed.sum() * probs.mean(0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over the T tokens of
    (log Σ_i exp(logit_i))², which keeps the router's logits small. A mean of per-token terms,
    so, like P of the balance loss, a share's value averages to the micro-batch's."""
    return torch.logsumexp(logits, dim=-1).square().mean()


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron-LM's MoEAuxLossAutoScaler: returns ``output`` unchanged; in backward, passes its
    gradient through and gives ``aux_loss`` the gradient ``scale``, as if ``scale · aux_loss``
    had been added to the loss. ``record`` runs once, at the first backward through here."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float, record):
        ctx.save_for_backward(aux_loss)
        ctx.scale, ctx.record = scale, record
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        if ctx.record is not None:
            ctx.record()
            ctx.record = None
        return grad_output, torch.full_like(aux_loss, ctx.scale), None, None


# --- the micro-batch a call sees ---------------------------------------------------------------


class MicroBatch:
    """What the block asks about the micro-batch beyond the tokens of its call: the statistics
    that are over the micro-batch's tokens (the routed counts of the balance loss's f, and the
    capacity rule's priority order and C). Here a call sees the whole micro-batch, so they are
    the call's own. Context parallelism installs one whose calls see a share of each sequence
    (parallel/context_parallel.py); the block's arithmetic does not change."""

    def routed_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(E,) int64: the micro-batch's assignments per expert, from this call's ``counts``."""
        return counts

    def capacity_keep(self, experts: torch.Tensor, batch_shape: tuple[int, ...], num_experts: int,
                      factor: float) -> torch.Tensor:
        """(T, k) bool: the drop rule of capacity factor ``factor`` over the micro-batch, for this
        call's ``experts`` (T, k); ``batch_shape`` is the leading shape of the call's input
        (batch, positions), T its product."""
        capacity = expert_capacity(experts.shape[0], experts.shape[1], num_experts, factor)
        return capacity_keep(experts, num_experts, capacity)


# --- the block --------------------------------------------------------------------------------


class MoE(nn.Module):
    """Routed experts (+ shared experts) in place of the dense MLP. ``shared`` is the dense
    SwiGLU of the shared experts' total width, or None; the model passes it in."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k_experts
        self.router_kind, self.renormalize = cfg.moe_router, cfg.moe_renormalize
        self.capacity_factor, self.aux_loss_coef, self.bias_rate = (
            cfg.moe_capacity_factor, cfg.moe_aux_loss_coef, cfg.moe_bias_rate)
        self.z_loss_coef = cfg.moe_router_z_loss_coef
        self.router = nn.Linear(cfg.hidden, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.hidden, cfg.moe_ffn_hidden)
        self.shared = shared
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts))  # model state: checkpointed
        # This optimizer step's counters, summed over its micro-batches (not model state).
        self.register_buffer("step_tokens", torch.zeros(cfg.moe_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("step_aux_loss", torch.zeros(()), persistent=False)
        self.step_micro_batches = 0
        self.aux_loss_scale = 1.0  # the factor on each micro-batch's loss: 1/micro-batches (the engine sets it)
        self.routing = "learned"  # or "round_robin" (see the module docstring)
        self.micro_batch = MicroBatch()  # the seam for statistics over the micro-batch's tokens

    def route(self, x: torch.Tensor, batch_shape: tuple[int, ...] | None = None) -> Routing:
        """The routing of the tokens ``x`` (T, h), the call's input of leading shape
        ``batch_shape`` (default (T,))."""
        logits = router_logits(x, self.router.weight)
        scores = scores_of(logits, self.router_kind)
        if self.routing == "round_robin":  # the call's own capacity: a rule for loads, not values
            capacity = expert_capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            return replace(round_robin_routing(scores, self.top_k, capacity, self.renormalize), logits=logits)
        bias = self.expert_bias if self.bias_rate else None
        experts, weights = select_experts(scores, self.top_k, bias, self.renormalize)
        kept = self.micro_batch.capacity_keep(experts, tuple(batch_shape or x.shape[:1]), self.num_experts,
                                              self.capacity_factor)
        return Routing(scores, experts, weights, kept, logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.route(tokens, tuple(x.shape[:-1]))
        out = self.compute(tokens, routing).view(*x.shape[:-1], x.shape[-1])
        if self.training and torch.is_grad_enabled():
            out = self._attach_aux_loss(out, routing)
        return out

    def compute(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(T, h): the routed experts' outputs for ``tokens`` (T, h), combined with their
        ``routing`` weights, plus the shared experts'."""
        out = self.routed(tokens, routing)
        return out if self.shared is None else out + self.shared(tokens)

    def routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(T, h): the routed experts' outputs alone, combined with their ``routing`` weights."""
        x_perm, counts, order = permute(tokens, routing)  # ← expert parallelism: dispatch here
        y = self.experts(x_perm, counts)
        return unpermute(y, order, routing)  # ← and combine before this

    def _attach_aux_loss(self, out: torch.Tensor, routing: Routing, grad_share: float = 1.0) -> torch.Tensor:
        """``out`` carrying the balance and z losses of ``routing`` into the backward.
        ``grad_share``: the part of their gradient this call gives back, where several calls
        route the same tokens and their gradients are then summed (1/t under tensor parallelism
        with sequence parallelism, parallel/tensor_parallel.SequenceSplitMoE)."""
        routed = count_per_expert(routing.experts, self.num_experts)  # this call's: the step's counters add calls
        aux = (self.aux_loss_coef * load_balancing_loss(routing.scores, routing.experts, self.router_kind,
                                                        self.micro_batch.routed_counts(routed))
               if self.aux_loss_coef else routing.scores.new_zeros(()))
        if self.z_loss_coef:  # per micro-batch like the balance loss, through the same scaler
            aux = aux + self.z_loss_coef * router_z_loss(routing.logits)
        dropped = routing.experts.new_zeros(()) if routing.kept is None else (~routing.kept).sum()

        def record():
            self.step_tokens += routed
            self.step_dropped += dropped
            self.step_aux_loss += aux.detach()
            self.step_micro_batches += 1

        return AuxLossAutoScaler.apply(out, aux, self.aux_loss_scale * grad_share, record)

    @torch.no_grad()
    def end_step(self, counts: torch.Tensor, update_bias: bool = True) -> None:
        """After the optimizer step: b += γ · sign(mean(counts) − counts) from this step's routed
        tokens per expert (``counts`` (E,), summed over ranks where there are several); then the
        counters start afresh."""
        counts = counts.to(self.expert_bias.device, torch.float32)
        if update_bias and self.bias_rate:
            self.expert_bias += self.bias_rate * torch.sign(counts.mean() - counts)
        self.step_tokens.zero_()
        self.step_dropped.zero_()
        self.step_aux_loss.zero_()
        self.step_micro_batches = 0


def routed_expert_keys(model: nn.Module) -> set[str]:
    """The keys of every routed expert's stacked weights in ``model`` (not the router's, nor the
    shared experts'): what ``model.moe_expert_lr_scale`` steps at its own learning rate."""
    return {f"{name}.{key}" for name, module in model.named_modules() if isinstance(module, GroupedExperts)
            for key, _ in module.named_parameters()}


def step_statistics(layers: list[MoE], counts: torch.Tensor) -> dict:
    """The metrics of one step from its routed ``counts`` (MoE layers, E) and the layers'
    counters: tokens per expert (min, mean, max over every layer's experts), the worst layer's
    max/mean, dropped assignments, and the aux loss (coefficients included, the z-loss's too,
    summed over layers, mean over micro-batches)."""
    micro_batches = max(layer.step_micro_batches for layer in layers) or 1
    return routing_statistics(counts, sum(layer.step_dropped.item() for layer in layers),
                              sum(layer.step_aux_loss.item() for layer in layers), micro_batches)


def routing_statistics(counts: torch.Tensor, dropped: float, aux_loss_sum: float, micro_batches: int,
                       ep: int = 1) -> dict:
    """``step_statistics`` from the numbers themselves: ``counts`` (MoE layers, E), the dropped
    assignments, the aux loss summed over layers and micro-batches, and the micro-batches.

    With the experts split over ``ep`` ranks (E/ep consecutive experts each, as
    parallel/expert_parallel.py places them), also ``ep_max_over_mean``: the rows the busiest
    rank's experts take over the mean, Σ_layers max_rank / Σ_layers mean_rank, the factor by which
    the step's routed work and exchanges wait for that rank (the planner's ``--moe-imbalance``).
    The counts are the step's, summed over its micro-batches and replicas, which evens out each
    micro-batch's own busiest rank: a lower bound of the waits."""
    counts = counts.double()
    stats = {"tokens_per_expert": {"min": counts.min().item(), "mean": counts.mean().item(),
                                   "max": counts.max().item()},
             "max_over_mean": (counts.max(1).values / counts.mean(1).clamp(min=1e-9)).max().item(),
             "dropped": int(round(dropped)), "aux_loss": aux_loss_sum / micro_batches}
    if ep > 1:
        loads = counts.view(counts.shape[0], ep, -1).sum(-1)  # (MoE layers, ep): rows each rank's experts take
        stats["ep_max_over_mean"] = (loads.max(1).values.sum() / loads.mean(1).sum().clamp(min=1e-9)).item()
    return stats
