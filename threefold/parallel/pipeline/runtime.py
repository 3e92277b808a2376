"""Run one pipeline rank's actions, as the schedule lists them (schedule.py), and time each one.

The runtime interprets the schedule; it never decides an order itself. For each action:

  RECV_ACT   wait for the stage's input activation; it becomes a leaf that requires grad, so
             the backward ends with its gradient.
  FORWARD    run the stage on that input (on the first stage: on the embedded tokens); the last
             stage also computes the loss, divided by the number of micro-batches so that the
             accumulated gradients are those of the mean loss over the whole batch.
  SEND_ACT   post the output to the next stage's rank and drop it: only the autograd graph is
             kept, through the output's ``GradientEdge``, so no tensor of the output's size stays
             alive once the send has completed (Megatron's ``deallocate_output_tensor``, without
             having to fake the tensor's data).
  RECV_GRAD  wait for the gradient of the stage's output.
  BACKWARD   full backward (parameters' gradients accumulate in ``.grad``), or, in a schedule
             that splits the backward (ZB-H1), the input gradient only (see below).
  WEIGHT_GRAD the deferred weight gradients of a split backward.
  SEND_GRAD  post the input's gradient to the previous stage's rank.

Where two consecutive stages live on the same rank (DualPipeV's turn of the V) the schedule has
no send or receive between them: FORWARD takes the previous stage's output from memory, and
BACKWARD the next stage's input gradient.

Point-to-point traffic goes through ``Comm.send``/``Comm.recv`` on the mesh's pp axis. Sends
are asynchronous, as the schedule's contract requires. A send is waited for (which releases
its tensor) as soon as the schedule proves it complete: gloo and NCCL complete a send only
once the receiver has taken it, and when a message from that peer arrives which the peer sent
after receiving ours, ours is done. Receives are posted one ahead on each channel, so a
transfer overlaps the compute before it; the RECV action waits for it.

Splitting the backward (Qi et al. 2023). B must produce the input gradient now and leave the
weight gradients for W. B runs ``torch.autograd.grad`` with respect to the stage's input only,
keeping the graph: autograd then skips every weight-gradient product. On the way it captures
the gradient arriving at each graph node where a weight joins the input's path (the matmul of
each linear layer, the product of each norm): W restarts autograd from those nodes with the
captured gradients, towards the weights only (the graph's leaves other than the input: the
parameters, or the weights ZeRO-3 installs as leaves), so it computes exactly the weight-gradient
products B skipped and nothing twice. (``torch.distributed.pipelining`` does the same.) On the
first stage the input is the embedding's output, so the embedding's gradient waits for W too.
Keeping the graph would keep every tensor the forward saved until W, though W reads only those
of the nodes on the weights' paths: each product's input, each norm's normalised input. A split
stage's forward therefore saves through ``SavedForW``, and B releases every other saved tensor
(the attention core's, SwiGLU's, the loss's log-probabilities): between B and W a micro-batch
holds what Megatron's zero-bubble ``WeightGradStore`` holds, the products' inputs and the
gradients B captured.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from threefold.distributed.comm import Comm, Pending
from threefold.parallel.pipeline.schedule import Action, Kind, Schedule
from threefold.words import plural


@dataclass(frozen=True)
class MeasuredAction:
    """One executed action: ``time.perf_counter()`` seconds at its start and end."""
    start: float
    end: float
    kind: Kind
    microbatch: int
    stage: int


# --------------------------------------------------------------------------------------------
# Splitting the backward into input gradient (B) and weight gradient (W)

@dataclass(eq=False)  # groups are told apart by identity (== would compare their tensors)
class WeightGradGroup:
    """Weights (the graph's leaves: parameters, or ZeRO-3's installed leaves) whose gradients W
    computes together from the same graph nodes."""
    params: list[torch.Tensor]
    nodes: list[Node]  # where their weights join the input's path
    path: set[Node] = field(default_factory=set)  # every node W runs: from those joins to the weights
    grads: dict[Node, tuple] = field(default_factory=dict)  # gradients B saw arriving at those nodes


def weight_grad_groups(output: GradientEdge, input_node: Node) -> tuple[list[WeightGradGroup], set[Node]]:
    """Group the leaves of the graph from ``output`` (the weights: parameters, or under ZeRO-3
    the leaves its units install) by the nodes where their gradient path joins the path back to
    ``input_node``; leaves that share such a node (or are linked through one) share a group, since
    W must run them in one autograd call. A group's nodes keep the order of a breadth-first walk
    from the output, and the groups the order a whole backward would run them in, the last
    product first (by autograd's sequence numbers): the same on every rank, so tensor-parallel
    ranks run W's collectives (if a node has any) in the same order, and block by block, so a
    block's gradients are complete (for its bucket, or its ZeRO-3 unit) before the next block's
    start. Also returns the input's path: the nodes B runs."""
    consumers: dict[Node, list[Node]] = defaultdict(list)  # node → the nodes whose backward feeds it
    queue, seen = deque([output.node]), {output.node: 0}  # node → its position in the walk
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                consumers[child].append(node)
                if child not in seen:
                    seen[child] = len(seen)
                    queue.append(child)
    input_path = _upstream({input_node}, consumers, stop=set())
    group_of: dict[Node, WeightGradGroup] = {}
    groups: list[WeightGradGroup] = []
    for accumulator in seen:  # in the walk's order
        if not isinstance(accumulator, _ACCUMULATE_GRAD) or accumulator is input_node:
            continue
        path = _upstream({accumulator}, consumers, stop=input_path)
        joins = path & input_path
        merged = {id(group_of[n]): group_of[n] for n in joins if n in group_of}
        group = WeightGradGroup([accumulator.variable], sorted(joins, key=seen.get), path)
        for other in merged.values():
            group.params += other.params
            group.nodes = sorted(set(group.nodes) | set(other.nodes), key=seen.get)
            group.path |= other.path
            groups.remove(other)
        groups.append(group)
        for node in group.nodes:
            group_of[node] = group
    groups.sort(key=lambda group: -max(node._sequence_nr() for node in group.nodes))
    return groups, input_path


_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros(1, requires_grad=True)).node)  # a leaf's node


