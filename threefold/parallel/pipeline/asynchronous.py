"""Pipelines that never flush: PipeDream-2BW (``schedule = "2bw"``) and PipeDream with weight
stashing (``schedule = "pipedream"``).

A run is 1F1B over all its micro-batches (schedule.py's ``build_run``): the warm-up forwards of
step t + 1 fill the drain of step t, so the pipeline fills once per run instead of once per
step. The runtime plays one step at a time (``run_step``: the step ends with its last backward,
so its gradients are complete and the trainer's clip and optimizer step run as for any layout),
and carries across the step boundary what the early forwards left: their autograd graphs, and
the activation sends that the next rank takes only in its next step.

The price is staleness. When a stage runs the forward of a later batch, its weights have not
seen the updates of the batches still in flight, so each batch runs its forward and its backward
on an older version of the weights, and its gradient updates the newest:

  W(t) = Opt(W(t − 1), ∇L_t(W(t − delay)))         batches numbered from 1, W(k < 0) = W(0)

2BW: delay 2 on every stage (two versions held: the one in-flight batches use and the newest),
as Narayanan et al. 2021 define it; the first two batches both use W(0). PipeDream: one
micro-batch per batch, stage s's delay is pp − s (the batches in flight there), so stage s holds
pp − s versions; a batch uses the same version for its forward and backward on a stage, but
stages use different versions (Harlap et al. 2018's weight stashing, without vertical sync).

How a version is used. The live parameters stay where the gradient sync keeps them (views into
its flat buffers) and always hold the newest weights, which the optimizer updates in place. A
version is a copy, taken after each update. For a forward or backward on version k, each
parameter slot of the stage's modules is swapped for ``UseVersion(param, copy)``: its value is
the copy (a view, no new memory: autograd saves the copy for the backward, which nothing ever
changes in place), its gradient flows to the live parameter, so ``.grad``, the gradient sync's
hooks and buckets see nothing different. The backward runs under the same swap, so recomputed
activations (``train.recompute``) are recomputed on the version their forward used.

Checkpoints. A checkpoint is taken with the pipeline drained, so what a resumed run needs
besides the live weights (the newest version) is each stage's older versions: the checkpoint
holds them as "version<j>/<key>", the weights j updates older than the newest, placed in the
plain model's tensors as "model/<key>" is (``AsyncPipelineRuntime.version_shards``). Which
versions a stage keeps follows from the update count (Adam's step) and the stage's delay, so a
resumed run (``resume_at``) knows which to read before it reads them.
"""
from __future__ import annotations

import contextlib
from collections import deque

import torch
from torch import nn

from threefold.parallel.pipeline.runtime import PipelineRuntime, StepState, token_positions
from threefold.parallel.placements import Placement, Shard, whole_shards
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY, Kind, RunStep, run_step, steps_ahead
from threefold.words import plural


