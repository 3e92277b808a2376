"""Where each local tensor sits in the full model, and what every layout computes from that.

A strategy that cuts a tensor records how, in a ``Placement``: the full tensor's shape, the
dimension it is split along and where this rank's slice starts (tensor parallelism), the mesh
axes it is split over, the axes over which each rank's gradient is only a partial sum (the
norm gains under sequence parallelism: each tp rank saw part of the sequence), and whether it
is a second copy that another rank counts (the last pipeline stage's tied embedding). ZeRO
then lays parameters out in flat buffers and keeps a range of them, which covers a range of
each tensor's flattened elements: a range of a row-major tensor is at most three boxes (the
end of a partial row, whole rows, the start of a row), each contiguous in the flat buffer.

Every piece a rank holds is therefore a ``Shard``: a box of a named full tensor ("model/<key>",
"exp_avg/<key>", "grad/<key>"), a view into the engine's own storage, and the mesh axes over
which other ranks hold the same values. Written once against that record, and used by every
layout:

  ``grad_norm``          the global gradient norm: each element counted once over the mesh;
  ``full_tensors``       the full tensors (the plain model's state dict), gathered from pieces;
  ``sum_partial_grads``  gradients that are partial sums over an axis, summed over it;
  checkpoint pieces      the Shards themselves: train/checkpoint.py hands them to DCP, which
                         writes a replicated piece once and reads overlaps on any other layout.

Counting once. Along an axis over which some piece differs between ranks (pp, a tp shard, a
ZeRO chunk over dp) the per-rank sums must be added up over that axis; then a piece that is
the same on every rank of the axis (a norm gain over tp) is counted on the rank at coordinate 0
only. An axis over which every piece is replicated (dp under DDP) needs no reduction at all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from threefold.config import PARTIAL_IN_PLACE_NUMEL

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's states of each parameter, named as torch names them
MESH_AXES = ("pp", "dpr", "dps", "epd", "cp", "tp")  # distributed/mesh.py's GRID (this file stays torch-light)
# mesh.py's: the dp ranks are edp × epd (expert parallelism splits dp), edp is dpr × dps (hybrid
# sharding); folded experts (ep over epd, cp and tp) record all three in their placement
SPANS = {"dp": ("dpr", "dps", "epd"), "edp": ("dpr", "dps"), "ep": ("epd",)}


def grid_axes(axes) -> set[str]:
    """The grid dimensions mesh ``axes`` span ("dp" is dpr, dps and epd)."""
    return {g for a in axes for g in SPANS.get(a, (a,))}


@dataclass(frozen=True)
class Placement:
    """Where a rank's local tensor lies in the full one: the whole of it (``dim`` None), or the
    slice along ``dim`` that starts at ``start``, split over mesh axes ``sharded``. A slice may
    reach past the full size: that part is padding (a vocabulary tp does not divide) and belongs
    to no checkpoint. ``partial``: axes over which the gradient is a partial sum. ``duplicate``:
    another rank holds the counted copy of the same tensor."""
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    sharded: tuple[str, ...] = ()
    partial: tuple[str, ...] = ()
    duplicate: bool = False

    def replicated(self, also_sharded: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The axes over which other ranks hold the same values: every axis but the pipeline
        (stages hold different tensors) and those the tensor is split over."""
        split = grid_axes(self.sharded + tuple(also_sharded))
        return tuple(a for a in MESH_AXES if a != "pp" and a not in split)


@dataclass
class Shard:
    """A piece of the full tensor ``name``: its box starts at ``offsets``; ``tensor`` holds it.
    ``replicated``: axes over which other ranks hold the same piece; ``partial``: axes over which
    it is a partial sum (gradients only); ``duplicate``: another rank's copy is the counted one."""
    name: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor
    replicated: tuple[str, ...] = ()
    partial: tuple[str, ...] = ()
    duplicate: bool = False


def key_of(shard: Shard) -> str:
    """The plain-model key a piece belongs to ("exp_avg/blocks.0.attn.wq.weight" → "blocks.0.attn.wq.weight")."""
    return shard.name.partition("/")[2]


