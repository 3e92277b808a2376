"""ZeRO-3 / fully sharded data parallelism: parameters are sharded too.

Each rank keeps 1/n of every parameter, of its gradient and of its optimizer states, and
nothing else between steps. The model is cut into units: one per transformer block, and a
root unit for what lies outside the blocks (embedding, final norm, output head). A unit's
parameters form one flat buffer (``FlatLayout``, the same layout the ZeRO-1/2 buckets use),
padded to a multiple of n; rank r keeps chunk r, in fp32: the master weights.

A micro-batch, for each unit:

  forward   all-gather the unit's chunks into its full buffer just before its forward; the
            module's weights become views into that buffer; the gather of the next unit is
            already in flight (prefetch), so it overlaps this unit's compute. After the
            forward the buffer's storage is freed: autograd still holds the views, now empty.
  backward  just before the unit's backward (a hook on its output's gradient) the storage is
            re-allocated and gathered again, so the views autograd saved see the weights
            again; the unit backward will need next is prefetched. When all the unit's
            gradients have accumulated (a hook on the full buffer, a leaf of the graph), the
            gradient is reduce-scattered, summed into this rank's gradient chunk, and the
            full buffer's storage and gradient are freed.

Per micro-batch that is two all-gathers and one reduce-scatter of every parameter:
``m · (n−1)/n · numel · (2·4 + 4)`` bytes per rank, 1.5× DDP's all-reduce at m = 1
(``costs.dp_bytes_per_step``). The root unit is gathered twice as well (FSDP keeps the root
gathered between forward and backward instead; we follow the formula). At most one
reduce-scatter is in flight: the next unit's finishes it first, bounding the full gradients
alive at any time to about two units'.

The optimizer is torch's AdamW on this rank's chunks, exactly as in ZeRO-1/2
(``sharded_adamw``); gradient clipping all-reduces the squared norm of the chunks.
"""
from __future__ import annotations

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed.comm import Comm, Pending
from threefold.distributed.mesh import ParallelMesh
from threefold.models.llama import Llama
from threefold.parallel.data_parallel import DataParallelBase, FlatLayout, decay_first, sharded_adamw
from threefold.train.engine import tensor_bytes
from threefold.train.shards import flat_layout_shards


class ShardedUnit:
    """Some modules' parameters, sharded over dp: the persistent chunk, and the full buffer
    that exists only while the unit computes."""

    def __init__(self, named_modules: list[tuple[str, nn.Module]], mesh: ParallelMesh):
        # Every use of every parameter as (module, attribute, state-dict key): a tied weight has two.
        uses: dict[int, list[tuple[nn.Module, str, str]]] = {}
        params: dict[int, nn.Parameter] = {}
        for prefix, module in named_modules:
            for name, sub in module.named_modules(prefix=prefix):
                for attr, p in sub._parameters.items():
                    if p is not None:
                        params.setdefault(id(p), p)
                        uses.setdefault(id(p), []).append((sub, attr, f"{name}.{attr}"))
        ordered = decay_first(list(params.values()))
        self.uses = [uses[id(p)] for p in ordered]
        self.layout = FlatLayout([p.shape for p in ordered], mesh.size("dp"), mesh.coord("dp"))
        full = self.layout.pack(ordered, mesh.device)
        self.chunk = self.layout.own(full).clone()  # fp32 master weights: all this rank keeps
        self.grad_chunk = torch.zeros_like(self.chunk)
        # The full buffer is a leaf of every graph: the weights are views of it, so autograd
        # sums their gradients into full.grad. Its storage is allocated only while in use.
        self.full = full.requires_grad_()
        self.nbytes = full.untyped_storage().nbytes()
        for module_uses in self.uses:
            for module, attr, _ in module_uses:
                del module._parameters[attr]  # the original parameter goes; install() sets a view
        self.gather: Pending | None = None
        self.gathered = False
        self.free()

    def install(self) -> None:
        """Point the modules' weights at views of the full buffer (graph-connected to it)."""
        for view, module_uses in zip(self.layout.views(self.full), self.uses):
            for module, attr, _ in module_uses:
                setattr(module, attr, view)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False


