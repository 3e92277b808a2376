"""Data parallelism: every rank holds the whole model and runs its own slice of the global batch.

The ranks differ only in their data, so averaging their gradients gives the gradient of the
whole batch, and identical updates keep the replicas identical. What this file decides is how
that average is computed and who keeps which states (``parallel.zero``):

  zero 0  DDP: every rank keeps all gradients and optimizer states; gradients are all-reduced.
  zero 1  ZeRO-1: each rank keeps and updates 1/n of the optimizer states. Gradients are
          reduce-scattered (a rank only needs the sum of its 1/n), and after the update each
          rank's 1/n of the parameters is all-gathered. Same bytes as one all-reduce, which is
          exactly a reduce-scatter followed by an all-gather.
  zero 2  ZeRO-2: as ZeRO-1, and a rank never keeps the full gradient, only its 1/n: each
          micro-batch's gradients are reduce-scattered as they are produced and summed into
          the rank's chunk (the ZeRO paper's and DeepSpeed's way). With m micro-batches that
          is m reduce-scatters per step instead of one: (m−1)·(n−1)/n·numel·4 bytes more
          than ZeRO-1, the price of not holding the full gradient between micro-batches.
  zero 3  ZeRO-3 (parameters sharded too): threefold/parallel/fsdp.py.

How gradients travel (all stages here). Parameters are laid out in buckets of about
``parallel.bucket_mb`` MiB, in the reverse of the order the forward pass uses them, which is
the order backward produces their gradients. A hook runs after autograd has accumulated each
parameter's gradient; when a bucket's last gradient arrives, its reduction starts
asynchronously while backward goes on computing the gradients of earlier layers. With
gradient accumulation, zero 0 and 1 send nothing until the last micro-batch: the micro-batches
before it only accumulate locally (zero 2 reduces every micro-batch, see above).

Layout. Each bucket is one flat fp32 buffer holding its parameters (the model's parameters
become views into it) and one holding their gradients (zero 0 and 1: ``p.grad`` are views into
it, so autograd accumulates straight into the buffer that is reduced; zero 2: each
micro-batch's gradients are copied into a fresh buffer, which is dropped once its
reduce-scatter is done, and autograd's own gradient is freed at once; at most
``REDUCTIONS_IN_FLIGHT`` buckets' reductions run at once, the oldest waited for when another
starts, so that a rank holds a few buckets' full gradients, not the whole model's). A bucket
is padded with zeros to a multiple of the dp size, so it splits into n equal chunks, chunk r
belonging to rank r; the padding is the only difference from the planner's byte counts.

Hybrid sharding (``parallel.dp_shard``; Megatron-Core's distributed optimizer instances): zero 1
and 2 shard over groups of dp_shard dp ranks (the mesh's dps × ep, × cp; ``axes``), and the
groups at the same place in the others (``replicate_axes``, "dpr") hold the same chunks. Once a
bucket's reduce-scatter of the step's last micro-batch is waited for, its chunk (under zero 2
every micro-batch's, summed) is all-reduced over dpr, in flight behind the rest of the backward;
under zero 1 the reduce-scatters are then waited for in order, REDUCTIONS_IN_FLIGHT at most, so
that those all-reduces start during the backward too. Bytes: ``costs.dp_bytes_per_step(…, shard)``.

The optimizer is torch's own AdamW, run on this rank's chunks: one view per (bucket, decay
group), matrices' chunks shaped as 1×k rows so ``engine.build_adamw`` puts them in the
weight-decay group. AdamW is elementwise, so this is the same arithmetic as AdamW on the
full tensors.

Which micro-batch is the last is said, not guessed: the driver calls ``last_microbatch()``
before the backward of the step's last micro-batch on these parameters (the plain loop before
its last backward, the pipeline runtime before each stage's last B, or W under ZB-H1), as
nanoGPT's ``require_backward_grad_sync`` and Megatron's ``is_last_microbatch`` do. Each bucket
is then reduced as soon as its last gradient of the step has arrived, so in a pipeline the
reductions run during the drain (Megatron's overlap-grad-reduce). ``overlap=False`` keeps the
old order, every reduction after the whole backward, for the benchmark that compares the two.

The engine drives a ``BucketGradSync`` (and ZeRO-3's ``ShardedGradSync`` in fsdp.py, which has
the same methods) through: ``start_step``, ``last_microbatch``, ``finish``, ``grad_shards``,
``after_optimizer_step``, ``zero_grad``, ``optimizer_params``, ``weight_shards``,
``moment_shards``, ``held`` and ``isolated_grad``.
"""
from __future__ import annotations

