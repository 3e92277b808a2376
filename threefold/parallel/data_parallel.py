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
reduce-scatter is done, and autograd's own gradient is freed at once). A bucket
is padded with zeros to a multiple of the dp size, so it splits into n equal chunks, chunk r
belonging to rank r; the padding is the only difference from the planner's byte counts.

The optimizer is torch's own AdamW, run on this rank's chunks: one view per (bucket, decay
group), matrices' chunks shaped as 1×k rows so ``engine.build_adamw`` puts them in the
weight-decay group. AdamW is elementwise, so this is the same arithmetic as AdamW on the
full tensors.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed.comm import Comm
from threefold.distributed.mesh import ParallelMesh
from threefold.train.engine import Engine, build_adamw, init_adam_state, scale_to_norm, tensor_bytes
from threefold.train.shards import MOMENTS, flat_layout_shards


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


def sharded_adamw(layouts, param_chunks, grad_chunks, cfg: Config) -> tuple[torch.optim.AdamW, list[dict]]:
    """torch AdamW over this rank's chunks, with the same groups and settings as the single-process
    engine. Adam's moments are created here, as views into one flat buffer per chunk, so that a
    checkpoint finds them laid out like the chunk; returns (optimizer, [{moment: flat buffer}])."""
    named, moments, states = [], [], []
    for i, (layout, params, grads) in enumerate(zip(layouts, param_chunks, grad_chunks)):
        flats = {kind: torch.zeros_like(params) for kind in MOMENTS}
        moments.append(flats)
        views = zip(layout.decay_split(params), layout.decay_split(grads),
                    *(layout.decay_split(flat) for flat in flats.values()))
        for (kind, p), (_, g), *moment_views in views:
            p.requires_grad_()  # marks it trainable for build_adamw; autograd never sees it
            p.grad = g  # a view: the optimizer always reads the current reduced gradient
            named.append((f"{i}.{kind}", p))
            states.append((p, {k: v for k, (_, v) in zip(MOMENTS, moment_views)}))
    optimizer = build_adamw(named, cfg)
    for p, state in states:
        init_adam_state(optimizer, p, **state)
    return optimizer, moments


class DataParallelBase(Engine):
    """What every data-parallel engine shares: the mesh, counted communication, the loss
    averaged over replicas, and gradient clipping by the global norm."""

    sharded_grads = False  # True when each rank holds only its chunk of the reduced gradient

    def __init__(self, model: nn.Module, cfg: Config, mesh: ParallelMesh, comm: Comm):
        super().__init__(model, cfg)
        self.mesh, self.comm = mesh, comm
        self.rank, self.world_size = mesh.rank, mesh.world_size
        self.dp_rank, self.dp_size = mesh.coord("dp"), mesh.size("dp")

    @property
    def device(self) -> torch.device:
        return self.mesh.device  # ZeRO-3 leaves the model without parameters between steps

    def mean_over_dp(self, local_mean: float) -> float:
        """The loss of the global batch: every replica ran the same number of tokens, so it is
        the mean of the replicas' means. A scalar, counted under the "scalar" tag."""
        loss = torch.tensor([local_mean], dtype=torch.float64, device=self.mesh.device)
        self.comm.all_reduce(loss, "dp", tag="scalar")
        return loss.item() / self.dp_size

    def reduced_grads(self) -> list[torch.Tensor]:
        """The reduced gradient as this rank holds it: all of it, or its chunks when sharded."""
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> float:
        grads = self.reduced_grads()
        squares = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        if self.sharded_grads:  # the chunks of all ranks together make up the gradient
            self.comm.all_reduce(squares, "dp", tag="scalar")
        return scale_to_norm(grads, squares, max_norm)

    def comm_bytes(self) -> dict[str, int]:
        return self.comm.ledger.take()

    def barrier(self) -> None:
        self.comm.barrier()

    def shutdown(self) -> None:
        self.mesh.shutdown()

    def optimizer_state_bytes(self) -> int:
        """Adam's moments held by this rank (step counters left out, as in Engine.memory_bytes)."""
        return tensor_bytes(v for s in self.optimizer.state.values() for v in s.values()
                            if torch.is_tensor(v) and v.dim() > 0)


class Bucket:
    """Parameters whose gradients are reduced together, and the flat buffers that hold them."""

    def __init__(self, params: list[nn.Parameter], mesh: ParallelMesh, zero: int):
        self.params = decay_first(params)
        self.layout = FlatLayout([p.shape for p in self.params], mesh.size("dp"), mesh.coord("dp"))
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
        self.in_flight: tuple[torch.Tensor, torch.Tensor] | None = None  # zero 2: (input, output) of it
        self._slots: dict[int, torch.Tensor] = {}

    def collect(self, p: nn.Parameter) -> None:
        """zero 2: copy ``p``'s gradient into the bucket and let autograd's copy go."""
        if self.grad_flat is None:
            self.grad_flat = torch.zeros_like(self.param_flat)
            self._slots = {id(q): v for q, v in zip(self.params, self.layout.views(self.grad_flat))}
        self._slots[id(p)].copy_(p.grad)
        p.grad = None


def make_buckets(model: nn.Module, mesh: ParallelMesh, bucket_mb: float, zero: int) -> list[Bucket]:
    """Fill buckets of at most ``bucket_mb`` MiB (a larger parameter gets its own) in reverse
    order of the parameters, which is the order backward produces their gradients."""
    cap = bucket_mb * 2**20
    groups, current, size = [], [], 0
    for p in reversed(list(model.parameters())):
        nbytes = p.numel() * 4
        if current and size + nbytes > cap:
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        groups.append(current)
    return [Bucket(params, mesh, zero) for params in groups]


