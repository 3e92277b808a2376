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
reduce-scatter is in flight on a rank, whichever of its model chunks it is from (``Reductions``):
the next unit's finishes it first, bounding the full gradients alive at any time to about two
units'. A root that comes after the blocks (a last pipeline stage's
final norm and head) installs its weights as leaves on the full buffer's storage, as W does
below, and is reduced as soon as its weights' gradients are in: right after the head's backward.
Through the views, autograd would reach the buffer only after every block's backward (its view
nodes are older than the blocks'), keeping the head's fp32 gradient that long and leaving the
root's reduction in flight into the next micro-batch (Llama 3 8B's last rank at dp2·tp2·pp2: 1.6
GB more at its peak, docs/scale.md).

Full recomputation runs a block's forward again inside the backward. A unit inside the block (an
MoE block's experts: the block's own hooks sit outside the checkpoint) then gathers for that
forward and stays gathered for the backward that follows, as torch's FSDP2 does: still two
gathers a micro-batch (a dry run once counted three).

The optimizer is torch's AdamW on this rank's chunks, exactly as in ZeRO-1/2
(``chunk_optimizer_params``); gradient clipping all-reduces the squared norm of the chunks.

Hybrid sharding (HSDP, FSDP's HYBRID_SHARD; ``parallel.dp_shard``): the units are sharded over
groups of dp_shard consecutive dp ranks (the mesh's dps × ep; the routed experts over the dps of
them that hold the same experts, or, where that is one rank, dp_shard = ep, not by this module:
the engine runs them as plain data parallelism), each group holding a whole copy of the states,
so the gathers stay inside the group (a node, typically) and only gradients cross between groups: each
reduce-scattered shard is then all-reduced over the dp / dp_shard ranks that hold the same shard
("dpr"), behind the backward as the reduce-scatters are. Per micro-batch that
adds ``2 (r−1)/r · numel/s · 4`` bytes a rank (r groups of s) to the gathers' and reduce-scatters'
over s ranks (``costs.dp_bytes_per_step``), while each rank keeps 1/s of the states, not 1/dp.

``ShardedGradSync`` applies this to one model part: the whole model, or one pipeline stage (its
root unit is then what the stage holds outside its blocks: the embedding on the first stage,
the final norm and head on the last). The pipeline runtime embeds the tokens before it calls
the stage, so the root is gathered before the first of the two forwards and freed after the
stage's. A tied embedding shared by two stages is a unit of its own on both, so that their
reduced chunks line up and can be summed across the pipeline. The units reduce-scatter every
micro-batch's gradients, so nothing here depends on which micro-batch is the last.

Under a schedule that splits the backward (ZB-H1, DualPipeV; ``split_backward``) a micro-batch's
backward is two autograd passes. B, the input gradients, reads the weights: each unit is gathered
again before its part of B, as above, and freed as soon as B has gone past it (when the next
unit's part begins, and at B's end whatever is left), since B accumulates no gradient that would
free it. W, the weight gradients, reads no weight (a product's weight gradient is its input times
its output's gradient): the unit stays freed. Its weights are then installed as leaves of their
own on the full buffer's storage, not as views in its graph: W computes each weight's gradient
alone (one call from a full buffer would also redo the input gradients inside the unit, which
lead to it through the unit's other weights), and once all of a unit's are in, they are packed
into its full gradient and reduce-scattered as above. The bytes per micro-batch are 1F1B's: two
all-gathers and one reduce-scatter.

Keeping the units gathered through the step (``parallel.reshard_after_forward = false``, and where
the key is unset, under a pipeline; FSDP2's ``reshard_after_forward=False`` under
``torch.distributed.pipelining``, torchtitan's default with a pipeline). Each unit is gathered
at its first forward of the step and stays gathered until the backward that produces its last
gradients of the step (the engine says which: ``last_microbatch``);
its full gradient accumulates over the micro-batches, as autograd accumulates into a leaf, and is
reduce-scattered once, after which the unit is freed. Per step that is one all-gather and one
reduce-scatter of every parameter, ``(n−1)/n · numel · (4 + 4)`` bytes a rank, whatever the number
of micro-batches: ZeRO-1's traffic and, inside the step, its memory (every unit's full weights and,
from its first backward, its full gradient), while between steps a rank still keeps only its
shards. A pipeline's stage runs many micro-batches, so this trades memory for m − 1 fewer
gathers; a forward without gradients (validation) still frees each unit after it.
"""
from __future__ import annotations

import torch
from torch import nn

from threefold.distributed.comm import Comm, Pending
from threefold.distributed.mesh import ParallelMesh
from threefold.parallel.data_parallel import FlatLayout, chunk_optimizer_params, decay_first
from threefold.parallel.placements import Placement, Shard, flat_layout_shards


def in_backward() -> bool:
    """Whether autograd's backward is running this forward: full recomputation re-running a block
    whose units sit inside it (an MoE block's experts). torch's FSDP2 asks the same (``is_bw``)."""
    return torch._C._current_graph_task_id() != -1


class ShardedUnit:
    """Some parameters, sharded over dp: the persistent chunk, and the full buffer that exists
    only while the unit computes. ``uses``: every (module, attribute) that holds each one (a
    tied weight has two)."""

    def __init__(self, params: list[nn.Parameter], uses: dict[int, list[tuple[nn.Module, str]]], mesh: ParallelMesh,
                 axes: tuple[str, ...] = ("dp",)):
        self.params = decay_first(params)  # the original parameters, kept only for their keys
        self.uses = [uses[id(p)] for p in self.params]
        self.layout = FlatLayout([p.shape for p in self.params], mesh.size(*axes), mesh.coord(*axes))
        full = self.layout.pack(self.params, mesh.device)
        for p in self.params:  # their values are in ``full`` now: kept, they would be a whole copy of the unit
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.chunk = self.layout.own(full).clone()  # fp32 master weights: all this rank keeps
        self.grad_chunk = torch.zeros_like(self.chunk)
        # The full buffer is a leaf of every graph: the weights are views of it, so autograd
        # sums their gradients into full.grad. Its storage is allocated only while in use.
        self.full = full.requires_grad_()
        self.nbytes = full.untyped_storage().nbytes()
        for module_uses in self.uses:
            for module, attr in module_uses:
                del module._parameters[attr]  # the original parameter goes; install() sets a view
        self.gather: Pending | None = None
        self.gathered = False
        self.weights_in = 0  # as leaves: the weights whose gradient has accumulated
        self.as_leaves = False  # its weights installed as leaves of their own (see ShardedGradSync)
        self.free()

    def install(self, on_grad=None) -> None:
        """Point the modules' weights at views of the full buffer, graph-connected to it; given
        ``on_grad``, at leaves of their own on its storage, each calling ``on_grad(index, leaf)``
        once its gradient has accumulated (a split backward's W; see the module docstring)."""
        for index, (view, module_uses) in enumerate(zip(self.layout.views(self.full), self.uses)):
            if on_grad is not None:
                view = view.detach().requires_grad_()
                view.register_post_accumulate_grad_hook(lambda leaf, index=index: on_grad(index, leaf))
            for module, attr in module_uses:
                setattr(module, attr, view)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        self.gathered = False


class Reductions:
    """The one reduction a rank keeps in flight for all its ZeRO-3 units: the reduce-scatter
    (``reducing``: sync, unit, its pending work, the output chunk, the full gradient it reads) and
    under hybrid sharding the all-reduce over the groups that follows it (``replicating``). Shared
    by the syncs of a rank's model chunks (an interleaved or DualPipeV rank has one per chunk), so
    that each chunk's last reduction does not stay in flight, its full gradient alive, until that
    chunk's next backward: at four chunks a rank, four units' gradients at once."""

    def __init__(self):
        self.reducing: tuple | None = None
        self.replicating: tuple | None = None


def parameter_uses(module: nn.Module) -> tuple[list[nn.Parameter], dict[int, list[tuple[nn.Module, str]]]]:
    """The distinct parameters under ``module`` and every (sub-module, attribute) holding each."""
    params: dict[int, nn.Parameter] = {}
    uses: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None:
                params.setdefault(id(p), p)
                uses.setdefault(id(p), []).append((sub, attr))
    return list(params.values()), uses


class ShardedGradSync:
    """zero 3 over one model part (see the module docstring), sharded over the group of mesh
    ``axes`` (dp; dp and cp under context parallelism). ``part`` has ``blocks`` (a list or dict
    of blocks) and optionally ``embed``; ``isolated`` parameters get units of their own."""

    def __init__(self, part: nn.Module, key_of: dict[int, str], placements: dict[str, Placement],
                 mesh: ParallelMesh, comm: Comm, isolated: tuple[nn.Parameter, ...] = (),
                 axes: tuple[str, ...] = ("dp",), mean_over: int | None = None,
                 replicate_axes: tuple[str, ...] = (), split_backward: bool = False,
                 in_flight: Reductions | None = None, reshard_after_forward: bool = True):
        """``key_of`` names the parameters synchronised here (others under ``part``, the experts
        that another sync shards over edp, are left alone); ``mean_over``: the ranks the sums are
        divided by (the groups' size, or all dp ranks for experts reduced over edp);
        ``replicate_axes``: hybrid sharding's groups holding the same shards ("dpr");
        ``split_backward``: the pipeline runs B and W apart (see the module docstring);
        ``in_flight``: the rank's Reductions, shared with its other chunks' syncs (a new one if None);
        ``reshard_after_forward`` False: keep the units gathered through the step (see the docstring)."""
        self.mesh, self.comm, self.key_of, self.placements = mesh, comm, key_of, placements
        self.split_backward = split_backward
        self.keep_gathered = not reshard_after_forward
        self.reduce_now = True  # whether a unit's complete gradient is reduced now (kept gathered: at the last backward)
        self.free_after_backward = False  # B's end-of-pass callback is queued
        self.axes, self.replicate_axes = tuple(axes), tuple(a for a in replicate_axes if mesh.size(a) > 1)
        self.mean_over = mean_over or mesh.size(*self.axes, *self.replicate_axes)
        self.keys = list(key_of.values())  # the plain-model keys synchronised here
        params, uses = parameter_uses(part)
        params = [p for p in params if id(p) in key_of]
        blocks = list(part.blocks.values() if isinstance(part.blocks, nn.ModuleDict) else part.blocks)
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        alone = {id(p) for p in isolated}
        root = [p for p in params if id(p) not in in_blocks and id(p) not in alone]
        self.roots = [ShardedUnit(group, uses, mesh, self.axes)
                      for group in ([root] if root else []) + [[p] for p in isolated]]
        self.blocks = [ShardedUnit([p for p in block.parameters() if id(p) in key_of], uses, mesh, self.axes)
                       for block in blocks]
        self.units = self.roots + self.blocks
        # Roots after the blocks (a last stage's final norm and head, not the embedding) take their
        # gradients as leaves, as W does (see the module docstring): reduced right after the head's
        # backward, not when autograd reaches the full buffer. Its view nodes, made before the
        # blocks' forward, run last, so the head's fp32 gradient was kept through the blocks'
        # backward and its reduction was the one left in flight into the next micro-batch.
        after_blocks = self.roots if getattr(part, "embed", None) is None else []
        for unit in self.units if split_backward else after_blocks:
            unit.as_leaves = True
        self.tag = None  # "eval" for gathers of a forward without gradients
        self.in_flight = in_flight if in_flight is not None else Reductions()
        part.register_forward_pre_hook(self._root_pre_forward)
        if getattr(part, "embed", None) is not None:
            part.embed.register_forward_pre_hook(self._root_pre_forward)  # the runtime embeds first
        part.register_forward_hook(self._root_post_forward)
        for i, block in enumerate(blocks):
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
        unit.gather = self.comm.all_gather(unit.full.data, unit.chunk, self.axes, async_op=True, tag=self.tag)

    def _wait_gather(self, unit: ShardedUnit) -> None:
        self._start_gather(unit)
        if unit.gather is not None:
            unit.gather.wait()
            unit.gather, unit.gathered = None, True

    def _keeps(self) -> bool:
        """Whether the units stay gathered after this forward: kept through the step, and training."""
        return self.keep_gathered and self.tag is None

    def _install(self, unit: ShardedUnit) -> None:
        unit.install((lambda index, leaf: self._weight_grad(unit, index, leaf)) if unit.as_leaves else None)

    # --- forward -----------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if any(u.gathered for u in self.roots):
            return  # the embedding's hook already gathered them for this forward
        self.tag = None if torch.is_grad_enabled() else "eval"
        for unit in self.roots:
            self._start_gather(unit)
        for unit in self.roots:
            self._wait_gather(unit)
            self._install(unit)
        if self.blocks:
            self._start_gather(self.blocks[0])

    def _block_pre_forward(self, i: int) -> None:
        if not self.roots:  # units without a root (the experts' sync): the tag is set here
            self.tag = None if torch.is_grad_enabled() else "eval"
        self._wait_gather(self.blocks[i])
        self._install(self.blocks[i])
        if i + 1 < len(self.blocks) and not in_backward():  # a recompute's next unit has had its backward
            self._start_gather(self.blocks[i + 1])

    def _block_post_forward(self, i: int, out: torch.Tensor) -> None:
        if in_backward():
            return  # recomputed for the backward about to use these weights: keep them gathered
        if not self._keeps():
            self.blocks[i].free()
        if out.requires_grad:
            previous = self.blocks[i - 1] if i else None
            out.register_hook(lambda grad, i=i: self._pre_backward([self.blocks[i]], previous))

    def _root_post_forward(self, module, args, out: torch.Tensor) -> None:
        if not self._keeps():
            for unit in self.roots:
                unit.free()
        if out.requires_grad and self.roots:
            last = self.blocks[-1] if self.blocks else None
            out.register_hook(lambda grad: self._pre_backward(self.roots, last))

    # --- backward ----------------------------------------------------------------------------
    def _pre_backward(self, units: list[ShardedUnit], next_unit: ShardedUnit | None) -> None:
        """The units' backward is about to run: gather their weights again, prefetch the next.
        In B of a split backward, the units B has gone past are freed here (see the docstring)."""
        if self.split_backward and not self.keep_gathered:  # (first stage: the roots' hook fires after the last block's)
            for unit in self.units:
                if unit.gathered and unit not in units and unit is not next_unit:
                    unit.free()
            if not self.free_after_backward:
                self.free_after_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._after_input_backward)
        for unit in units:
            self._wait_gather(unit)
        if next_unit is not None:
            self._start_gather(next_unit)

    def _after_input_backward(self) -> None:
        """The end of B: free every unit, waiting for a prefetch B did not use."""
        self.free_after_backward = False
        for unit in self.units:
            if unit.gather is not None:
                self._wait_gather(unit)
            if unit.gathered:
                unit.free()

    def _post_backward(self, unit: ShardedUnit) -> None:
        """All of the unit's gradients are in full.grad: reduce-scatter them, free the unit. Kept
        gathered through the step, before its last backward: leave them there, where the next
        micro-batch's accumulate."""
        if self.keep_gathered and not self.reduce_now:
            return
        self._finish_reduce()
        grad = unit.full.grad
        unit.full.grad = None
        out = torch.empty_like(unit.chunk)
        self.in_flight.reducing = (self, unit, self.comm.reduce_scatter(out, grad, self.axes, async_op=True), out, grad)
        unit.free()

    def _weight_grad(self, unit: ShardedUnit, index: int, leaf: torch.Tensor) -> None:
        """One of the unit's weights' gradient accumulated (W of a split backward; a root's after
        the blocks, in any backward): into the unit's full gradient; once every weight's is in,
        the unit is reduced as after a whole backward."""
        if unit.full.grad is None:
            unit.full.grad = torch.zeros_like(unit.full)
        unit.layout.views(unit.full.grad)[index].add_(leaf.grad)
        leaf.grad = None
        unit.weights_in += 1
        if unit.weights_in == len(unit.params):
            unit.weights_in = 0
            self._post_backward(unit)

    def _finish_reduce(self) -> None:
        """Finish the rank's reduction in flight, whichever chunk's sync started it: the
        reduce-scatter, and under hybrid sharding the all-reduce over the groups, which then stays
        in flight behind the next unit's backward."""
        flight = self.in_flight
        if flight.replicating is not None:
            sync, unit, pending, out = flight.replicating
            pending.wait()
            unit.grad_chunk.add_(out, alpha=1.0 / sync.mean_over)
            flight.replicating = None
        if flight.reducing is None:
            return
        sync, unit, pending, out, _grad = flight.reducing  # _grad: kept alive until the collective is done
        pending.wait()
        flight.reducing = None
        if sync.replicate_axes:
            flight.replicating = (sync, unit, sync.comm.all_reduce(out, sync.replicate_axes, async_op=True), out)
            return
        unit.grad_chunk.add_(out, alpha=1.0 / sync.mean_over)  # sum → mean over the group (see __init__)

    # --- the step, as the engine drives it -----------------------------------------------------
    def start_step(self) -> None:
        self.reduce_now = not self.keep_gathered  # resharding: every micro-batch's, as they arrive

    def last_microbatch(self) -> None:
        self.reduce_now = True  # kept gathered: the gradients accumulated over the step

    def finish(self) -> None:
        partial = [i for i, unit in enumerate(self.units) if unit.weights_in]
        if partial:  # a weight got no gradient (in W, or a root's leaves): the unit would never be reduced
            raise RuntimeError(f"ZeRO-3: unit {partial[0]} got gradients for {self.units[partial[0]].weights_in} of its "
                               f"{len(self.units[partial[0]].params)} weights in the step's last backward")
        self._finish_reduce()
        self._finish_reduce()  # hybrid sharding: the last all-reduce, started by the first call

    def after_optimizer_step(self) -> None:
        pass  # the chunks are the weights; the next forward gathers them

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grad_chunk.zero_()

    def isolated_grad(self, p: nn.Parameter) -> torch.Tensor:
        return next(u.grad_chunk for u in self.units if len(u.params) == 1 and u.params[0] is p)

    # --- what the optimizer, the norm, checkpoints and the memory meter see -------------------
    def _keys(self, unit: ShardedUnit) -> tuple[list[str], list[Placement]]:
        keys = [self.key_of[id(p)] for p in unit.params]
        return keys, [self.placements[k] for k in keys]

    def optimizer_params(self) -> list[tuple[str, torch.Tensor, dict | None]]:
        entries, self.moment_flats = [], []
        for i, unit in enumerate(self.units):
            found, flats = chunk_optimizer_params(unit.layout, unit.chunk, unit.grad_chunk, f"unit{i}")
            entries += found
            self.moment_flats.append(flats)
        return entries

    def grad_shards(self) -> list[Shard]:
        return [s for u in self.units
                for s in flat_layout_shards(u.layout, *self._keys(u), {"grad": u.grad_chunk}, self.axes)]

    def weight_shards(self) -> list[Shard]:
        return [s for u in self.units for s in flat_layout_shards(u.layout, *self._keys(u), {"model": u.chunk},
                                                                  self.axes)]

    def moment_shards(self, state_of) -> list[Shard]:
        return [s for u, flats in zip(self.units, self.moment_flats)
                for s in flat_layout_shards(u.layout, *self._keys(u), flats, self.axes)]

    def held(self) -> dict[str, list[torch.Tensor]]:
        return {"params": [u.chunk for u in self.units], "grads": [u.grad_chunk for u in self.units]}

    def gathered_storages(self) -> list[torch.Tensor]:
        """The full buffers, whose storages hold the gathered parameters: the activation meter must
        not count the weights autograd saves as activations. All of them, gathered or not: a
        storage keeps its identity across its gathers, and most are gathered after the meter asks."""
        return [u.full for u in self.units]