def _upstream(start: set[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> set[Node]:
    """``start`` and every node whose backward feeds into it, not going past ``stop`` nodes
    (which are included when reached)."""
    found, queue = set(start), deque(start)
    while queue:
        for consumer in consumers[queue.popleft()]:
            if consumer not in found:
                found.add(consumer)
                if consumer not in stop:
                    queue.append(consumer)
    return found


class _Held:
    """One tensor a split stage's forward saved (as the hooks outside packed it), until released."""
    __slots__ = ("packed",)

    def __init__(self, packed):
        self.packed = packed


_RELEASED = object()


class SavedForW:
    """The tensors one micro-batch's forward saves on a stage whose backward is split, held so
    that B can release those W will not read. ``hooks()`` wraps the forward, inside whatever
    saved-tensor hooks are already on (the activation meter's), whose packing it keeps: a
    released tensor leaves the meter as it leaves memory."""

    def __init__(self):
        self.held: list[_Held] = []

    def hooks(self):
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None:  # a PyTorch without the accessor: these hooks would hide the meter's, so none
            return contextlib.nullcontext()  # (W's nodes then hold tensors not packed here: nothing released)
        outer = top(False)  # the innermost hooks in force (PyTorch's private accessor, as torch._functorch's)
        pack_outer, unpack_outer = outer if outer is not None else (None, None)

        def pack(tensor):
            held = _Held(tensor if pack_outer is None else pack_outer(tensor))
            self.held.append(held)
            return held

        def unpack(held):
            if held.packed is _RELEASED:
                raise RuntimeError("a tensor B released was read again: W's path reads a saved tensor "
                                   "outside the nodes weight_grad_groups found")
            return held.packed if unpack_outer is None else unpack_outer(held.packed)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def release_in_backward(self, b_nodes: set[Node], w_nodes: set[Node]) -> list:
        """Hooks that release, as each node of ``b_nodes`` finishes in B, the tensors it saved
        that no node of ``w_nodes`` saved, as autograd frees a node's when it keeps no graph; the
        handles, to remove once B is done. No hooks, and nothing released at all, if a node of
        ``w_nodes`` holds a tensor packed by other hooks (an activation checkpoint's, whose
        recomputation would read inputs saved here)."""
        kept = set()
        for node in w_nodes:
            for saved in _raw_saved(node):
                if not isinstance(saved.data, _Held):
                    self.held = []
                    return []
                kept.add(id(saved.data))
        self.held = [held for held in self.held if id(held) not in kept]  # released after B at the latest
        handles = []
        for node in b_nodes - w_nodes:
            mine = [saved.data for saved in _raw_saved(node)
                    if isinstance(saved.data, _Held) and id(saved.data) not in kept]
            if mine:
                handles.append(node.register_hook(lambda grad_inputs, grad_outputs, mine=mine: _release(mine)))
        return handles

    def release(self) -> None:
        """Release what B has not (the tensors of nodes B did not run)."""
        _release(self.held)
        self.held = []


def _release(held: list[_Held]) -> None:
    for item in held:
        item.packed = _RELEASED


_RAW_SAVED_NAMES: dict[type, tuple[str, ...]] = {}  # a node class's ``_raw_saved_*`` attributes


def _raw_saved(node: Node):
    """The node's saved tensors, unread: ``SavedTensor``s whose ``data`` is what was packed."""
    names = _RAW_SAVED_NAMES.get(type(node))
    if names is None:  # dir() once per class: a stage's graph has hundreds of nodes of a few dozen
        names = _RAW_SAVED_NAMES[type(node)] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    for name in names:
        value = getattr(node, name)
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            if saved is not None:
                yield saved


def backward_input(output: GradientEdge, grad: torch.Tensor, inputs: torch.Tensor,
                   saves: SavedForW | None = None) -> tuple[torch.Tensor, list[WeightGradGroup]]:
    """B: the gradient of ``inputs``, keeping the graph, and what W needs for the weights;
    given the forward's ``saves``, each saved tensor W will not read is released once the node
    that saved it has run."""
    input_edge = get_gradient_edge(inputs)
    groups, input_path = weight_grad_groups(output, input_edge.node)
    captured: dict[Node, tuple] = {}
    hooks = [node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
             for group in groups for node in group.nodes if node is not input_edge.node]
    if saves is not None:
        hooks += saves.release_in_backward(input_path, set().union(*(group.path for group in groups)))
    try:
        (input_grad,) = torch.autograd.grad(output, inputs, grad, retain_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
        if saves is not None:
            saves.release()
    # The input's own node is not run by B (autograd stops at the input); its gradient is B's result.
    captured[input_edge.node] = tuple(input_grad if i == input_edge.output_nr else None
                                      for i in range(len(input_edge.node._input_metadata)))
    for group in groups:
        group.grads = {node: captured[node] for node in group.nodes}
    return input_grad, groups


def backward_weight(groups: list[WeightGradGroup]) -> None:
    """W: accumulate into ``.grad`` the weight gradients of the groups B prepared."""
    for group in groups:
        edges, grads = [], []
        for node in group.nodes:
            for i, grad in enumerate(group.grads[node]):
                if grad is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(grad)
        # With several nodes in a group, one can lie upstream of another; pin every node's
        # incoming gradient to what B saw, so nothing flows in twice.
        pins = [node.register_prehook(lambda _, saved=group.grads[node]: saved)
                for node in group.nodes] if len(group.nodes) > 1 else []
        try:
            torch.autograd.backward(edges, grads, inputs=group.params)
        finally:
            for pin in pins:
                pin.remove()


# --------------------------------------------------------------------------------------------
# The runtime

class Wire:
    """How an activation, or its gradient, crosses a stage boundary: as it is."""

    def message_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def unpack(self, message: torch.Tensor, shape: tuple[int, ...], tag: str | None = None) -> torch.Tensor:
        return message


class ScatterGather(Wire):
    """Megatron's scatter/gather, for tensor parallelism without sequence parallelism: what
    crosses the boundary is the same on every tp rank, so each sends only its 1/tp of the flat
    tensor and the receiving tp ranks all-gather the pieces (tag "scatter_gather"). The pp
    traffic is divided by tp; the all-gather runs over the fast tp links instead."""

    def __init__(self, comm: Comm, tp_size: int, tp_rank: int, axis: str = "tp"):
        self.comm, self.size, self.rank, self.axis = comm, tp_size, tp_rank, axis

    def message_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(shape) // self.size,)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).chunk(self.size)[self.rank]

    def unpack(self, message: torch.Tensor, shape: tuple[int, ...], tag: str | None = "scatter_gather") -> torch.Tensor:
        full = torch.empty(math.prod(shape), dtype=message.dtype, device=message.device)
        self.comm.all_gather(full, message, self.axis, tag=tag)
        return full.view(shape)


@dataclass
class Forwarded:
    """What a stage's backward needs of one micro-batch's forward."""
    input: torch.Tensor  # the received activation (a leaf), or on the first stage the embedding's output
    output: GradientEdge  # where the backward starts: the stage's output, or the scaled loss
    saves: SavedForW | None = None  # under a split backward: what the forward saved, for B to release


@dataclass
class StepState:
    """What one step's actions hand to each other. Keyed by (micro-batch, stage), each entry is
    set by one action and taken by a later one; all are empty again when the step ends."""
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor | range  # of the micro-batches' tokens in their sequences (the same for all)
    shape: tuple[int, ...]  # of an activation and of its gradient, as a stage sees them
    new_buffer: Callable[[], torch.Tensor]  # a tensor to receive a message (the wire's shape) into
    received: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # RECV_ACT → FORWARD
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # FORWARD → SEND_ACT
    forwarded: dict[tuple[int, int], Forwarded] = field(default_factory=dict)  # FORWARD → BACKWARD
    output_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # RECV_GRAD → BACKWARD
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # BACKWARD → SEND_GRAD
    weight_grads: dict[tuple[int, int], list[WeightGradGroup]] = field(default_factory=dict)  # B → W
    sends: dict[int, Pending] = field(default_factory=dict)  # action index → send in flight
    posted: dict[int, deque] = field(default_factory=dict)  # peer → receives posted ahead, in order
    left_to_post: dict[int, int] = field(default_factory=dict)  # peer → receives not posted yet
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros(()))

    def unfinished(self) -> list[str]:
        names = ("received", "outputs", "forwarded", "output_grads", "input_grads", "weight_grads", "sends")
        return [name for name in names if getattr(self, name)]


class PipelineRuntime:
    """Executes rank ``rank``'s actions of ``schedule`` on its ``stages`` (stage index → module).

    A stage module has ``first`` and ``last`` flags, ``embed(tokens)`` on the first stage, and
    ``forward(hidden, positions)`` returning the next hidden state, or the logits on the last
    stage (``positions``: the micro-batch's token positions, for the rotary tables).
    ``loss_fn(logits, targets)`` is the mean loss of a micro-batch; ``compute_context()`` wraps
    each forward (the activation meter and autocast); ``axis`` is the mesh axis of the pipeline;
    ``wire`` says what crosses a stage boundary (``ScatterGather`` under tp without SP).
    ``before_last_backward(stage)`` is called just before the action that produces the stage's
    last weight gradients of the step (its last B, or its last W when the backward is split),
    so gradient synchronisation can reduce each bucket as soon as it is complete.
    """

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, nn.Module], comm: Comm,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 compute_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 axis: str = "pp", wire: Wire | None = None,
                 before_last_backward: Callable[[int], None] = lambda stage: None):
        if set(stages) != set(schedule.stages_of(rank)):
            raise ValueError(f"rank {rank} runs stages {list(schedule.stages_of(rank))}, "
                             f"got modules for {sorted(stages)}")
        self.schedule, self.rank, self.stages, self.comm, self.axis = schedule, rank, stages, comm, axis
        self.device = comm.mesh.device  # where this rank computes: its buffers and its loss live there
        self.wire = wire or Wire()
        self.actions = schedule.actions[rank]
        self.loss_fn, self.compute_context = loss_fn, compute_context
        self.releases = send_release_points(schedule, rank)
        self.before_last_backward = before_last_backward
        weight_kind = Kind.WEIGHT_GRAD if schedule.split_backward else Kind.BACKWARD
        self.last_backward = {a.stage: i for i, a in enumerate(self.actions) if a.kind is weight_kind}
        self.receives_from: dict[int, int] = defaultdict(int)  # peer → how many receives from it
        for action in self.actions:
            if action.kind.is_recv:
                self.receives_from[action.peer] += 1
        self.step: StepState | None = None

    # --- one step -----------------------------------------------------------------------------
    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], activation_shape: tuple[int, ...],
            activation_dtype: torch.dtype = torch.float32,
            positions: torch.Tensor | range | None = None) -> tuple[torch.Tensor, list[MeasuredAction]]:
        """Execute the schedule on this step's micro-batches (inputs, targets) of tokens at
        ``positions`` (None: 0, 1, …; a context-parallel rank's are its split's). Returns the sum
        of the micro-batches' losses (non-zero on the last stage's rank only) and the timeline."""
        if len(micro_batches) != self.schedule.microbatches:
            raise ValueError(f"the schedule has {plural(self.schedule.microbatches, 'micro-batch')}, "
                             f"the step brought {len(micro_batches)}")
        message_shape = self.wire.message_shape(activation_shape)
        self.step = StepState(micro_batches, token_positions(micro_batches[0][0], positions), activation_shape,
                              lambda: torch.empty(message_shape, dtype=activation_dtype, device=self.device),
                              loss_sum=torch.zeros((), device=self.device))
        self.step.left_to_post = dict(self.receives_from)
        for peer in self.receives_from:
            self.step.posted[peer] = deque()
            self._post_receive(peer)
        timeline = self._play()
        for pending in self.step.sends.values():
            pending.wait()
        self.step.sends.clear()
        step, self.step = self.step, None
        if step.unfinished():
            raise RuntimeError(f"pipeline rank {self.rank}: the schedule left {', '.join(step.unfinished())} unused")
        return step.loss_sum, timeline

    def _play(self) -> list[MeasuredAction]:
        """Execute this rank's actions of the step in order, timing each."""
        timeline = []
        for index, action in enumerate(self.actions):
            if self.last_backward.get(action.stage) == index:
                self.before_last_backward(action.stage)
            start = time.perf_counter()
            self._execute(index, action)
            timeline.append(MeasuredAction(start, time.perf_counter(), action.kind, action.microbatch, action.stage))
        return timeline

    def _execute(self, index: int, action: Action) -> None:
        step, key, kind = self.step, (action.microbatch, action.stage), action.kind
        if kind is Kind.FORWARD:
            self._forward(*key)
        elif kind is Kind.BACKWARD:
            self._backward(*key)
        elif kind is Kind.WEIGHT_GRAD:
            backward_weight(step.weight_grads.pop(key))
        elif kind is Kind.SEND_ACT:
            # Dropping our reference leaves the send's the only one: the tensor goes when it completes.
            step.sends[index] = self.comm.send(self.wire.pack(step.outputs.pop(key)), self.axis, action.peer)
        elif kind is Kind.SEND_GRAD:
            step.sends[index] = self.comm.send(self.wire.pack(step.input_grads.pop(key)), self.axis, action.peer)
        else:
            received = self.wire.unpack(self._receive(action.peer), step.shape)
            (step.received if kind is Kind.RECV_ACT else step.output_grads)[key] = received
            for done in self.releases.get(index, ()):
                step.sends.pop(done).wait()  # already complete: this frees its tensor

    def _forward(self, microbatch: int, stage: int) -> None:
        step, module = self.step, self.stages[stage]
        tokens, targets = step.micro_batches[microbatch]
        saves = SavedForW() if self.schedule.split_backward else None
        with self.compute_context(), (saves.hooks() if saves else contextlib.nullcontext()):
            if module.first:
                inputs = module.embed(tokens)
            elif self.schedule.hands_over_locally(stage):  # the previous stage ran here: its output, in memory
                inputs = step.outputs.pop((microbatch, stage - 1)).requires_grad_()
            else:
                inputs = step.received.pop((microbatch, stage)).requires_grad_()
            output = module(inputs, step.positions)
            if module.last:
                loss = self.loss_fn(output, targets)
        if module.last:
            step.loss_sum += loss.detach().float()
            output = loss / self.schedule.microbatches  # the gradient of the mean over micro-batches
        else:
            step.outputs[(microbatch, stage)] = output.detach()
        step.forwarded[(microbatch, stage)] = Forwarded(inputs, get_gradient_edge(output), saves)

    def _backward(self, microbatch: int, stage: int) -> None:
        step, key = self.step, (microbatch, stage)
        forwarded, module = step.forwarded.pop(key), self.stages[stage]
        if module.last:
            grad = torch.ones((), device=self.device)
        elif self.schedule.hands_over_locally(stage + 1):  # the next stage's backward ran here
            grad = step.input_grads.pop((microbatch, stage + 1))
        else:
            grad = step.output_grads.pop(key)
        if self.schedule.split_backward:
            input_grad, step.weight_grads[key] = backward_input(forwarded.output, grad, forwarded.input,
                                                                forwarded.saves)
        else:
            torch.autograd.backward(forwarded.output, grad)
            input_grad = None if module.first else forwarded.input.grad  # the received input is a leaf
        if not module.first:
            step.input_grads[key] = input_grad

    def _receive(self, peer: int) -> torch.Tensor:
        pending, tensor = self.step.posted[peer].popleft()
        pending.wait()
        self._post_receive(peer)
        return tensor

    def _post_receive(self, peer: int) -> None:
        """Keep the next receive from ``peer`` posted, so its transfer overlaps our compute."""
        if self.step.left_to_post[peer]:
            self.step.left_to_post[peer] -= 1
            tensor = self.step.new_buffer()
            self.step.posted[peer].append((self.comm.recv(tensor, self.axis, peer), tensor))

    # --- forward only (evaluation) --------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, batches: list[tuple[torch.Tensor, torch.Tensor]], activation_shape: tuple[int, ...],
                     activation_dtype: torch.dtype = torch.float32, tag: str = "eval",
                     positions: torch.Tensor | range | None = None) -> torch.Tensor:
        """Losses of ``batches`` (on the last stage's rank; zeros elsewhere), each batch passing
        through this rank's stages in order; p2p tagged ``tag``. Returns a (len(batches),) tensor."""
        losses = torch.zeros(len(batches), dtype=torch.float64, device=self.device)
        positions = token_positions(batches[0][0], positions)
        sends, previous = [], []
        for i, (tokens, targets) in enumerate(batches):
            for stage, module in sorted(self.stages.items()):
                with self.compute_context():
                    if module.first:
                        hidden = module.embed(tokens)
                    elif self.schedule.hands_over_locally(stage):
                        hidden = output  # the previous stage's, computed just before on this rank
                    else:
                        message = torch.empty(self.wire.message_shape(activation_shape), dtype=activation_dtype,
                                              device=self.device)
                        self.comm.recv(message, self.axis, self.schedule.rank_of(stage - 1), tag=tag).wait()
                        hidden = self.wire.unpack(message, activation_shape, tag=tag)
                    output = module(hidden, positions)
                if module.last:
                    losses[i] = self.loss_fn(output, targets).double()
                elif not self.schedule.hands_over_locally(stage + 1):
                    sends.append(self.comm.send(self.wire.pack(output), self.axis, self.schedule.rank_of(stage + 1),
                                                tag=tag))
            for pending in previous:  # taken by now: each batch's messages are freed one batch later
                pending.wait()
            previous, sends = sends, []
        for pending in previous:
            pending.wait()
        return losses