class FullyShardedEngine(DataParallelBase):
    """zero 3: every state sharded, parameters gathered unit by unit (see the module docstring)."""

    sharded_grads = True

    def __init__(self, model: Llama, cfg: Config, mesh: ParallelMesh, comm: Comm):
        super().__init__(model, cfg, mesh, comm)
        self.state_keys = list(model.state_dict().keys())  # the plain model's, for checkpoints
        self.units = [ShardedUnit([(n, m) for n, m in model.named_children() if n != "blocks"], mesh)]
        self.units += [ShardedUnit([(f"blocks.{i}", block)], mesh) for i, block in enumerate(model.blocks)]
        self.root, self.blocks = self.units[0], self.units[1:]
        self.optimizer, self.moment_chunks = sharded_adamw(
            [u.layout for u in self.units], [u.chunk for u in self.units], [u.grad_chunk for u in self.units], cfg)
        self.tag = None  # "eval" for gathers of a forward without gradients
        self.reducing: tuple[ShardedUnit, Pending, torch.Tensor, torch.Tensor] | None = None
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self._block_pre_forward(i))
            block.register_forward_hook(lambda m, a, out, i=i: self._block_post_forward(i, out))
        for unit in self.units:
            unit.full.register_post_accumulate_grad_hook(lambda full, unit=unit: self._post_backward(unit))

    # --- gathering -------------------------------------------------------------------------------
    def _start_gather(self, unit: ShardedUnit) -> None:
        if unit.gathered or unit.gather is not None:
            return
        unit.full.untyped_storage().resize_(unit.nbytes)
        # Into .data: the write must not bump the version counter autograd checks on the saved views.
        unit.gather = self.comm.all_gather(unit.full.data, unit.chunk, "dp", async_op=True, tag=self.tag)

    def _wait_gather(self, unit: ShardedUnit) -> None:
        self._start_gather(unit)
        if unit.gather is not None:
            unit.gather.wait()
            unit.gather, unit.gathered = None, True

    # --- forward -----------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        self.tag = None if torch.is_grad_enabled() else "eval"
        self._wait_gather(self.root)
        self.root.install()
        if self.blocks:
            self._start_gather(self.blocks[0])

    def _block_pre_forward(self, i: int) -> None:
        self._wait_gather(self.blocks[i])
        self.blocks[i].install()
        if i + 1 < len(self.blocks):
            self._start_gather(self.blocks[i + 1])

    def _block_post_forward(self, i: int, out: torch.Tensor) -> None:
        self.blocks[i].free()
        if out.requires_grad:
            out.register_hook(lambda grad, i=i: self._pre_backward(self.blocks[i], self.blocks[i - 1] if i else None))

    def _root_post_forward(self, module, args, out: torch.Tensor) -> None:
        self.root.free()
        if out.requires_grad:
            last = self.blocks[-1] if self.blocks else None
            out.register_hook(lambda grad: self._pre_backward(self.root, last))

    # --- backward ----------------------------------------------------------------------------
    def _pre_backward(self, unit: ShardedUnit, next_unit: ShardedUnit | None) -> None:
        """The unit's backward is about to run: gather its weights again, prefetch the next."""
        self._wait_gather(unit)
        if next_unit is not None:
            self._start_gather(next_unit)

    def _post_backward(self, unit: ShardedUnit) -> None:
        """All of the unit's gradients are in full.grad: reduce-scatter them, free the unit."""
        self._finish_reduce()
        grad = unit.full.grad
        unit.full.grad = None
        out = torch.empty_like(unit.chunk)
        self.reducing = (unit, self.comm.reduce_scatter(out, grad, "dp", async_op=True), out, grad)
        unit.free()

    def _finish_reduce(self) -> None:
        if self.reducing is None:
            return
        unit, pending, out, _grad = self.reducing  # _grad: kept alive until the collective is done
        pending.wait()
        unit.grad_chunk.add_(out, alpha=1.0 / self.dp_size)  # sum → mean over replicas
        self.reducing = None

    def forward_backward(self, micro_batches) -> float:
        local_mean = super().forward_backward(micro_batches)
        self._finish_reduce()
        return self.mean_over_dp(local_mean)

    # --- the rest of the step ----------------------------------------------------------------
    def reduced_grads(self) -> list[torch.Tensor]:
        return [u.grad_chunk for u in self.units]

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_chunk.zero_()

    def parameter_storages(self) -> set[int]:
        """Storages that hold gathered parameters right now: the activation meter must not
        count the weights autograd saves as activations (they move with every gather)."""
        return {u.full.untyped_storage().data_ptr() for u in self.units if u.full.untyped_storage().nbytes()}

    def memory_bytes(self) -> dict[str, int]:
        return {"params": tensor_bytes(u.chunk for u in self.units),
                "grads": tensor_bytes(u.grad_chunk for u in self.units),
                "optimizer": self.optimizer_state_bytes()}

    def weight_shards(self):
        """This rank's chunk of each unit's weights."""
        return self._unit_shards([{"model": unit.chunk} for unit in self.units])

    def moment_shards(self):
        """This rank's chunk of each unit's moments."""
        return self._unit_shards(self.moment_chunks)

    def _unit_shards(self, chunks: list[dict[str, torch.Tensor]]):
        # A tied weight goes under its first key, the embedding's.
        return [shard for unit, flats in zip(self.units, chunks)
                for shard in flat_layout_shards(unit.layout, [uses[0][2] for uses in unit.uses], flats, self.placement)]

    # --- full states, for checkpoints and generation (collectives: every rank calls them) ----
    @torch.no_grad()
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        state = dict(self.model.state_dict())  # what is not sharded (persistent buffers, if any)
        for unit in self.units:
            full = torch.empty(unit.layout.padded, device=self.mesh.device)
            self.comm.all_gather(full, unit.chunk, "dp", tag="checkpoint")
            for view, module_uses in zip(unit.layout.views(full), unit.uses):
                for _, _, key in module_uses:
                    state[key] = view.clone()
        return {key: state[key] for key in self.state_keys}

    def plain_model(self) -> nn.Module:
        plain = Llama(self.cfg.model).to(self.mesh.device)
        plain.load_state_dict(self.model_state_dict())
        return plain