import collections
import math

import torch
from torch import nn

from threefold.distributed.comm import Comm
from threefold.distributed.mesh import ParallelMesh
from threefold.parallel.placements import MOMENTS, Placement, Shard, flat_layout_shards, whole_shards
from threefold.words import plural


def decay_first(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The order of a flat buffer: tensors with weight decay (matrices) first, then the rest."""
    return [p for p in params if p.dim() >= 2] + [p for p in params if p.dim() < 2]


class FlatLayout:
    """Where each tensor lives in one flat buffer, and which chunk of it this rank owns.

    ``shapes`` are in buffer order (``decay_first``): decayed matrices, then the tensors without
    decay (norm gains), then zeros up to a multiple of ``ranks``. Rank r owns the chunk
    [r·chunk, (r+1)·chunk).
    """

    def __init__(self, shapes: list[torch.Size], ranks: int, rank: int):
        self.shapes = [torch.Size(s) for s in shapes]
        self.sizes = [s.numel() for s in self.shapes]
        self.numel = sum(self.sizes)
        self.decay_numel = sum(n for s, n in zip(self.shapes, self.sizes) if len(s) >= 2)
        self.padded = math.ceil(self.numel / ranks) * ranks
        self.chunk = self.padded // ranks
        self.start = rank * self.chunk

    def pack(self, tensors, device) -> torch.Tensor:
        """A new padded fp32 buffer holding ``tensors`` (in buffer order)."""
        flat = torch.zeros(self.padded, device=device)
        torch.cat([t.detach().reshape(-1).float() for t in tensors], out=flat[:self.numel])
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's slice of ``flat``, in its shape."""
        return [v.view(shape) for v, shape in zip(flat[:self.numel].split(self.sizes), self.shapes)]

    def own(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a full buffer."""
        return flat[self.start:self.start + self.chunk]

    def owned_ranges(self) -> list[tuple[int, int, int, int]]:
        """Which part of each tensor this rank's chunk holds: (tensor index, first and end
        element of its flattened view, where that part starts in the chunk)."""
        ranges, begin = [], 0
        end_of_chunk = self.start + self.chunk
        for index, size in enumerate(self.sizes):
            lo, hi = max(begin, self.start), min(begin + size, end_of_chunk)
            if lo < hi:
                ranges.append((index, lo - begin, hi - begin, lo - self.start))
            begin += size
        return ranges

    def decay_split(self, chunk: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """This rank's chunk cut where decay ends: [("decay", a 1×k view), ("no_decay", a view)].

        The padding belongs to the no-decay part: its gradient is zero, so it stays zero.
        """
        end = self.start + self.chunk
        parts = []
        if self.start < self.decay_numel:
            parts.append(("decay", chunk[:min(end, self.decay_numel) - self.start].view(1, -1)))
        if end > self.decay_numel:
            parts.append(("no_decay", chunk[max(self.start, self.decay_numel) - self.start:]))
        return parts


def chunk_optimizer_params(layout: FlatLayout, params: torch.Tensor, grads: torch.Tensor, name: str) -> tuple[list, dict]:
    """This rank's chunk of a flat buffer as optimizer parameters: one view per decay group
    (``FlatLayout.decay_split``), each with its reduced gradient (a view, so the optimizer always
    reads the current one) and Adam's moments as views into one flat buffer per moment, made
    here so that a checkpoint finds them laid out like the chunk. Returns
    ([(name, parameter view, {moment: view})], {moment: flat buffer})."""
    flats = {kind: torch.zeros_like(params) for kind in MOMENTS}
    entries = []
    views = zip(layout.decay_split(params), layout.decay_split(grads), *(layout.decay_split(f) for f in flats.values()))
    for (kind, p), (_, g), *moment_views in views:
        p.requires_grad_()  # marks it trainable for build_adamw; autograd never sees it
        p.grad = g
        entries.append((f"{name}.{kind}", p, {k: v for k, (_, v) in zip(MOMENTS, moment_views)}))
    return entries, flats


class Bucket:
    """Parameters whose gradients are reduced together, and the flat buffers that hold them."""

    def __init__(self, params: list[nn.Parameter], mesh: ParallelMesh, zero: int, axes: tuple[str, ...] = ("dp",)):
        self.params = decay_first(params)
        self.layout = FlatLayout([p.shape for p in self.params], mesh.size(*axes), mesh.coord(*axes))
        self.param_flat = self.layout.pack(self.params, mesh.device)
        for p, view in zip(self.params, self.layout.views(self.param_flat)):
            p.data = view  # the model's parameters now live in the bucket
        self.grad_flat = None  # zero 2: exists only while a micro-batch's gradients are collected
        self.grad_chunk = None  # zero 1, 2: this rank's chunk of the reduced gradient
        if zero < 2:
            self.grad_flat = torch.zeros_like(self.param_flat)
            for p, view in zip(self.params, self.layout.views(self.grad_flat)):
                p.grad = view  # autograd accumulates in place into the buffer that gets reduced
            if zero == 1:
                self.grad_chunk = self.layout.own(self.grad_flat)  # reduced in place
        else:
            self.grad_chunk = torch.zeros(self.layout.chunk, device=mesh.device)
        self.ready = 0  # gradients of this backward pass that have arrived
        self.pending = None  # the reduction in flight
        self.launched = False  # its reduction of the step's last micro-batch has started (or will, after backward)
        self.in_flight: tuple[torch.Tensor, torch.Tensor] | None = None  # zero 2: (input, output) of it
        self.pending_is_last = False  # the reduction in flight is of the step's last micro-batch
        self.replicating = None  # hybrid sharding: the all-reduce of its reduced chunk between the groups
        self._slots: dict[int, torch.Tensor] = {}

    @property
    def reduced(self) -> torch.Tensor:
        """The reduced gradient as this rank holds it: the whole buffer (zero 0) or its chunk."""
        return self.grad_flat if self.grad_chunk is None else self.grad_chunk

    def collect(self, p: nn.Parameter) -> None:
        """zero 2: copy ``p``'s gradient into the bucket and let autograd's copy go."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.param_flat)
            self._slots = {id(q): v for q, v in zip(self.params, self.layout.views(self.grad_flat))}
        self._slots[id(p)].copy_(p.grad)
        p.grad = None


def bucket_groups(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Buckets of at most ``bucket_mb`` MiB (a larger parameter gets its own) in reverse order
    of the parameters, which is the order backward produces their gradients."""
    cap = bucket_mb * 2**20
    groups, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * 4
        if current and size + nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return groups


# zero 2: a bucket's full gradient lives until its reduce-scatter is done. Waiting for the oldest
# reduction when a third starts bounds them to two buckets (DeepSpeed's reduce bucket and the
# one filling): without the bound each waited until the bucket's next reduction or the step's
# end, and the last micro-batch's backward ended holding the whole model's full gradient (a
# dry run's live peak of llama3-8b, dp8: 30 GiB of them, 0.5 GiB with it).
REDUCTIONS_IN_FLIGHT = 2


class BucketGradSync:
    """zero 0 (DDP), 1 and 2 over ``named_params`` (plain-model key, parameter), reduced over
    the group of mesh ``axes`` (dp; dp and cp under context parallelism, whose ranks hold the
    same weights and different tokens); see the module docstring. ``isolated`` parameters get a
    bucket of their own (the tied embedding of a pipeline, whose reduced gradient then crosses
    the pipeline)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], placements: dict[str, Placement],
                 mesh: ParallelMesh, comm: Comm, zero: int, bucket_mb: float, overlap: bool = True,
                 isolated: tuple[nn.Parameter, ...] = (), axes: tuple[str, ...] = ("dp",),
                 mean_over: int | None = None, replicate_axes: tuple[str, ...] = ()):
        """``replicate_axes``: hybrid sharding (zero 1, 2), the groups ("dpr") that hold the same
        chunks, each sharding over ``axes``; ``mean_over``: the ranks the sums are divided by."""
        if zero not in (0, 1, 2):
            raise ValueError(f"BucketGradSync handles zero 0, 1 and 2, not {zero} (see fsdp.py)")
        self.mesh, self.comm, self.zero, self.overlap, self.axes = mesh, comm, zero, overlap, tuple(axes)
        self.replicate_axes = tuple(a for a in replicate_axes if mesh.size(a) > 1)
        if self.replicate_axes and zero == 0:
            raise ValueError("hybrid sharding shards ZeRO's states: zero 1, 2 (3: fsdp.py), not DDP")
        # the sums become means over this many ranks: the group's size, or all dp ranks for experts
        # reduced over edp (each rank of an ep group already summed the others' tokens)
        self.mean_over = mean_over or mesh.size(*self.axes, *self.replicate_axes)
        self.key_of = {id(p): key for key, p in named_params}
        self.keys = [key for key, _ in named_params]  # the plain-model keys synchronised here
        self.placements = placements
        rest = [p for _, p in named_params if all(p is not q for q in isolated)]
        self.buckets = [Bucket(group, mesh, zero, self.axes) for group in bucket_groups(rest, bucket_mb)]
        self.buckets += [Bucket([p], mesh, zero, self.axes) for p in isolated]
        self.reducing: collections.deque[Bucket] = collections.deque()  # zero 2: in launch order
        self.is_last = False
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._gradient_ready(bucket, p))

    # --- the step -----------------------------------------------------------------------------
    def start_step(self) -> None:
        self.is_last = False

    def last_microbatch(self) -> None:
        """The next backward on these parameters is the step's last."""
        self.is_last = True
        for bucket in self.buckets:
            bucket.launched = False

    def _gradient_ready(self, bucket: Bucket, p: nn.Parameter) -> None:
        if self.zero < 2 and not self.is_last:
            return  # an earlier micro-batch: keep accumulating the full gradient locally
        if self.zero == 2:
            bucket.collect(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0
            bucket.launched = self.is_last
            if self.overlap or self.zero == 2:
                self._launch(bucket)
            else:
                bucket.pending = "after backward"

    def _launch(self, bucket: Bucket) -> None:
        if self.zero == 0:
            bucket.pending = self.comm.all_reduce(bucket.grad_flat, self.axes, async_op=True)
        elif self.zero == 1:  # in place: this rank's chunk of the buffer receives the sum
            bucket.pending = self.comm.reduce_scatter(bucket.grad_chunk, bucket.grad_flat, self.axes, async_op=True)
        else:
            self._wait(bucket)  # the previous micro-batch's reduce-scatter of this bucket
            partial = torch.empty_like(bucket.grad_chunk)
            bucket.pending = self.comm.reduce_scatter(partial, bucket.grad_flat, self.axes, async_op=True)
            bucket.in_flight = (bucket.grad_flat, partial)
            bucket.grad_flat, bucket._slots = None, {}  # the next micro-batch collects into a fresh buffer
        bucket.pending_is_last = bucket.launched
        if self.zero == 2 or (self.replicate_axes and bucket.launched):
            # hybrid sharding (zero 1) waits for the reduce-scatters in order too, so that each
            # bucket's all-reduce between the groups starts behind the backward
            self.reducing.append(bucket)
            while len(self.reducing) > REDUCTIONS_IN_FLIGHT:
                self._wait(self.reducing.popleft())

    def _wait(self, bucket: Bucket) -> None:
        if bucket.pending is None:
            return
        bucket.pending.wait()
        bucket.pending = None
        if bucket.in_flight is not None:  # zero 2: add this micro-batch's chunk, drop its full gradient
            bucket.grad_chunk.add_(bucket.in_flight[1])
            bucket.in_flight = None
        if self.replicate_axes and bucket.pending_is_last:
            # hybrid sharding: the step's reduced chunk (zero 2: every micro-batch's, summed here),
            # all-reduced once between the groups that hold it
            bucket.replicating = self.comm.all_reduce(bucket.grad_chunk, self.replicate_axes, async_op=True)

    def finish(self) -> None:
        """Wait for every reduction of the step and turn the sums into means over the group (each
        rank's gradient is of its mean loss over equally many tokens: the mean of the means is
        the gradient of the global mean)."""
        unreduced = [b for b in self.buckets if not b.launched or b.ready]
        if unreduced:
            raise RuntimeError(f"{plural(len(unreduced), 'gradient bucket')} {'was' if len(unreduced) == 1 else 'were'} "
                               "not reduced in the last micro-batch: "
                               f"data parallelism needs every parameter to receive a gradient")
        for bucket in self.buckets:
            if bucket.pending == "after backward":
                self._launch(bucket)
        self.reducing.clear()
        for bucket in self.buckets:
            self._wait(bucket)
        for bucket in self.buckets:
            if bucket.replicating is not None:
                bucket.replicating.wait()
                bucket.replicating = None
            bucket.reduced.div_(self.mean_over)  # n is a power of two in practice: exact

    def after_optimizer_step(self) -> None:
        """zero 1, 2: each rank updated its chunk; gather everyone's into every replica."""
        if self.zero == 0:
            return
        gathers = [self.comm.all_gather(b.param_flat, b.layout.own(b.param_flat), self.axes, async_op=True)
                   for b in self.buckets]
        for pending in gathers:
            pending.wait()

    def zero_grad(self) -> None:
        for bucket in self.buckets:  # zero 0/1: in place, so p.grad stay views into the buffers
            (bucket.grad_flat if self.zero < 2 else bucket.grad_chunk).zero_()

    def isolated_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The reduced gradient of an isolated parameter, as this rank holds it."""
        return next(b.reduced for b in self.buckets if len(b.params) == 1 and b.params[0] is p)

    # --- what the optimizer, the norm, checkpoints and the memory meter see -------------------
    def _keys(self, bucket: Bucket) -> tuple[list[str], list[Placement]]:
        keys = [self.key_of[id(p)] for p in bucket.params]
        return keys, [self.placements[k] for k in keys]

    def optimizer_params(self) -> list[tuple[str, torch.Tensor, dict | None]]:
        """zero 0: the parameters themselves (AdamW makes their moments); 1, 2: chunk views."""
        if self.zero == 0:
            return [(self.key_of[id(p)], p, None) for b in self.buckets for p in b.params]
        entries, self.moment_flats = [], []
        for i, b in enumerate(self.buckets):
            found, flats = chunk_optimizer_params(b.layout, b.layout.own(b.param_flat), b.grad_chunk, f"bucket{i}")
            entries += found
            self.moment_flats.append(flats)
        return entries

    def grad_shards(self) -> list[Shard]:
        if self.zero == 0:
            return [s for b in self.buckets for p, key in zip(b.params, self._keys(b)[0])
                    for s in whole_shards(f"grad/{key}", p.grad, self.placements[key])]
        return [s for b in self.buckets
                for s in flat_layout_shards(b.layout, *self._keys(b), {"grad": b.grad_chunk}, self.axes)]

    def weight_shards(self) -> list[Shard]:
        """The weights are whole on every replica (zero 0, 1, 2)."""
        return [s for b in self.buckets for p, key in zip(b.params, self._keys(b)[0])
                for s in whole_shards(f"model/{key}", p.data, self.placements[key])]

    def moment_shards(self, state_of) -> list[Shard]:
        """zero 0: each parameter's moments whole (``state_of(p)``: its AdamW state, made if
        missing); zero 1, 2: the moments of this rank's chunk of each bucket."""
        if self.zero == 0:
            return [s for b in self.buckets for p, key in zip(b.params, self._keys(b)[0])
                    for m in MOMENTS for s in whole_shards(f"{m}/{key}", state_of(p)[m], self.placements[key])]
        return [s for b, flats in zip(self.buckets, self.moment_flats)
                for s in flat_layout_shards(b.layout, *self._keys(b), flats, self.axes)]

    def held(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps for these parameters (for the memory meter)."""
        return {"params": [b.param_flat for b in self.buckets],
                "grads": [b.grad_flat if self.zero < 2 else b.grad_chunk for b in self.buckets]}


class GradSyncs:
    """Several gradient synchronisations of one model part driven as one (the same methods as
    ``BucketGradSync``): the dense parameters over dp and the experts over edp."""

    def __init__(self, syncs: list):
        self.syncs = syncs
        self.keys = [key for sync in syncs for key in sync.keys]

    def _each(self, method: str, *args) -> list:
        return [getattr(sync, method)(*args) for sync in self.syncs]

    def start_step(self) -> None:
        self._each("start_step")

    def last_microbatch(self) -> None:
        self._each("last_microbatch")

    def finish(self) -> None:
        self._each("finish")

    def after_optimizer_step(self) -> None:
        self._each("after_optimizer_step")

    def zero_grad(self) -> None:
        self._each("zero_grad")

    def isolated_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self.syncs[0].isolated_grad(p)  # the dense sync: the tied embedding is no expert

    def optimizer_params(self) -> list:
        return [e for found in self._each("optimizer_params") for e in found]

    def grad_shards(self) -> list[Shard]:
        return [s for found in self._each("grad_shards") for s in found]

    def weight_shards(self) -> list[Shard]:
        return [s for found in self._each("weight_shards") for s in found]

    def moment_shards(self, state_of) -> list[Shard]:
        return [s for found in self._each("moment_shards", state_of) for s in found]

    def held(self) -> dict[str, list[torch.Tensor]]:
        found = self._each("held")
        return {kind: [t for h in found for t in h[kind]] for kind in ("params", "grads")}

    def gathered_storages(self) -> list[torch.Tensor]:
        return [t for sync in self.syncs for t in getattr(sync, "gathered_storages", list)()]


class LocalGradSync:
    """No data parallelism (dp = 1): gradients stay where autograd accumulates them, and the
    optimizer updates the parameters themselves. The same methods as ``BucketGradSync``."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], placements: dict[str, Placement]):
        self.named, self.placements = named_params, placements
        self.keys = [key for key, _ in named_params]

    def start_step(self) -> None:
        pass

    def last_microbatch(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None

    def isolated_grad(self, p: nn.Parameter) -> torch.Tensor:
        return p.grad

    def optimizer_params(self) -> list[tuple[str, torch.Tensor, dict | None]]:
        return [(key, p, None) for key, p in self.named]

    def grad_shards(self) -> list[Shard]:
        return [s for key, p in self.named if p.grad is not None
                for s in whole_shards(f"grad/{key}", p.grad, self.placements[key])]

    def weight_shards(self) -> list[Shard]:
        return [s for key, p in self.named for s in whole_shards(f"model/{key}", p.data, self.placements[key])]

    def moment_shards(self, state_of) -> list[Shard]:
        return [s for key, p in self.named for m in MOMENTS
                for s in whole_shards(f"{m}/{key}", state_of(p)[m], self.placements[key])]

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [p for _, p in self.named], "grads": [p.grad for _, p in self.named]}