def token_positions(tokens: torch.Tensor, positions: torch.Tensor | range | None) -> torch.Tensor | range:
    """``positions``, or the tokens' own 0, 1, … (a range) when none are given."""
    return range(tokens.shape[1]) if positions is None else positions


def send_release_points(schedule: Schedule, rank: int) -> dict[int, list[int]]:
    """For each receive of ``rank`` (index into its actions), its sends (indices) that have
    certainly completed once that receive has: the peer sent what we receive after it had
    received those sends, and a receive returns only once its data has arrived."""
    actions = schedule.actions
    release: dict[int, list[int]] = defaultdict(list)
    for peer in {a.peer for a in actions[rank] if a.peer is not None}:
        our_sends = [i for i, a in enumerate(actions[rank]) if a.kind.is_send and a.peer == peer]
        our_receives = [i for i, a in enumerate(actions[rank]) if a.kind.is_recv and a.peer == peer]
        their_receives = [i for i, a in enumerate(actions[peer]) if a.kind.is_recv and a.peer == rank]
        their_sends = [i for i, a in enumerate(actions[peer]) if a.kind.is_send and a.peer == rank]
        done = 0  # our sends to this peer proven complete so far (messages match in order)
        for ours, theirs in zip(our_receives, their_sends):
            while done < len(our_sends) and their_receives[done] < theirs:
                release[ours].append(our_sends[done])
                done += 1
    return dict(release)
