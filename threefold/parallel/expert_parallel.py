"""Expert parallelism: each rank of an ep group holds E/ep of every MoE layer's experts, and the
tokens travel to the experts instead of the experts being replicated.

The ep group is carved out of the data-parallel ranks (distributed/mesh.py: dp = edp × ep), as
torchtitan does: the ranks of an ep group hold different tokens, like any dp ranks, and
different experts. Rank r of the group keeps experts [r·E/ep, (r+1)·E/ep) of each layer, the
slice along dim 0 of the stacked ``experts.w_gate``, ``w_up``, ``w_down``; the router, the
shared experts and the routing bias stay whole. Everything else of the MoE block is the
single-device code of models/moe.py, which already runs in three steps so that the exchange
fits between them:

  1. route + permute (models/moe.py, on this rank's tokens, before any exchange): the kept
     assignments' rows ``x_perm`` sorted by expert, and ``counts`` (E,). Experts of rank 0 come
     first, so the rows for rank j are one contiguous block, its size the sum of its experts'
     counts. Capacity and the balance loss are therefore per call of T tokens of this rank, as
     on one process: any layout that gives each call the same micro-batch drops the same tokens.
     (Under context parallelism a call holds a share of each sequence; the block's
     ``micro_batch`` seam, which apply_cp installs, makes those statistics the micro-batch's.)
  2. dispatch: the split sizes are exchanged first (an all_to_all of ``counts``: each rank learns
     how many rows every other rank sends to each of its experts), then the rows (an all_to_all
     with those uneven splits). The received rows arrive source-major (rank 0's rows for my
     expert 0, 1, …, then rank 1's); they are regrouped expert-major for the grouped products.
     The local experts run on them (``GroupedExperts``, unchanged, on its slice of the weights).
  3. combine: the inverse regrouping and the reverse all_to_all (the splits swapped) bring each
     row back to the rank and position it came from; unpermute (models/moe.py) weights and sums.

Both exchanges are ``comm.all_to_all`` through autograd (distributed/comm.py): the backward of
the dispatch is the reverse all_to_all of the rows' gradients, and of the combine the forward
one. So per MoE layer and micro-batch a rank sends, in rows of h elements of b bytes, its rows
for other ranks' experts twice (dispatch; the combine's gradient) and the rows other ranks sent
it twice (combine; the dispatch's gradient), plus its counts for other ranks' experts once
((ep−1)·E/ep int64); a full recompute repeats the forward's share. Counted under "ep"
(evaluation's under "ep.eval"). When every rank's experts get the same share of the T·k
assignments (round-robin routing; balanced on average) that is 4·(ep−1)/ep·T·k·h·b plus the
counts, ``plan/costs.ep_bytes_per_step``. Under bf16 autocast the rows travel in bf16 (b = 2):
the experts would cast them on arrival anyway, so the values are the same.

Gradients. An expert's weight gradient on its rank sums the contributions of the tokens of
every rank of the ep group. Expert weights are replicated over the expert-data-parallel group
(edp = dp/ep): the engine reduces them there and divides by dp, not by edp — each rank's loss is
its own mean, and the step's gradient is the mean over all dp ranks; dividing by edp would make
expert gradients ep times too large, the bug users of DeepSpeed and torchtitan keep reporting.
An expert that gets no tokens is still an operand of the grouped product, so its gradient is a
tensor of zeros and its Adam state steps like any other.

Composition: after tensor parallelism (the experts are replicated over tp; without SP each tp
rank runs the block on the whole sequence, under SP on its own positions, whose rows it
dispatches: tensor_parallel.SequenceSplitMoE), before the pipeline split (MoE layers
in any stage: the ep group lies within one stage); ZeRO 0–3 shard expert states over edp.
Under context parallelism the ep group is the dp ranks of one cp coordinate, which dispatch
their shares of the sequences to each other; the cp ranks hold the same experts, so expert
gradients are reduced (and ZeRO-sharded) over edp × cp and divided by dp·cp.

Folded (``parallel.expert_tp = 1``: Megatron-Core's MoE parallel folding at expert-tp 1,
torchtitan's etp 1). Replicating the experts over tp and cp costs their memory t·c times; folded,
the ep group is instead ep consecutive ranks of a stage, its tp and cp ranks and ep/(t·c) dp
ranks (distributed/mesh.py: "ep" spans the grid's epd, cp and tp). Each rank of it holds E/ep
experts as above, and the group's ranks hold different tokens: under SP each tp rank routes its
own positions (tensor_parallel.SequenceShareMoE, with the shared experts a tensor-parallel
SwiGLU), under cp each cp rank its share, and the ``micro_batch`` seam makes the balance loss
and the capacity rule the whole micro-batch's (context_parallel.SplitMicroBatch over cp and
tp). Nothing here changes but the group: the same dispatch and combine, over t·c times more
ranks of the same tokens. An expert's gradient on its rank is then whole (no partial sum over
tp), reduced over edp alone (dp·cp·t/ep ranks) and divided by dp·cp. The bytes are
``ep_bytes_per_step`` of this rank's T/t tokens at ep, and the planner prices the layout as
``Layout.expert_tp`` 1 (plan/dryrun_predict.py).

Placements (parallel/placements.py) record the slice (folded: over the grid's epd, cp and tp),
so the gradient norm, the full state dict and checkpoints (full tensors, resharded to any ep,
folded or not) need nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from threefold.distributed.comm import Comm, all_to_all_autograd
from threefold.models.moe import MoE
from threefold.parallel.placements import Placement

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # GroupedExperts' stacked tensors, (E, …) each


def local_experts(num_experts: int, ep: int, rank: int) -> range:
    """The experts rank ``rank`` of an ep group of ``ep`` holds."""
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def traffic_tag() -> str | None:
    """Training's exchanges count under "ep", evaluation's under "ep.eval"."""
    return None if torch.is_grad_enabled() else "eval"


@dataclass
class Exchange:
    """The split sizes of one dispatch, kept for its combine. ``send[j]``: rows this rank sends to
    rank j; ``received[i][e]``: rows rank i sends to this rank's local expert e; ``order``: the
    received (source-major) rows in expert-major order."""
    send: list[int]
    received: list[list[int]]
    order: torch.Tensor

    @property
    def receive(self) -> list[int]:
        return [sum(row) for row in self.received]

    @property
    def local_counts(self) -> list[int]:
        return [sum(column) for column in zip(*self.received)]


def has_values(tensor: torch.Tensor) -> bool:
    """False for a fake or meta tensor (the dry run): shapes without values."""
    return not (is_fake(tensor) or tensor.is_meta)


def round_robin_counts(rows: int, num_experts: int) -> list[int]:
    """Rows per expert under round-robin routing (models/moe.py): row a of ``rows`` to a mod E."""
    return [rows // num_experts + (e < rows % num_experts) for e in range(num_experts)]


def exchange_counts(counts: torch.Tensor, mine: list[int], comm: Comm) -> list[list[int]]:
    """(ep, E/ep): what every rank of the group sends to each of this rank's experts. An
    all_to_all of the (E,) counts in equal shares: rank j's share of mine is my counts for its
    experts. Without values (the dry run routes round-robin, and every rank the same number of
    tokens) every rank sends what this one does: ``mine``, this rank's counts."""
    ep, rank = comm.mesh.size("ep"), comm.mesh.coord("ep")
    received = torch.empty_like(counts)
    comm.all_to_all(received, counts.contiguous(), "ep", tag=traffic_tag())
    if not has_values(received):
        experts = local_experts(len(mine), ep, rank)
        return [mine[experts.start:experts.stop]] * ep
    return received.view(ep, -1).tolist()