def boxes(shape, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [lo, hi) of a row-major tensor of ``shape`` as boxes (offsets, sizes, first
    flat index), each box contiguous in the flattened tensor."""
    shape = tuple(shape)
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) * len(shape), (hi - lo,) * len(shape), lo)]
    inner = math.prod(shape[1:])
    found = []
    row, col = divmod(lo, inner)
    if col:  # the rest of a partial first row
        end = min(hi, (row + 1) * inner)
        found += [((row, *o), (1, *s), row * inner + at) for o, s, at in boxes(shape[1:], col, end - row * inner)]
        lo, row = end, row + 1
    rows = (hi - lo) // inner
    if rows > 0:  # whole rows
        found.append(((row,) + (0,) * (len(shape) - 1), (rows, *shape[1:]), lo))
        lo, row = lo + rows * inner, row + rows
    if lo < hi:  # the start of a last, partial row
        found += [((row, *o), (1, *s), row * inner + at) for o, s, at in boxes(shape[1:], 0, hi - lo)]
    return found


def region(full: torch.Tensor, offsets, shape) -> torch.Tensor:
    """The box of ``full`` that starts at ``offsets`` and has ``shape`` (a view)."""
    for dim, (offset, size) in enumerate(zip(offsets, shape)):
        full = full.narrow(dim, offset, size)
    return full


def local_piece(full: torch.Tensor, placement: Placement, local_shape) -> torch.Tensor:
    """The part of the full tensor that a rank holding ``local_shape`` at ``placement`` keeps:
    the whole, or the slice along ``placement.dim``, zero-padded where it reaches past the end
    (a vocabulary tp does not divide). The inverse of a piece's placement."""
    if placement.dim is None:
        return full
    dim, size = placement.dim, local_shape[placement.dim]
    start, stop = held_range(placement, local_shape)
    return zero_padded(full.narrow(dim, start, stop - start), dim, size)


def held_range(placement: Placement, local_shape) -> tuple[int, int]:
    """The indices [start, stop) along ``placement.dim`` of the full tensor that a local tensor
    of ``local_shape`` holds (the rest of it, if any, is padding)."""
    full = placement.full_shape[placement.dim]
    return min(placement.start, full), min(placement.start + local_shape[placement.dim], full)


def zero_padded(piece: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``piece`` extended with zeros along ``dim`` to ``size`` (a vocabulary tp does not divide)."""
    short = size - piece.shape[dim]
    if short <= 0:
        return piece
    padding = list(piece.shape)
    padding[dim] = short
    return torch.cat([piece, piece.new_zeros(padding)], dim=dim)


def _placed(name: str, placement: Placement, offsets, view: torch.Tensor, also_sharded=()) -> list[Shard]:
    """The local box at ``offsets`` (held by ``view``) moved into the full tensor."""
    offsets = list(offsets)
    if placement.dim is not None:
        dim = placement.dim
        offsets[dim] += placement.start
        keep = min(view.shape[dim], placement.full_shape[dim] - offsets[dim])
        if keep <= 0:
            return []  # all padding
        view = view.narrow(dim, 0, keep)
    return [Shard(name, placement.full_shape, tuple(offsets), view, placement.replicated(also_sharded),
                  placement.partial, placement.duplicate)]


def whole_shards(name: str, local: torch.Tensor, placement: Placement) -> list[Shard]:
    """A rank's whole local tensor as a piece of the full one."""
    return _placed(name, placement, (0,) * local.dim(), local)


def flat_range_shards(name: str, local_shape, placement: Placement, lo: int, hi: int,
                      data: torch.Tensor, also_sharded=()) -> list[Shard]:
    """Elements [lo, hi) of the flattened local tensor, held in the 1-D ``data`` (length hi − lo)."""
    found = []
    for offsets, sizes, at in boxes(local_shape, lo, hi):
        view = data[at - lo:at - lo + math.prod(sizes)].view(sizes)
        found += _placed(name, placement, offsets, view, also_sharded)
    return found


def flat_layout_shards(layout, keys: list[str], placements: list[Placement], chunks: dict[str, torch.Tensor],
                       axes: tuple[str, ...] = ("dp",)) -> list[Shard]:
    """The pieces of the tensors of a flat buffer (``data_parallel.FlatLayout``) that this rank's
    chunk holds. ``chunks``: kind ("model", "exp_avg", "grad", …) → a flat tensor laid out like
    the chunk; ``keys``, ``placements``: each tensor's plain-model key and placement. The chunk
    is split over the group of ``axes`` (dp, or dp and cp: other ranks of it hold other chunks)."""
    found = []
    for index, lo, hi, at in layout.owned_ranges():
        for kind, flat in chunks.items():
            found += flat_range_shards(f"{kind}/{keys[index]}", layout.shapes[index], placements[index], lo, hi,
                                       flat[at:at + hi - lo], also_sharded=tuple(axes))
    return found


# ---------------------------------------------------------------------------------------------
# What every layout computes from its pieces
# ---------------------------------------------------------------------------------------------

def _counted(shards: list[Shard], mesh) -> tuple[list[Shard], list[str]]:
    """(the pieces this rank counts, the axes to sum the per-rank results over)."""
    axes = [a for a in MESH_AXES if mesh.size(a) > 1]
    # Every rank must reduce over the same axes. pp always differs; so do the grid dimensions ep
    # spans (epd; folded, cp and tp too), which split the experts of some pipeline stages (a stage
    # of dense layers holds nothing split over them, but its ranks still meet the others' reductions).
    always = ("pp",) + mesh.spans["ep"]
    reduce_over = [a for a in axes if a in always or not all(a in s.replicated for s in shards)]
    counted = [s for s in shards if not s.duplicate
               and all(mesh.coord(a) == 0 for a in s.replicated if a in reduce_over)]
    return counted, reduce_over


def grad_norm(grads: list[Shard], mesh, comm) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, from this rank's pieces of it (the same on
    every rank). Scalars on each axis, counted under the "scalar" tag."""
    counted, reduce_over = _counted(grads, mesh)
    squares = torch.zeros((), device=mesh.device)
    for shard in counted:
        squares += shard.tensor.float().pow(2).sum()
    for axis in reduce_over:
        comm.all_reduce(squares, axis, tag="scalar")
    return squares.sqrt()


def full_tensors(shards: list[Shard], shapes: dict[str, tuple[int, ...]], mesh, comm,
                 tag: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The full tensors named in ``shapes`` (name → full shape) from every rank's pieces: each
    rank writes the pieces it counts into zeros, and one flat buffer is summed over the axes
    where ranks differ (every element is written by exactly one rank, so the sums are exact).
    A collective: every rank calls it."""
    names = list(shapes)
    sizes = [math.prod(shapes[n]) for n in names]
    flat = torch.zeros(sum(sizes), device=mesh.device)
    full = {n: v.view(shapes[n]) for n, v in zip(names, flat.split(sizes))}
    counted, reduce_over = _counted([s for s in shards if s.name in full], mesh)
    for shard in counted:
        region(full[shard.name], shard.offsets, shard.tensor.shape).copy_(shard.tensor)
    for axis in reduce_over:
        comm.all_reduce(flat, axis, tag=tag)
    return full


def sum_partial_grads(grads: list[Shard], comm) -> None:
    """Sum, over each axis named in their ``partial``, the gradient pieces that are partial sums
    there (sequence parallelism's norm gains and MoE blocks over tp), in place: per axis one flat
    all-reduce of the small ones, and one of each large one. Ledger key "<axis>.partial_grads"."""
    axes = sorted({a for s in grads for a in s.partial})
    for axis in axes:
        parts = [s.tensor for s in grads if axis in s.partial]
        small = []
        for t in parts:
            if t.numel() >= PARTIAL_IN_PLACE_NUMEL and t.is_contiguous():
                comm.all_reduce(t, axis, tag="partial_grads")
            else:
                small.append(t)
        if small:
            flat = torch.cat([t.reshape(-1) for t in small])
            comm.all_reduce(flat, axis, tag="partial_grads")
            for t, summed in zip(small, flat.split([t.numel() for t in small])):
                t.copy_(summed.view_as(t))
