"""Where a rank's states sit in the full tensors: the vocabulary of layout-independent checkpoints.

A checkpoint stores every full tensor of the plain model (each weight, and Adam's two moments
of it) as the pieces the ranks hold, each piece described by its place in the full tensor:
offsets and sizes. Loading on another layout asks, for each piece a rank holds there, for the
overlapping parts of the saved pieces; torch.distributed.checkpoint does that matching and
reading (train/checkpoint.py). This file turns what an engine holds into such pieces:

  whole tensors     one process, DDP, and ZeRO-1/2's parameters: one piece, the whole tensor;
  tensor parallel   a slice along one dimension: the same piece moved along that dimension,
                    cut where the padding of a vocabulary that tp does not divide begins;
  ZeRO's flat chunks  a range of a flat buffer covers a range of each tensor's flattened
                    elements; a range of a row-major tensor is at most three boxes (the end
                    of a partial row, whole rows, the start of a row), each contiguous in the
                    flat buffer, so each piece is a view and nothing is copied.

Every piece is a view into the engine's own storage: saving reads it, loading writes into it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's states of each parameter, named as torch names them


@dataclass(frozen=True)
class Placement:
    """Where a rank's local tensor lies in the full one: the whole of it (``dim`` None), or the
    slice along ``dim`` that starts at ``start`` (tensor parallelism). A slice may reach past
    the full size: that part is padding and belongs to no checkpoint."""
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0


def tensor_parallel_placement(local_shape, split, tp_rank: int) -> Placement:
    """The placement of a tp shard cut by ``split`` (tensor_parallel.Split: dim, full size)."""
    if split is None or split.dim is None:
        return Placement(tuple(local_shape))
    full = list(local_shape)
    full[split.dim] = split.size
    return Placement(tuple(full), split.dim, tp_rank * local_shape[split.dim])


@dataclass
class Shard:
    """A piece of the full tensor ``name``: its box starts at ``offsets``; ``tensor`` holds it."""
    name: str
    full_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor


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


def _placed(name: str, placement: Placement, offsets, view: torch.Tensor) -> list[Shard]:
    """The local box at ``offsets`` (held by ``view``) moved into the full tensor."""
    offsets = list(offsets)
    if placement.dim is not None:
        dim = placement.dim
        offsets[dim] += placement.start
        keep = min(view.shape[dim], placement.full_shape[dim] - offsets[dim])
        if keep <= 0:
            return []  # all padding
        view = view.narrow(dim, 0, keep)
    return [Shard(name, placement.full_shape, tuple(offsets), view)]


def whole_shards(name: str, local: torch.Tensor, placement: Placement) -> list[Shard]:
    """A rank's whole local tensor as a piece of the full one."""
    return _placed(name, placement, (0,) * local.dim(), local)


def flat_range_shards(name: str, local_shape, placement: Placement, lo: int, hi: int,
                      data: torch.Tensor) -> list[Shard]:
    """Elements [lo, hi) of the flattened local tensor, held in the 1-D ``data`` (length hi − lo)."""
    found = []
    for offsets, sizes, at in boxes(local_shape, lo, hi):
        view = data[at - lo:at - lo + math.prod(sizes)].view(sizes)
        found += _placed(name, placement, offsets, view)
    return found


def flat_layout_shards(layout, keys: list[str], chunks: dict[str, torch.Tensor], placement_of) -> list[Shard]:
    """The pieces of the tensors of a flat buffer (``data_parallel.FlatLayout``) that this rank's
    chunk holds. ``chunks``: kind ("model", "exp_avg", …) → a flat tensor laid out like the
    chunk; ``keys``: each tensor's plain-model key; ``placement_of(key, local_shape)``."""
    found = []
    for index, lo, hi, at in layout.owned_ranges():
        shape = layout.shapes[index]
        placement = placement_of(keys[index], shape)
        for kind, flat in chunks.items():
            found += flat_range_shards(f"{kind}/{keys[index]}", shape, placement, lo, hi, flat[at:at + hi - lo])
    return found