class BucketedEngine(DataParallelBase):
    """What every engine over flat gradient buckets (zero 0, 1, 2) does after the backward; the
    data-parallel engine below and the pipeline engine share it."""

    def reduced_grads(self) -> list[torch.Tensor]:
        return [b.grad_flat if self.zero == 0 else b.grad_chunk for b in self.buckets]

    def optimizer_step(self, lr: float) -> None:
        super().optimizer_step(lr)
        if self.sharded_grads:  # each rank updated its chunk; gather everyone's into every replica
            gathers = [self.comm.all_gather(b.param_flat, b.layout.own(b.param_flat), "dp", async_op=True)
                       for b in self.buckets]
            for pending in gathers:
                pending.wait()

    def zero_grad(self) -> None:
        # zero 0/1: zero the buffers in place, so p.grad stay views into them.
        for bucket in self.buckets:
            (bucket.grad_flat if self.zero < 2 else bucket.grad_chunk).zero_()

    def moment_shards(self):
        """zero 0: whole (Engine's). zero 1, 2: the moments of this rank's chunk of each bucket
        (the weights are whole on every replica either way)."""
        if not self.sharded_grads:
            return super().moment_shards()
        keys = {id(p): key for key, p in self.named_local_parameters()}
        return [shard for bucket, moments in zip(self.buckets, self.moment_chunks)
                for shard in flat_layout_shards(bucket.layout, [keys[id(p)] for p in bucket.params], moments,
                                                self.placement)]


class DataParallelEngine(BucketedEngine):
    """zero 0 (DDP), 1 and 2; see the module docstring."""

    def __init__(self, model: nn.Module, cfg: Config, mesh: ParallelMesh, comm: Comm):
        self.zero = cfg.parallel.zero
        if self.zero not in (0, 1, 2):
            raise ValueError(f"DataParallelEngine handles zero 0, 1 and 2, not {self.zero} (see fsdp.py)")
        self.buckets = make_buckets(model, mesh, cfg.parallel.bucket_mb, self.zero)
        super().__init__(model, cfg, mesh, comm)  # zero 0: torch AdamW over the model's parameters
        self.sharded_grads = self.zero > 0
        if self.sharded_grads:
            self.optimizer, self.moment_chunks = sharded_adamw(
                [b.layout for b in self.buckets], [b.layout.own(b.param_flat) for b in self.buckets],
                [b.grad_chunk for b in self.buckets], cfg)
        self._micro_batches = self._forwards = 0
        # Counting forward passes tells the hooks which backward belongs to the last micro-batch.
        model.register_forward_pre_hook(self._count_forward)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(lambda p, bucket=bucket: self._gradient_ready(bucket, p))

    # --- the step -----------------------------------------------------------------------------
    def forward_backward(self, micro_batches) -> float:
        self._micro_batches, self._forwards = len(micro_batches), 0
        local_mean = super().forward_backward(micro_batches)  # the hooks launch the reductions
        self._finish_reductions()
        return self.mean_over_dp(local_mean)

    def _count_forward(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._forwards += 1

    def _gradient_ready(self, bucket: Bucket, p: nn.Parameter) -> None:
        if self.zero < 2 and self._forwards < self._micro_batches:
            return  # an earlier micro-batch: keep accumulating the full gradient locally
        if self.zero == 2:
            bucket.collect(p)
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if self.zero == 0:
            bucket.pending = self.comm.all_reduce(bucket.grad_flat, "dp", async_op=True)
        elif self.zero == 1:  # in place: this rank's chunk of the buffer receives the sum
            bucket.pending = self.comm.reduce_scatter(bucket.grad_chunk, bucket.grad_flat, "dp", async_op=True)
        else:
            self._finish(bucket)  # the previous micro-batch's reduce-scatter of this bucket
            partial = torch.empty_like(bucket.grad_chunk)
            bucket.pending = self.comm.reduce_scatter(partial, bucket.grad_flat, "dp", async_op=True)
            bucket.in_flight = (bucket.grad_flat, partial)
            bucket.grad_flat = None  # the next micro-batch collects into a fresh buffer

    def _finish(self, bucket: Bucket) -> None:
        if bucket.pending is None:
            return
        bucket.pending.wait()
        bucket.pending = None
        if bucket.in_flight is not None:  # zero 2: add this micro-batch's chunk, drop its full gradient
            bucket.grad_chunk.add_(bucket.in_flight[1])
            bucket.in_flight = None

    def _finish_reductions(self) -> None:
        unreduced = [b for b in self.buckets if b.pending is None or b.ready]
        if unreduced:
            raise RuntimeError(f"{len(unreduced)} gradient buckets were not reduced in the last micro-batch: "
                               f"data parallelism needs every parameter to receive a gradient")
        for bucket in self.buckets:
            self._finish(bucket)
            # Sum → mean over the replicas (n is a power of two in practice, so this is exact).
            (bucket.grad_flat if self.zero == 0 else bucket.grad_chunk).div_(self.dp_size)

    # --- what this rank holds -----------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        grads = [b.grad_flat if self.zero < 2 else b.grad_chunk for b in self.buckets]
        return {"params": tensor_bytes(b.param_flat for b in self.buckets), "grads": tensor_bytes(grads),
                "optimizer": self.optimizer_state_bytes()}