class UseVersion(torch.autograd.Function):
    """The value of a stored weight version; the gradient of the live parameter."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, version: torch.Tensor) -> torch.Tensor:
        return version.view_as(version)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class WeightVersions:
    """The versions of one stage's weights that its batches in flight use (see the module
    docstring). ``delay``: batch t (counted in updates) runs on version t − delay."""

    def __init__(self, module: nn.Module, delay: int):
        self.params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        self.slots: list[tuple[nn.Module, str, int]] = []  # (module, attribute, index into params)
        for sub in module.modules():
            for name, q in sub._parameters.items():
                if q is not None and q.requires_grad:
                    if id(q) not in index:
                        index[id(q)] = len(self.params)
                        self.params.append(q)
                    self.slots.append((sub, name, index[id(q)]))
        self.delay = delay
        self.updates = 0  # optimizer steps taken
        self.versions: dict[int, list[torch.Tensor]] = {}

    def version_for(self, steps_later: int = 0) -> int:
        """The version the batch ``steps_later`` steps after the next one runs on."""
        if self.updates not in self.versions:  # the weights as the run starts, W(0), or resumes
            self.versions[self.updates] = self._copy()
        return max(0, self.updates + 1 + steps_later - self.delay)

    def oldest_kept(self) -> int:
        """The oldest version a batch not yet started will use."""
        return max(0, self.updates + 1 - self.delay)

    def after_update(self) -> None:
        """Record the newest version and drop those no batch will use again."""
        self.version_for()
        self.updates += 1
        self.versions[self.updates] = self._copy()
        for k in [k for k in self.versions if k < self.oldest_kept()]:
            del self.versions[k]

    def older(self) -> dict[int, list[torch.Tensor]]:
        """The stored versions older than the newest, by how many updates older (1, 2, …): what
        a resumed run needs besides the live weights."""
        return {self.updates - k: tensors for k, tensors in self.versions.items() if k < self.updates}

    def resume_at(self, updates: int) -> None:
        """The run goes on after ``updates`` optimizer steps: the older versions it keeps there,
        as buffers for a checkpoint's load to fill; the newest is copied from the live weights
        (loaded by then) at the first forward."""
        self.updates = updates
        self.versions = {k: [torch.empty_like(q.detach()) for q in self.params]
                         for k in range(self.oldest_kept(), updates)}

    def _copy(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [q.detach().clone() for q in self.params]

    @contextlib.contextmanager
    def using(self, version: int):
        """The stage's modules compute with ``version``'s values, gradients going to the live weights."""
        tensors = self.versions[version]
        for module, name, i in self.slots:
            module._parameters[name] = UseVersion.apply(self.params[i], tensors[i])
        try:
            yield
        finally:
            for module, name, i in self.slots:
                module._parameters[name] = self.params[i]

    def nbytes(self) -> int:
        """Bytes of the stored versions."""
        return sum(t.numel() * t.element_size() for tensors in self.versions.values() for t in tensors)


class AsyncPipelineRuntime(PipelineRuntime):
    """``PipelineRuntime`` for the schedules that never flush: each ``run`` plays one step of
    the run (``run_step``), given the micro-batches of the steps after it that it starts
    (``upcoming``, as many as ``lookahead``, fewer before a flush: an evaluation, a checkpoint,
    the end); what crosses into the next step is carried."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        spec = SCHEDULE_REGISTRY[self.schedule.name]
        pp, m = self.schedule.pp, self.schedule.microbatches
        self.lookahead = steps_ahead(pp, m)
        self.versions = {s: WeightVersions(module, int(spec.delay(s, pp))) for s, module in self.stages.items()}
        self.behind = 0  # steps since the last flush (up to lookahead)
        self.carried_forwards: dict[tuple[int, int], object] = {}  # (micro-batch, stage) → Forwarded, next step's
        self.carried_sends: list = []  # sends the receiver takes in its next step
        self.used: dict[tuple[int, int], int] = {}  # (micro-batch, stage) → the version its forward used
        self.releases = {}  # sends are waited for at the end of the step (or the next, when they cross)
        self.step_actions = self.schedule.actions  # every rank's actions of the step played last
        self.pre_posted: dict[int, list] = {}  # peer → receives posted for the next step's first messages

    def run(self, micro_batches, activation_shape, activation_dtype=torch.float32, positions=None, upcoming=()):
        """One step: returns the sum of this step's micro-batches' losses and its timeline."""
        m = self.schedule.microbatches
        if len(micro_batches) != m or any(len(later) != m for later in upcoming):
            raise ValueError(f"the schedule has {plural(m, 'micro-batch')} per step")
        ahead = min(len(upcoming), self.lookahead)
        window: RunStep = run_step(self.schedule.name, self.schedule.pp, m, self.behind, ahead)
        self.step_actions, self.actions = window.actions, window.actions[self.rank]
        self.last_backward = {a.stage: i for i, a in enumerate(self.actions) if a.kind is Kind.BACKWARD}
        everything = list(micro_batches) + [mb for later in upcoming[:ahead] for mb in later]
        message_shape = self.wire.message_shape(activation_shape)
        self.step = StepState(everything, token_positions(micro_batches[0][0], positions), activation_shape,
                              lambda: torch.empty(message_shape, dtype=activation_dtype, device=self.device),
                              loss_sum=torch.zeros((), device=self.device))
        self.step.forwarded.update(self.carried_forwards)
        self.step.left_to_post = {}
        for action in self.actions:
            if action.kind.is_recv:
                self.step.left_to_post[action.peer] = self.step.left_to_post.get(action.peer, 0) + 1
        for peer in self.step.left_to_post:
            self.step.posted[peer] = deque(self.pre_posted.pop(peer, ()))
            self.step.left_to_post[peer] -= len(self.step.posted[peer])
            if not self.step.posted[peer]:
                self._post_receive(peer)
        timeline = self._play()
        crossing = window.crossing[self.rank]
        for index, pending in self.step.sends.items():
            if index not in crossing:
                pending.wait()
        for pending in self.carried_sends:  # sent last step; their receiver has taken them this step
            pending.wait()
        self.carried_sends = [self.step.sends[i] for i in sorted(crossing)]
        self.step.sends.clear()
        # What the previous rank sent us for the next step is received into receives posted now, so
        # that any other message between us (the tied embedding's gradient) cannot take its place.
        for peer, actions in enumerate(window.actions):
            count = sum(1 for i in window.crossing[peer] if actions[i].peer == self.rank)
            for _ in range(count):
                buffer = self.step.new_buffer()
                self.pre_posted.setdefault(peer, []).append((self.comm.recv(buffer, self.axis, peer), buffer))
        self.carried_forwards = {(mb - m, stage): f for (mb, stage), f in self.step.forwarded.items() if mb >= m}
        self.used = {(mb - m, stage): v for (mb, stage), v in self.used.items() if mb >= m}
        self.step.forwarded = {k: f for k, f in self.step.forwarded.items() if k[0] < m}
        step, self.step = self.step, None
        if step.unfinished():
            raise RuntimeError(f"pipeline rank {self.rank}: the step left {', '.join(step.unfinished())} unused")
        self.behind = min(self.behind + 1, self.lookahead) if ahead else 0
        return step.loss_sum, timeline

    def _forward(self, microbatch: int, stage: int) -> None:
        versions = self.versions[stage]
        version = versions.version_for(microbatch // self.schedule.microbatches)
        self.used[microbatch, stage] = version
        with versions.using(version):
            super()._forward(microbatch, stage)

    def _backward(self, microbatch: int, stage: int) -> None:
        with self.versions[stage].using(self.used.pop((microbatch, stage))):
            super()._backward(microbatch, stage)

    def after_optimizer_step(self) -> None:
        for versions in self.versions.values():
            versions.after_update()

    def resume_at(self, updates: int) -> None:
        """Before a checkpoint saved after ``updates`` optimizer steps is loaded (WeightVersions.resume_at)."""
        for versions in self.versions.values():
            versions.resume_at(updates)

    def version_shards(self, named: dict[int, list[tuple[str, nn.Parameter]]],
                       placements: dict[str, Placement]) -> list[Shard]:
        """The checkpoint's pieces of each stage's older weight versions, "version<j>/<key>" (j
        updates older than the newest), placed as the live parameter of plain-model key <key>
        is; ``named``: stage → its (key, parameter) pairs. Views: a save reads from them, a load
        writes into them."""
        found = []
        for stage, versions in self.versions.items():
            key_of = {id(q): key for key, q in named[stage]}
            for older, tensors in sorted(versions.older().items()):
                for q, tensor in zip(versions.params, tensors):
                    key = key_of[id(q)]
                    found += whole_shards(f"version{older}/{key}", tensor, placements[key])
        return found

    def weight_version_bytes(self) -> dict[int, int]:
        """Bytes of the stored weight versions, per stage of this rank."""
        return {stage: versions.nbytes() for stage, versions in self.versions.items()}

    def discard_carried(self) -> None:
        """Stop mid-run (SIGTERM): take the messages in flight to this rank, wait for this rank's,
        and drop the graphs of forwards whose step will not run."""
        for receives in self.pre_posted.values():
            for pending, _ in receives:
                pending.wait()
        for pending in self.carried_sends:
            pending.wait()
        self.pre_posted, self.carried_sends, self.carried_forwards, self.used, self.behind = {}, [], {}, {}, 0