def expert_major(received: list[list[int]], device) -> torch.Tensor:
    """The positions of source-major rows (rank 0's rows for experts 0, 1, …, then rank 1's …)
    in expert-major order (expert 0's rows from rank 0, 1, …, then expert 1's …)."""
    ranks, experts = len(received), len(received[0])
    starts, at = [[0] * experts for _ in range(ranks)], 0
    for i in range(ranks):
        for e in range(experts):
            starts[i][e], at = at, at + received[i][e]
    order = [p for e in range(experts) for i in range(ranks) for p in range(starts[i][e], starts[i][e] + received[i][e])]
    return torch.tensor(order, dtype=torch.long, device=device)


def dispatch(x_perm: torch.Tensor, counts: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, Exchange]:
    """This rank's rows sorted by (global) expert → the rows of every rank for this rank's
    experts, sorted by local expert; and the exchange's split sizes."""
    ep = comm.mesh.size("ep")
    mine = counts.tolist() if has_values(counts) else round_robin_counts(x_perm.shape[0], counts.numel())
    per_rank = len(mine) // ep
    send = [sum(mine[j * per_rank:(j + 1) * per_rank]) for j in range(ep)]
    received = exchange_counts(counts, mine, comm)
    exchange = Exchange(send, received, expert_major(received, x_perm.device))
    rows = all_to_all_autograd(comm, x_perm, "ep", output_split_sizes=exchange.receive, input_split_sizes=send,
                               tag=traffic_tag())
    return rows[exchange.order], exchange


def combine(y_local: torch.Tensor, exchange: Exchange, comm: Comm) -> torch.Tensor:
    """The inverse of ``dispatch``: each output row back to the rank, and the place, it came from."""
    source_major = torch.empty_like(exchange.order)
    source_major[exchange.order] = torch.arange(exchange.order.numel(), device=exchange.order.device)
    return all_to_all_autograd(comm, y_local[source_major], "ep", output_split_sizes=exchange.send,
                               input_split_sizes=exchange.receive, tag=traffic_tag())


class ExpertParallel:
    """The hooks around one layer's ``GroupedExperts``: before its forward, dispatch (its input
    becomes the rows for the local experts and their counts); after it, combine, with the split
    sizes its dispatch kept."""

    def __init__(self, comm: Comm):
        self.comm = comm
        self.exchanges: list[Exchange] = []

    def before(self, module: nn.Module, args: tuple) -> tuple:
        x_perm, counts = args
        device = x_perm.device.type
        if torch.is_autocast_enabled(device):  # the experts compute in it anyway: send half the bytes
            x_perm = x_perm.to(torch.get_autocast_dtype(device))
        rows, exchange = dispatch(x_perm, counts, self.comm)
        self.exchanges.append(exchange)
        return rows, torch.tensor(exchange.local_counts, dtype=counts.dtype, device=counts.device)

    def after(self, module: nn.Module, args: tuple, y_local: torch.Tensor) -> torch.Tensor:
        return combine(y_local, self.exchanges.pop(), self.comm)


def apply_ep(model: nn.Module, comm: Comm) -> dict[str, Placement]:
    """Keep this rank's experts of every MoE layer of ``model`` (in place; a meta model stays on
    meta, the engine draws the slices) and hook the exchanges around them. Returns the
    placements of the sliced tensors, by plain-model key."""
    ep, rank = comm.mesh.size("ep"), comm.mesh.coord("ep")
    split_over = ("ep", "cp", "tp") if comm.mesh.folded else ("ep",)  # the axes whose grid dimensions ep spans
    placements = {}
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        mine = local_experts(module.num_experts, ep, rank)
        experts = module.experts
        for attr in EXPERT_WEIGHTS:
            full = getattr(experts, attr)
            setattr(experts, attr, nn.Parameter(full.detach()[mine.start:mine.stop].clone(),
                                                requires_grad=full.requires_grad))
            placements[f"{name}.experts.{attr}"] = Placement(tuple(full.shape), 0, mine.start, sharded=split_over)
        hooks = ExpertParallel(comm)
        experts.register_forward_pre_hook(hooks.before)
        experts.register_forward_hook(hooks.after)
    return placements


def expert_keys(placements: dict[str, Placement]) -> set[str]:
    """The plain-model keys of tensors split over ep: their gradients are reduced over edp."""
    return {key for key, placement in placements.items() if "ep" in placement.sharded}
