"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs
in one optimizer step. The runtime executes these lists; the planner's simulator plays them on
a cost model; the timeline drawer draws them. Nothing here touches torch.

The registry (``SCHEDULE_REGISTRY``, at the end) is the one place that knows each schedule: its
order of compute actions, how its stages are placed on ranks, its constraints, and its closed
forms (bubble fraction and micro-batches in flight on the first and last pipeline rank, written
with numpy so that the planner evaluates them over arrays of layouts). A new schedule is one
entry there; config validation, the runtime, the simulator, the planner and the CLI read it.

Stages. The model is cut into ``pp · virtual_stages`` consecutive stages. Stage ``s`` lives on
rank ``s % pp`` as that rank's model chunk ``s // pp`` (Megatron's looping placement), so with
one virtual stage, stage and rank coincide; DualPipeV places its 2·pp stages in a V instead
(``VShape``), where two consecutive stages share rank pp − 1 and hand over in memory, with no
send or receive between them (``Schedule.hands_over_locally``). The first stage reads the
micro-batch's tokens; the last stage's forward ends with the loss, so its backward needs no
received gradient.

Actions. ``FORWARD``, ``BACKWARD`` and ``WEIGHT_GRAD`` compute; the four p2p kinds move one
tensor between neighbouring stages. ``stage`` is always a stage that lives on the acting rank:
the stage whose output (``SEND_ACT``) or input gradient (``SEND_GRAD``) is sent, or the stage
that consumes what is received (``RECV_ACT``: its input; ``RECV_GRAD``: its output's gradient).
``peer`` is the other rank. In a schedule that splits the backward (``split_backward``, ZB-H1),
``BACKWARD`` computes the input gradient only and ``WEIGHT_GRAD`` later the weight gradient;
otherwise ``BACKWARD`` is the full backward and there is no ``WEIGHT_GRAD``.

The contract with a runtime, which ``validate`` checks:
- a send is posted asynchronously (``isend``) and never blocks the rank; the runtime waits for
  its own sends before the step ends;
- a receive blocks until its tensor has arrived;
- between an ordered pair of ranks, messages are matched in order whatever their kind, as NCCL
  and gloo do with a single tag, so no tags are needed.
"""
from __future__ import annotations

import enum
from collections import defaultdict, deque
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Callable, Iterator

import numpy as np

from threefold.config import ConfigError, ModelConfig
from threefold.models.sizes import attention_width, block_param_count
from threefold.words import plural


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward, or input gradient only when the schedule splits the backward
    WEIGHT_GRAD = "W"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    kind: Kind
    microbatch: int
    stage: int
    peer: int | None = None  # the other rank of a send or receive

    def __str__(self) -> str:
        if self.kind.is_compute:
            return f"{self.kind.value}{self.microbatch}@s{self.stage}"
        arrow = "->" if self.kind.is_send else "<-"
        return f"{self.kind.value}{self.microbatch}@s{self.stage}{arrow}r{self.peer}"


class ScheduleError(ValueError):
    """A schedule breaks a rule a runtime relies on; the message names the rank and the action."""


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action, ...], ...]  # per rank, in execution order

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    def rank_of(self, stage: int) -> int:
        return SCHEDULE_REGISTRY[self.name].placement.rank_of(stage, self.pp)

    def stages_of(self, rank: int) -> range:
        return SCHEDULE_REGISTRY[self.name].placement.stages_of(rank, self.pp, self.virtual_stages)

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's model chunks a stage is (0 unless interleaved)."""
        return SCHEDULE_REGISTRY[self.name].placement.chunk_of(stage, self.pp)

    def hands_over_locally(self, stage: int) -> bool:
        """True when ``stage`` takes its input from stage − 1 on its own rank (DualPipeV's turn of
        the V): the activation and its gradient pass in memory, with no send or receive."""
        return 0 < stage < self.num_stages and self.rank_of(stage - 1) == self.rank_of(stage)

    @cached_property
    def split_backward(self) -> bool:
        """True when BACKWARD is the input gradient only and WEIGHT_GRAD follows separately."""
        return any(a.kind is Kind.WEIGHT_GRAD for rank_actions in self.actions for a in rank_actions)

    def __str__(self) -> str:
        lines = [f"{self.name}: pp={self.pp} microbatches={self.microbatches} virtual_stages={self.virtual_stages}"]
        lines += [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions)]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Building: each schedule is first an order of compute actions per rank; `_with_p2p` then adds
# the sends and receives that every schedule needs in the same way.

def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The per-rank actions of schedule ``name`` for ``pp`` ranks and ``microbatches`` micro-batches."""
    spec = check_schedule(name, pp, microbatches, virtual_stages)
    virtual_stages = stages_per_rank(name, virtual_stages)
    compute = [spec.compute_order(rank, pp, microbatches, virtual_stages) for rank in range(pp)]
    return Schedule(name, pp, microbatches, virtual_stages,
                    _with_p2p(compute, pp, virtual_stages, spec.placement.rank_of))


def _forward(mb: int, stage: int) -> Action:
    return Action(Kind.FORWARD, mb, stage)


def _backward(mb: int, stage: int) -> Action:
    return Action(Kind.BACKWARD, mb, stage)


def _gpipe_order(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """All forwards, then all backwards: every rank holds all m micro-batches' activations."""
    return [_forward(mb, rank) for mb in range(m)] + [_backward(mb, rank) for mb in range(m)]


def _one_f_one_b_order(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """PipeDream-Flush / Megatron 1F1B: ``pp - rank - 1`` warm-up forwards, then alternate one
    forward and one backward, then drain the backwards. Rank r holds at most pp - r micro-batches."""
    warmup = min(pp - rank - 1, m)
    order = [_forward(mb, rank) for mb in range(warmup)]
    for mb in range(m - warmup):
        order += [_forward(warmup + mb, rank), _backward(mb, rank)]
    order += [_backward(mb, rank) for mb in range(m - warmup, m)]
    return order


def _zb_h1_order(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order of F and B (B now the input gradient only), with
    rank r deferring its weight gradients by r micro-batches. The backward wave then carries
    only B on its critical path, and the deferred W fill the drain at the end. Activations
    are kept until W, so rank r holds up to (pp - r) + r = pp micro-batches: 1F1B's peak."""
    weight_grads = deque(Action(Kind.WEIGHT_GRAD, mb, rank) for mb in range(m))
    order = []
    for action in _one_f_one_b_order(rank, pp, m, v):
        order.append(action)
        if action.kind is Kind.BACKWARD and action.microbatch >= rank:
            order.append(weight_grads.popleft())
    return order + list(weight_grads)


def _interleaved_order(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021). Forwards run in groups of
    micro-batches: chunk 0 for the group, then chunk 1, …; backwards likewise with the chunks
    reversed. The warm-up lets the group's first micro-batch reach the last chunk and its
    gradient come back: (v − 1)·group + 2·(pp − rank − 1) forwards.

    Megatron's group is pp micro-batches, which needs microbatches % pp == 0. A group smaller
    than pp stalls each rank while a micro-batch goes round the ring, and unequal groups
    can deadlock; so the group is the smallest divisor of m that is at least pp (m itself
    when m < pp). m = 10, pp = 4 runs in groups of 5 with the ideal bubble; a prime m > pp
    runs as one group, with the ideal bubble but a warm-up, and memory, close to GPipe's."""
    group = interleaved_group(pp, m)
    forward_table = [(mb, chunk * pp + rank) for first in range(0, m, group)
                     for chunk in range(v) for mb in range(first, first + group)]
    backward_table = [(mb, (v - 1 - stage // pp) * pp + rank) for mb, stage in forward_table]

    total = m * v
    warmup = min((v - 1) * group + 2 * (pp - rank - 1), total)
    order = [_forward(*forward_table[k]) for k in range(warmup)]
    for k in range(total - warmup):
        order += [_forward(*forward_table[warmup + k]), _backward(*backward_table[k])]
    order += [_backward(*backward_table[k]) for k in range(total - warmup, total)]
    return order


def _dualpipev_order(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab 2025): 2·pp stages in a V, rank r
    holding stage r on the way down and stage 2·pp − 1 − r on the way up, so rank 0 holds the
    embedding and the head. DeepSeek's eight phases, as their ``DualPipeV.step`` runs them:

      1. 2·(pp − r − 1) forwards down;  2. r + 1 pairs of forwards, down then up;
      3. pp − r − 1 times a backward up and a forward up;
      4. m − 2·pp + r + 1 times forward down, backward up, forward up, backward down (the steady
         state, where DualPipe overlaps each forward with the backward beside it);
      5. pp − r − 1 times backward up, forward up, backward down;
      6. r + 1 pairs of backwards, up then down, the second half with their weight gradients
         deferred (from the pair's first backward on odd ranks, its second on even ones);
      7. pp − r − 1 times a deferred weight gradient and a backward down, deferring its own;
      8. the r + 1 weight gradients still deferred.

    Every backward is split (B then W): a backward that DeepSeek runs whole is B directly
    followed by W, which computes the same and sends the input gradient sooner; the deferred W
    run in the order their B ran. Needs m ≥ 2·pp (phase 4 runs at least once on rank 0)."""
    down, up = rank, 2 * pp - 1 - rank
    forwards, backwards = {down: 0, up: 0}, {down: 0, up: 0}  # stage → its next micro-batch
    deferred: deque[Action] = deque()
    order: list[Action] = []

    def forward(stage: int) -> None:
        order.append(_forward(forwards[stage], stage))
        forwards[stage] += 1

    def backward(stage: int, defer: bool = False) -> None:
        mb = backwards[stage]
        backwards[stage] += 1
        order.append(_backward(mb, stage))
        (deferred.append if defer else order.append)(Action(Kind.WEIGHT_GRAD, mb, stage))

    def weight_grad() -> None:
        order.append(deferred.popleft())

    for _ in range(2 * (pp - rank - 1)):
        forward(down)
    for _ in range(rank + 1):
        forward(down)
        forward(up)
    for _ in range(pp - rank - 1):
        backward(up)
        forward(up)
    for _ in range(m - 2 * pp + rank + 1):
        forward(down)
        backward(up)
        forward(up)
        backward(down)
    for _ in range(pp - rank - 1):
        backward(up)
        forward(up)
        backward(down)
    half = (rank + 1) // 2
    for i in range(rank + 1):
        backward(up, defer=i > half or (i == half and rank % 2 == 1))
        backward(down, defer=i >= half)
    for _ in range(pp - rank - 1):
        weight_grad()
        backward(down, defer=True)
    while deferred:
        weight_grad()
    return order


def _with_p2p(compute: list[list[Action]], pp: int, v: int,
              rank_of: Callable[[int, int], int]) -> tuple[tuple[Action, ...], ...]:
    """Put each receive just before the compute that consumes it, so a rank blocks only when it
    needs the data, and each send just after the compute that produced its tensor, unless the
    receiver takes an earlier message on the same channel first: then the send waits for that
    message (interleaved with pp = 2 sends activations and gradients on one channel). A send
    held back only waits for a message its receiver needs first, so it costs no time."""
    last = pp * v - 1

    def crosses(stage: int) -> bool:  # the boundary in front of ``stage`` joins two ranks
        return 0 < stage <= last and rank_of(stage - 1, pp) != rank_of(stage, pp)

    naive = []
    for order in compute:
        actions = []
        for action in order:
            mb, stage = action.microbatch, action.stage
            if action.kind is Kind.FORWARD:
                if crosses(stage):
                    actions.append(Action(Kind.RECV_ACT, mb, stage, rank_of(stage - 1, pp)))
                actions.append(action)
                if crosses(stage + 1):
                    actions.append(Action(Kind.SEND_ACT, mb, stage, rank_of(stage + 1, pp)))
            elif action.kind is Kind.BACKWARD:
                if crosses(stage + 1):
                    actions.append(Action(Kind.RECV_GRAD, mb, stage, rank_of(stage + 1, pp)))
                actions.append(action)
                if crosses(stage):
                    actions.append(Action(Kind.SEND_GRAD, mb, stage, rank_of(stage - 1, pp)))
            else:
                actions.append(action)
        naive.append(actions)

    receive_order: dict[tuple[int, int], deque[Action]] = defaultdict(deque)  # (sender, receiver) → sends
    for receiver, actions in enumerate(naive):
        for action in actions:
            if action.kind.is_recv:
                receive_order[action.peer, receiver].append(matching_send(action, receiver))
    schedule = []
    for rank, actions in enumerate(naive):
        ordered, held = [], set()
        peers = sorted({a.peer for a in actions if a.peer is not None})
        for action in actions:
            if action.kind.is_send:
                held.add(action)
            else:
                ordered.append(action)
            for peer in peers:
                queue = receive_order[rank, peer]
                while queue and queue[0] in held:
                    held.remove(queue[0])
                    ordered.append(queue.popleft())
        schedule.append(tuple(ordered))
    return tuple(schedule)


def matching_send(recv: Action, receiver: int) -> Action:
    """The send on rank ``recv.peer`` that a receive on ``receiver`` must get."""
    if recv.kind is Kind.RECV_ACT:
        return Action(Kind.SEND_ACT, recv.microbatch, recv.stage - 1, receiver)
    return Action(Kind.SEND_GRAD, recv.microbatch, recv.stage + 1, receiver)


# --------------------------------------------------------------------------------------------
# Playing and validating

@dataclass(frozen=True)
class Step:
    """One action in a causal order of the whole schedule; ``sent_by`` is, for a receive, the
    (rank, index) of the send it matched."""
    rank: int
    index: int
    action: Action
    sent_by: tuple[int, int] | None = None


def play(schedule: Schedule) -> Iterator[Step]:
    """Run all ranks' action lists together under the runtime contract (sends never block,
    receives block, each channel in order), yielding every action once in an order where a
    rank's earlier actions and a receive's matching send come first. Raises ScheduleError
    when a receive would get the wrong message, when the ranks deadlock, or when a message
    is never received."""
    channels: dict[tuple[int, int], deque] = defaultdict(deque)  # (sender, receiver) → sends in flight
    position = [0] * schedule.pp
    while any(position[r] < len(schedule.actions[r]) for r in range(schedule.pp)):
        progressed = False
        for rank, actions in enumerate(schedule.actions):
            while position[rank] < len(actions):
                index, action = position[rank], actions[position[rank]]
                sent_by = None
                if action.kind.is_recv:
                    queue = channels[action.peer, rank]
                    if not queue:
                        break
                    sent_by, sent = queue.popleft()
                    if sent != matching_send(action, rank):
                        raise ScheduleError(f"{schedule.name}: rank {rank} action {index} {action} would receive "
                                            f"{sent} from rank {sent_by[0]}: sends and receives are out of order")
                elif action.kind.is_send:
                    channels[rank, action.peer].append(((rank, index), action))
                position[rank] += 1
                progressed = True
                yield Step(rank, index, action, sent_by)
        if not progressed:
            waiting = "; ".join(f"rank {r} waits at action {position[r]} {schedule.actions[r][position[r]]}"
                                for r in range(schedule.pp) if position[r] < len(schedule.actions[r]))
            raise ScheduleError(f"{schedule.name}: deadlock: {waiting}")
    for (sender, receiver), queue in channels.items():
        if queue:
            raise ScheduleError(f"{schedule.name}: rank {sender} sends {queue[0][1]} to rank {receiver}, "
                                "which never receives it")


def validate(schedule: Schedule) -> None:
    """Check every rule a runtime relies on; raise ScheduleError naming the first broken one.

    Each (micro-batch, stage) has exactly one F and one B (and one W when the backward is split)
    on the stage's rank; every action's stage lives on its rank and every peer is the neighbour
    stage's rank; on each rank F(mb, s) follows the receive of its input, B(mb, s) follows
    F(mb, s) and the receive of its output gradient, W follows B, a send follows the compute
    that produced its tensor; and the whole schedule plays to the end without deadlock, each
    receive matching the send it needs (``play``)."""
    p, last = schedule.pp, schedule.num_stages - 1
    if len(schedule.actions) != p:
        raise ScheduleError(f"{schedule.name}: {plural(len(schedule.actions), 'action list')} for pp={p}")
    compute_count: dict[tuple[Kind, int, int], int] = defaultdict(int)
    for rank, actions in enumerate(schedule.actions):
        done: set[tuple[Kind, int, int]] = set()
        for index, action in enumerate(actions):
            where = f"{schedule.name}: rank {rank} action {index} {action}"
            mb, stage = action.microbatch, action.stage
            if not (0 <= mb < schedule.microbatches and 0 <= stage <= last) or schedule.rank_of(stage) != rank:
                raise ScheduleError(f"{where}: micro-batch or stage out of range, or stage not on this rank")
            needs = _prerequisites(action, last)
            if needs is None:
                raise ScheduleError(f"{where}: the first/last stage has no such neighbour")
            expected_peer = _neighbour_rank(schedule, action)
            if action.peer is not None and expected_peer == rank:
                raise ScheduleError(f"{where}: the neighbour stage is on this rank, which hands over locally")
            if action.peer != expected_peer:
                raise ScheduleError(f"{where}: peer should be rank {expected_peer}")
            required = [_local_source(schedule, (need, mb, stage)) for need in needs]
            missing = [key for key in required if key not in done]
            if missing:
                kind, _, of = missing[0]
                raise ScheduleError(f"{where}: comes before its {kind.name}"
                                    + (f" of stage {of}" if of != stage else "") + " on this rank")
            if (action.kind, mb, stage) in done:
                raise ScheduleError(f"{where}: appears twice")
            done.add((action.kind, mb, stage))
            if action.kind.is_compute:
                compute_count[action.kind, mb, stage] += 1
    kinds = (Kind.FORWARD, Kind.BACKWARD) + ((Kind.WEIGHT_GRAD,) if schedule.split_backward else ())
    for kind in kinds:
        for stage in range(schedule.num_stages):
            for mb in range(schedule.microbatches):
                if compute_count[kind, mb, stage] != 1:
                    raise ScheduleError(f"{schedule.name}: {kind.name} of micro-batch {mb} on stage {stage} "
                                        f"appears {compute_count[kind, mb, stage]} times, not once")
    for _ in play(schedule):
        pass


def _prerequisites(action: Action, last: int) -> tuple[Kind, ...] | None:
    """The kinds of action on the same (micro-batch, stage) that must precede ``action`` on its
    rank, or None when the action cannot exist on this stage (a receive from before the first
    stage, a send past the last)."""
    first_stage, last_stage = action.stage == 0, action.stage == last
    kind = action.kind
    if kind is Kind.FORWARD:
        return () if first_stage else (Kind.RECV_ACT,)
    if kind is Kind.BACKWARD:
        return (Kind.FORWARD,) if last_stage else (Kind.FORWARD, Kind.RECV_GRAD)
    if kind is Kind.WEIGHT_GRAD:
        return (Kind.BACKWARD,)
    if kind is Kind.SEND_ACT:
        return None if last_stage else (Kind.FORWARD,)
    if kind is Kind.SEND_GRAD:
        return None if first_stage else (Kind.BACKWARD,)
    if kind is Kind.RECV_ACT:
        return None if first_stage else ()
    return None if last_stage else ()  # RECV_GRAD


def _local_source(schedule: Schedule, need: tuple[Kind, int, int]) -> tuple[Kind, int, int]:
    """What a prerequisite (kind, micro-batch, stage) is where a stage hands over locally: the
    neighbour stage's FORWARD in place of receiving its activation, its BACKWARD in place of
    receiving its gradient."""
    kind, mb, stage = need
    if kind is Kind.RECV_ACT and schedule.hands_over_locally(stage):
        return Kind.FORWARD, mb, stage - 1
    if kind is Kind.RECV_GRAD and schedule.hands_over_locally(stage + 1):
        return Kind.BACKWARD, mb, stage + 1
    return need


def _neighbour_rank(schedule: Schedule, action: Action) -> int | None:
    if action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
        return schedule.rank_of(action.stage + 1)
    if action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
        return schedule.rank_of(action.stage - 1)
    return None


# --------------------------------------------------------------------------------------------
# Stage placement: which blocks each stage runs, and which rank each stage lives on

@dataclass(frozen=True)
class StageSpan:
    """What stage ``stage`` runs: ``blocks`` (indices into the plain model's blocks), plus the
    embedding when ``first`` and the final norm, head and loss when ``last``."""
    stage: int
    blocks: range
    first: bool
    last: bool


def stage_costs(cfg: ModelConfig) -> tuple[float, float]:
    """Forward FLOPs per token of one block, and of the output head (the last stage's extra):
    a block 2·params + 4·s·(heads·head_dim), the head 2·V·h, the embedding a lookup, 0."""
    q, _ = attention_width(cfg)
    return 2.0 * block_param_count(cfg) + 4.0 * cfg.seq_len * q, 2.0 * cfg.vocab_size * cfg.hidden


@dataclass(frozen=True)
class LayerCosts:
    """What one micro-batch costs in each part of the model, forward and backward together: the
    embedding, each block, and the final norm with the head and the loss (any unit: seconds
    when measured, FLOPs when modelled). ``*_bytes`` (optional): what each part holds, its
    states (``*_state_bytes``) and one micro-batch's activations (``block_activation_bytes``),
    for the memory constraint. ``source`` says where the numbers come from, for the printout."""
    embed: float
    blocks: tuple[float, ...]
    head: float
    source: str = "flops"
    block_state_bytes: tuple[float, ...] | None = None
    block_activation_bytes: tuple[float, ...] | None = None
    embed_state_bytes: float = 0.0
    head_state_bytes: float = 0.0

    def stage_cost(self, blocks: range, first: bool, last: bool) -> float:
        return sum(self.blocks[i] for i in blocks) + (self.embed if first else 0.0) + (self.head if last else 0.0)

    def stage_bytes(self, blocks: range, first: bool, last: bool, in_flight: float) -> float:
        """States of the stage's parts plus ``in_flight`` micro-batches of its blocks' activations."""
        if self.block_state_bytes is None:
            return 0.0
        acts = self.block_activation_bytes or (0.0,) * len(self.blocks)
        return (sum(self.block_state_bytes[i] + in_flight * acts[i] for i in blocks)
                + (self.embed_state_bytes if first else 0.0) + (self.head_state_bytes if last else 0.0))


def flop_costs(cfg: ModelConfig) -> LayerCosts:
    """The FLOP model of ``stage_costs``, in units of one block (so ties break as before)."""
    block, head = stage_costs(cfg)
    return LayerCosts(0.0, (1.0,) * cfg.layers, head / block, source="flops")


def partition(cfg: ModelConfig, pp: int, virtual_stages: int = 1, stage_layers: list | None = None,
              costs: LayerCosts | None = None, memory_limit: float | None = None,
              in_flight: list[float] | None = None) -> list[StageSpan]:
    """The stages of a ``pp``-rank pipeline with ``virtual_stages`` chunks per rank: contiguous
    ranges of blocks. ``stage_layers`` (``parallel.stage_layers``) gives the split by hand.
    Otherwise, with one stage per rank, the slowest stage is made as fast as possible
    (``balanced_split``) on ``costs``, measured or modelled (default: the FLOP model, where the
    last stage also pays the head), the most even split winning among equals, each stage's
    memory (with ``in_flight[s]`` micro-batches of activations) under ``memory_limit``;
    interleaved schedules take equal chunks, as Megatron does, since their order assumes equal
    chunk costs."""
    num_stages = pp * virtual_stages
    if num_stages > cfg.layers:
        raise ConfigError(f"parallel.pp: {num_stages} stages, more than the model's {plural(cfg.layers, 'layer')}")
    if stage_layers is not None:
        counts = stage_counts(stage_layers, cfg.layers, num_stages)
    elif virtual_stages > 1:
        if cfg.layers % num_stages:
            raise ConfigError(f"parallel.virtual_stages: {cfg.layers} layers do not split into "
                              f"{num_stages} equal chunks")
        counts = [cfg.layers // num_stages] * num_stages
    else:
        counts = balanced_split(costs or flop_costs(cfg), num_stages, memory_limit, in_flight)
    return spans_of(counts)


def spans_of(counts) -> list[StageSpan]:
    """Consecutive stages holding ``counts[s]`` blocks each."""
    spans, start = [], 0
    for stage, count in enumerate(counts):
        spans.append(StageSpan(stage, range(start, start + count), stage == 0, stage == len(counts) - 1))
        start += count
    return spans


def stage_counts(stage_layers: list, layers: int, num_stages: int) -> list[int]:
    """Blocks per stage from ``parallel.stage_layers``: either a count per stage ([3, 1]) or each
    stage's block indices ([[0, 1, 2], [3]]), which must cover every block once, in order.
    ConfigError (one line) otherwise."""
    key = "parallel.stage_layers"
    if not isinstance(stage_layers, list) or len(stage_layers) != num_stages:
        got = len(stage_layers) if isinstance(stage_layers, list) else repr(stage_layers)
        raise ConfigError(f"{key}: needs one entry per stage, {num_stages} (pp × virtual_stages), got {got}")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in stage_layers):
        if min(stage_layers) < 1 or sum(stage_layers) != layers:
            raise ConfigError(f"{key}: {stage_layers} must give every stage at least one block and add up to the "
                              f"model's {plural(layers, 'layer')} (sum {sum(stage_layers)})")
        return list(stage_layers)
    if not all(isinstance(x, list) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x)
               for x in stage_layers):
        raise ConfigError(f"{key}: expected a block count per stage ([2, 2]) or each stage's non-empty list of "
                          f"block indices ([[0, 1], [2, 3]]), got {stage_layers!r}")
    flat = [i for stage in stage_layers for i in stage]
    if flat != list(range(layers)):
        raise ConfigError(f"{key}: {stage_layers} must cover every block 0..{layers - 1} once, in order, "
                          "consecutive blocks per stage")
    return [len(stage) for stage in stage_layers]


def balanced_split(costs: LayerCosts, stages: int, memory_limit: float | None = None,
                   in_flight: list[float] | None = None) -> tuple[int, ...]:
    """Blocks per stage, each ≥ 1, minimising (the slowest stage's cost, the sum of squared stage
    costs) among the splits whose stages all fit ``memory_limit`` (PipeDream's partitioner, by
    dynamic programming over (stages placed, blocks placed)); the first stage also pays the
    embedding, the last the head. ConfigError when no split fits."""
    return _balanced_split(costs, stages, memory_limit, tuple(in_flight) if in_flight else None)


@lru_cache(maxsize=64)
def _balanced_split(costs: LayerCosts, stages: int, memory_limit, in_flight) -> tuple[int, ...]:
    layers = len(costs.blocks)
    # best[k][n]: the best (max, sum of squares, counts) for the first k stages holding n blocks
    best: list[dict[int, tuple[float, float, tuple[int, ...]]]] = [{0: (0.0, 0.0, ())}]
    for k in range(stages):
        first, last = k == 0, k == stages - 1
        layer = {}
        for placed, (worst, squares, counts) in best[k].items():
            room = layers - placed - (stages - k - 1)  # leave a block for each later stage
            for count in range(1, room + 1):
                blocks = range(placed, placed + count)
                if memory_limit is not None and costs.stage_bytes(
                        blocks, first, last, in_flight[k] if in_flight else 1.0) > memory_limit:
                    break  # more blocks only hold more
                cost = costs.stage_cost(blocks, first, last)
                candidate = (max(worst, cost), squares + cost * cost, counts + (count,))
                n = placed + count
                if n not in layer or candidate[:2] < layer[n][:2]:
                    layer[n] = candidate
        best.append(layer)
    if layers not in best[stages]:
        raise ConfigError(f"parallel.pp: no split of the {plural(layers, 'block')} over {plural(stages, 'stage')} "
                          f"fits each stage in {memory_limit / 2**30:.2f} GiB")
    return best[stages][layers][2]


def describe_split(spans: list[StageSpan], costs: LayerCosts | None = None, unit: str = "ms",
                   scale: float = 1e3) -> str:
    """One line: each stage's blocks (and ends), with its cost when known, and by how much the
    slowest stage exceeds the mean: the bottleneck every other stage waits for."""
    parts = []
    for span in spans:
        what = (["embedding"] if span.first else []) + [f"blocks {span.blocks.start}-{span.blocks.stop - 1}"
                                                        if len(span.blocks) > 1 else f"block {span.blocks.start}"]
        what += ["head"] if span.last else []
        text = f"stage {span.stage}: {' + '.join(what)}"
        if costs is not None:
            text += f" {costs.stage_cost(span.blocks, span.first, span.last) * scale:.3g}{' ' if unit else ''}{unit}"
        parts.append(text)
    line = "; ".join(parts)
    if costs is not None:
        stage_costs_ = [costs.stage_cost(s.blocks, s.first, s.last) for s in spans]
        mean = sum(stage_costs_) / len(stage_costs_)
        slowest = max(range(len(spans)), key=stage_costs_.__getitem__)
        line += (f" ({costs.source}; stage {slowest} is the slowest, {stage_costs_[slowest] / mean - 1:.0%} "
                 "above the mean)") if mean > 0 else f" ({costs.source})"
    return line


@dataclass(frozen=True)
class Placement:
    """How a schedule's ``pp · v`` stages sit on its ranks. Looping (Megatron's): stage ``s`` on
    rank ``s % pp`` as that rank's model chunk ``s // pp``; with one chunk, stage = rank."""
    name: str = "looping"
    ends_on_rank_0: bool = False  # the first and the last stage (embedding and head) on one rank

    @staticmethod
    def rank_of(stage: int, pp: int) -> int:
        return stage % pp

    @staticmethod
    def stages_of(rank: int, pp: int, v: int) -> range:
        return range(rank, pp * v, pp)

    @staticmethod
    def chunk_of(stage: int, pp: int) -> int:
        return stage // pp


LOOPING = Placement()


@dataclass(frozen=True)
class VShape(Placement):
    """DualPipeV's: two stages per rank, stage ``s < pp`` on rank ``s`` going down, stage
    ``s ≥ pp`` on rank ``2·pp − 1 − s`` coming back; rank pp − 1 holds the two middle stages, rank
    0 the first and the last."""
    name: str = "v-shape"
    ends_on_rank_0: bool = True

    @staticmethod
    def rank_of(stage: int, pp: int) -> int:
        return stage if stage < pp else 2 * pp - 1 - stage

    @staticmethod
    def stages_of(rank: int, pp: int, v: int) -> tuple[int, int]:
        return rank, 2 * pp - 1 - rank

    @staticmethod
    def chunk_of(stage: int, pp: int) -> int:
        return int(stage >= pp)


V_SHAPE = VShape()


# --------------------------------------------------------------------------------------------
# The registry

@lru_cache(maxsize=None)
def _interleaved_group(pp: int, m: int) -> int:
    return next(g for g in range(min(pp, m), m + 1) if m % g == 0)


def interleaved_group(pp, m):
    """Micro-batches per group of the interleaved schedule: the smallest divisor of m that is at
    least pp (pp when pp divides m; m when m < pp). Scalars give an int; numpy arrays an array."""
    if np.ndim(pp) == 0 and np.ndim(m) == 0:
        return _interleaved_group(int(pp), int(round(float(m))))
    p, m = (np.array(x, dtype=float) for x in np.broadcast_arrays(pp, np.rint(m)))
    group = np.array(np.minimum(p, m))
    search = m % group != 0  # only these need a divisor search; the common case is pp | m
    if search.any():  # one divisor search per distinct (pp, m), however many layouts share it
        pairs, where = np.unique(np.stack([p[search], m[search]], axis=1), axis=0, return_inverse=True)
        group[search] = np.array([_interleaved_group(int(a), int(b)) for a, b in pairs])[where.ravel()]
    return group


def _one_chunk(flags: dict, pp: int, m: int, v: int, layers: int | None, name: str) -> None:
    if v != 1:
        raise ConfigError(f"{flags['virtual_stages']}: {name} has one stage per rank; only interleaved takes "
                          f"virtual_stages > 1, got {v}")


def _interleaved_constraints(flags: dict, pp: int, m: int, v: int, layers: int | None, name: str) -> None:
    if v < 2:
        raise ConfigError(f"{flags['virtual_stages']}: interleaved needs at least 2 (with 1 it is 1f1b), got {v}")
    if pp < 2:
        raise ConfigError(f"{flags['pp']}: interleaved needs at least 2 pipeline ranks (its chunks go round a ring), "
                          "got 1")
    if layers is None:
        return  # only the schedule is built: no model, and any number of micro-batches plays
    if layers % pp or (layers // pp) % v:
        raise ConfigError(f"{flags['virtual_stages']}: interleaved splits each rank's layers into equal chunks, "
                          f"but {layers} layers over pp={pp} ranks do not split into {v} equal chunks per rank")
    if m < pp:
        raise ConfigError(f"{flags['microbatches']}: interleaved needs at least pp={pp} micro-batches per step "
                          f"(its groups of micro-batches go round the ring of ranks), got {m}")


def _dualpipev_constraints(flags: dict, pp: int, m: int, v: int, layers: int | None, name: str) -> None:
    if v not in (1, 2):
        raise ConfigError(f"{flags['virtual_stages']}: dualpipev always holds two stages per rank (the V); leave it "
                          f"at 1 or set 2, got {v}")
    if pp < 2:
        raise ConfigError(f"{flags['pp']}: dualpipev needs at least 2 pipeline ranks (its V turns on the last), got 1")
    if m < 2 * pp:
        raise ConfigError(f"{flags['microbatches']}: dualpipev needs at least 2·pp = {2 * pp} micro-batches per step "
                          f"(its steady phase runs both directions at once), got {m}")
    if layers is not None and layers % (2 * pp):
        raise ConfigError(f"{flags['pp']}: dualpipev cuts the model into 2·pp = {2 * pp} equal stages; "
                          f"{layers} layers do not split so")
def _two_bw_constraints(flags: dict, pp: int, m: int, v: int, layers: int | None, name: str) -> None:
    _one_chunk(flags, pp, m, v, layers, name)
    if m < pp:
        raise ConfigError(f"{flags['microbatches']}: 2bw needs at least pp={pp} micro-batches per step, got {m} "
                          "(with fewer, the first stage's warm-up reaches two steps ahead and two weight versions "
                          "no longer suffice)")


def _pipedream_constraints(flags: dict, pp: int, m: int, v: int, layers: int | None, name: str) -> None:
    _one_chunk(flags, pp, m, v, layers, name)
    if m != 1:
        raise ConfigError(f"{flags['microbatches']}: pipedream takes one optimizer step per micro-batch "
                          f"(train.global_batch = dp × micro_batch); it cannot accumulate gradients over {m} "
                          "micro-batches: each would need its own weight version (use 2bw for that)")


@dataclass(frozen=True)
class SteadyForms:
    """Closed forms, as in ``ScheduleSpec``, for a step in the middle of a run of a schedule that
    never flushes; its fill and drain are paid once per run, not per step."""
    bubble: Callable
    in_flight_first: Callable
    in_flight_last: Callable
    head_in_flight: Callable = lambda p, m, v: 1 + 0 * p
    captured_first: Callable = lambda p, m, v: 0 * p  # 2bw and pipedream do not split the backward
    captured_last: Callable = lambda p, m, v: 0 * p


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything about one schedule. The closed forms take (pp, m, v) as numbers or numpy
    arrays and hold at uniform costs (every stage's F, B and W equal, as the simulator's
    ``ActionCosts(1/v, 2/v, 1/v)``), for every layout ``check_schedule`` accepts with
    ``layers`` given; tests/test_schedule.py checks each entry against the simulator.

    ``bubble``: idle over total rank-time of a step. ``in_flight_first`` / ``in_flight_last``:
    the most micro-batches whose activations the first / last pipeline rank holds at once, in
    units of one micro-batch through all of that rank's layers (a chunk counts 1/v).
    ``head_in_flight``: the most micro-batches whose final-norm tensors the stage with the head
    holds at once (until their weight gradients); it holds their log-probabilities until their
    backward: as many, or one where the backward is split. ``captured_first`` /
    ``captured_last``: under a split backward, how many of those in flight (in the same units)
    have run B and wait for W at the first / last rank's peak; each then holds only what W reads
    and the gradients B captured for it, K of its S saved bytes, and the rank peaks at
    n·S + c·(K − S), with one whole micro-batch's S − K more where S is the larger (costs.estimate;
    tests/test_schedule.py plays it at K/S from 0.5 to 1.3)."""
    name: str
    compute_order: Callable[[int, int, int, int], list[Action]]  # (rank, pp, m, v) → F/B/W in order
    constraints: Callable[[dict, int, int, int, int | None, str], None]
    bubble: Callable
    in_flight_first: Callable
    in_flight_last: Callable
    chunked: bool = False  # takes virtual_stages > 1
    placement: Placement = LOOPING
    summary: str = ""
    stages_per_rank: int | None = None  # fixed by the placement (DualPipeV: 2); None: virtual_stages
    # Schedules that never flush (2bw, pipedream; see "Steps back to back" below): the closed
    # forms of a step in the middle of a run (``SteadyForms``), and each stage's weights: the
    # versions it holds, ``weight_versions(stage, pp)``, and the batch's ``delay(stage, pp)``:
    # batch t computes its gradient on W(t − delay), so that W(t) = Opt(W(t−1), ∇L_t(W(t − delay)))
    # (delay 1: plain synchronous training; the staleness is delay − 1 updates).
    steady: "SteadyForms | None" = None
    weight_versions: Callable | None = None
    delay: Callable | None = None
    # A split-backward schedule whose bubble depends on a slot's (F, B, W) shares (B: the input
    # gradient alone) and has a form exact at any shares: ``bubble_at_shares(p, m, v, shares)``.
    # DualPipeV has none (its closed form holds at F = B = W; the planner plays it there).
    bubble_at_shares: Callable | None = None
    head_in_flight: Callable = lambda p, m, v: 1 + 0 * p  # the head's stage runs each backward after its forward
    captured_first: Callable = lambda p, m, v: 0 * p  # a backward not split keeps nothing for W
    captured_last: Callable = lambda p, m, v: 0 * p

    @cached_property
    def split_backward(self) -> bool:
        """Whether its weight gradients (W) run apart from the input gradients (B), read from its
        own order (rank 0 of 2, 4 micro-batches): a checkpointed block would recompute its forward
        in each, so full recomputation is refused (parallel/layout.py, plan/costs.py)."""
        return any(a.kind is Kind.WEIGHT_GRAD for a in self.compute_order(0, 2, 4, 2 if self.chunked else 1))


EQUAL_SHARES = (1 / 3, 1 / 3, 1 / 3)  # a slot's forward, input gradient and weight gradient, F = B = W


def _zb_h1_idle(p, m, shares=EQUAL_SHARES):
    """ZB-H1's idle rank-time, in micro-batch slots (F + B + W = 1, ``shares`` = (F, B, W)):
    (p − 1)(F + B − W) when m ≥ p (Qi et al. 2023; (p − 1)/3 at F = B = W); with fewer
    micro-batches than ranks the deferred W cannot fill the drain and each missing micro-batch
    adds a W, as the simulator shows (pp 8, m 4: 47.8% at F = B = W)."""
    f, b, w = shares
    return (p - 1) * (f + b - w) + np.maximum(0, p - m) * w


def _zb_h1_bubble(p, m, v, shares=EQUAL_SHARES):
    idle = _zb_h1_idle(p, m, shares)
    return idle / (m + idle)


# 2bw and pipedream: one step alone (the first and last of a run) is 1F1B; in a run, steps follow
# each other without a flush, every rank busy at uniform costs and rank r holding pp − r
# micro-batches, as 1F1B's warm-up leaves it.
_ONE_STEP_ALONE = dict(bubble=lambda p, m, v: (p - 1) / (m + p - 1), in_flight_first=lambda p, m, v: np.minimum(p, m),
                       in_flight_last=lambda p, m, v: 1)
_BACK_TO_BACK = SteadyForms(bubble=lambda p, m, v: 0 * p, in_flight_first=lambda p, m, v: p + 0 * m,
                            in_flight_last=lambda p, m, v: 1 + 0 * p)

SCHEDULE_REGISTRY: dict[str, ScheduleSpec] = {spec.name: spec for spec in [
    ScheduleSpec("gpipe", _gpipe_order, _one_chunk,
                 bubble=lambda p, m, v: (p - 1) / (m + p - 1),
                 in_flight_first=lambda p, m, v: m,
                 in_flight_last=lambda p, m, v: m,
                 head_in_flight=lambda p, m, v: m + 0 * p,
                 summary="all forwards, then all backwards (Huang et al. 2019)"),
    ScheduleSpec("1f1b", _one_f_one_b_order, _one_chunk,
                 bubble=lambda p, m, v: (p - 1) / (m + p - 1),
                 in_flight_first=lambda p, m, v: np.minimum(p, m),
                 in_flight_last=lambda p, m, v: 1,
                 summary="one forward, one backward (PipeDream-Flush, Megatron; Narayanan et al. 2021)"),
    ScheduleSpec("interleaved", _interleaved_order, _interleaved_constraints, chunked=True,
                 bubble=lambda p, m, v: (p - 1) / (v * m + p - 1),
                 # warm-up of (v−1)·group + 2(p−1) chunk forwards, and the first steady one
                 in_flight_first=lambda p, m, v: np.minimum((v - 1) * interleaved_group(p, m) + 2 * p - 1, v * m) / v,
                 in_flight_last=lambda p, m, v: ((v - 1) * interleaved_group(p, m) + 1) / v,
                 summary="1F1B over v model chunks per rank (Narayanan et al. 2021)"),
    ScheduleSpec("zb-h1", _zb_h1_order, _one_chunk,
                 bubble=_zb_h1_bubble, bubble_at_shares=_zb_h1_bubble,
                 # activations stay until W, deferred by r on rank r: every rank holds min(p, m)
                 in_flight_first=lambda p, m, v: np.minimum(p, m),
                 in_flight_last=lambda p, m, v: np.minimum(p, m),
                 head_in_flight=lambda p, m, v: np.minimum(p, m),
                 # rank 0 runs each W right after its B; the last rank defers its first W until
                 # every micro-batch in flight has run B
                 captured_first=lambda p, m, v: 1 + 0 * p,
                 captured_last=lambda p, m, v: np.minimum(p, m),
                 summary="1F1B with weight gradients deferred into the drain (Qi et al. 2023)"),
    ScheduleSpec("dualpipev", _dualpipev_order, _dualpipev_constraints, placement=V_SHAPE, stages_per_rank=2,
                 # per rank, idle (p − 1)·(F + B − W) (B: the input gradient alone) beside 2m·(F + B + W)
                 # busy: at F = B = W, (p − 1)/(6m + p − 1)
                 bubble=lambda p, m, v: (p - 1) / (6 * m + p - 1),
                 # 2p + 1 chunks on every rank (DeepSeek's PP + 1 stages' worth), p + 1/2 of the rank's layers
                 in_flight_first=lambda p, m, v: p + 0.5,
                 in_flight_last=lambda p, m, v: p + 0.5,
                 captured_first=lambda p, m, v: 0.5 + 0 * p,  # one chunk's B waiting for its W
                 captured_last=lambda p, m, v: 0.5 + 0 * p,
                 summary="two stages per rank in a V, both directions at once (DeepSeek-V3's DualPipe, "
                         "cut in half)"),
    ScheduleSpec("2bw", _one_f_one_b_order, _two_bw_constraints, **_ONE_STEP_ALONE, steady=_BACK_TO_BACK,
                 weight_versions=lambda stage, p: 2 + 0 * stage, delay=lambda stage, p: 2 + 0 * stage,
                 summary="1F1B across steps, no flush, two weight versions (PipeDream-2BW; Narayanan et al. 2021)"),
    ScheduleSpec("pipedream", _one_f_one_b_order, _pipedream_constraints, **_ONE_STEP_ALONE, steady=_BACK_TO_BACK,
                 weight_versions=lambda stage, p: p - stage, delay=lambda stage, p: p - stage,
                 summary="1F1B across steps of one micro-batch each, weight stashing (PipeDream; Harlap et al. 2018)"),
]}

_RUN_FLAGS = {"schedule": "parallel.schedule", "pp": "parallel.pp", "microbatches": "parallel.microbatches",
              "virtual_stages": "parallel.virtual_stages"}


def stages_per_rank(name: str, virtual_stages: int = 1) -> int:
    """How many stages each rank of schedule ``name`` holds: fixed by its placement (DualPipeV:
    2, whatever ``virtual_stages`` says), else ``virtual_stages``."""
    return SCHEDULE_REGISTRY[name].stages_per_rank or virtual_stages
# --------------------------------------------------------------------------------------------
# Steps back to back (2bw, pipedream). A run of such a schedule is 1F1B over all the run's
# micro-batches, with no flush between steps: rank r's pp − r − 1 warm-up forwards of a step run
# in the drain of the step before. ``build_run`` is that run as one schedule (what the simulator
# plays and the pictures draw); ``run_step`` cuts one step out of it for the runtime: each rank's
# actions from just after the backward of the previous step's last micro-batch to the backward
# of this step's last one, so that a step's gradients are complete when it ends, and its
# optimizer step comes before the next step's backwards. Its micro-batches are numbered from
# this step's first; numbers ≥ m are forwards of the steps after it.

def build_run(name: str, pp: int, microbatches: int, steps: int) -> Schedule:
    """``steps`` steps of ``name`` back to back: one schedule over steps × microbatches micro-batches."""
    spec = check_schedule(name, pp, microbatches)
    if spec.steady is None:
        raise ConfigError(f"parallel.schedule: {name} flushes at the end of every step; only 2bw and pipedream run "
                          "steps back to back")
    total = microbatches * steps
    compute = [spec.compute_order(rank, pp, total, 1) for rank in range(pp)]
    return Schedule(name, pp, total, 1, _with_p2p(compute, pp, 1, spec.placement.rank_of))


def steps_ahead(pp: int, microbatches: int) -> int:
    """How many later steps' micro-batches a step of a run forwards: the first rank's warm-up
    (pp − 1 forwards) reaches ⌈(pp − 1)/m⌉ steps ahead."""
    return -(-(pp - 1) // microbatches)


@dataclass(frozen=True)
class RunStep:
    """One step of a run (``run_step``): each rank's actions (``actions``), micro-batches
    numbered from this step's first; for each rank the indices of its sends that the receiver
    takes only in the next step (``crossing``), and how many messages it receives from each
    peer that were sent in the step before (``carried_in``)."""
    actions: tuple[tuple[Action, ...], ...]
    crossing: tuple[frozenset[int], ...]
    carried_in: tuple[dict[int, int], ...]


@lru_cache(maxsize=256)
def run_step(name: str, pp: int, microbatches: int, behind: int, ahead: int) -> RunStep:
    """The step of a run that has ``behind`` steps before it since the last flush and ``ahead``
    after it before the next (each counted up to ``steps_ahead``: further ones change nothing)."""
    m = microbatches
    run = build_run(name, pp, m, behind + 1 + ahead)
    offset = behind * m

    def end_of_backward(actions, mb) -> int:
        """Index just past B(mb) and its send, or 0 before the first micro-batch."""
        if mb < 0:
            return 0
        index = next(i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD and a.microbatch == mb)
        nxt = index + 1
        return nxt + 1 if nxt < len(actions) and actions[nxt].kind is Kind.SEND_GRAD else nxt

    cut = []
    for actions in run.actions:
        part = actions[end_of_backward(actions, offset - 1):end_of_backward(actions, offset + m - 1)]
        cut.append(tuple(Action(a.kind, a.microbatch - offset, a.stage, a.peer) for a in part))
    received = [{matching_send(a, rank) for a in actions if a.kind.is_recv} for rank, actions in enumerate(cut)]
    crossing = tuple(frozenset(i for i, a in enumerate(actions) if a.kind.is_send and a not in received[a.peer])
                     for actions in cut)
    sent = [set(a for a in actions if a.kind.is_send) for actions in cut]
    carried_in = []
    for rank, actions in enumerate(cut):
        counts: dict[int, int] = defaultdict(int)
        for a in actions:
            if a.kind.is_recv and matching_send(a, rank) not in sent[a.peer]:
                counts[a.peer] += 1
        carried_in.append(dict(counts))
    return RunStep(tuple(cut), crossing, tuple(carried_in))


def schedule_names() -> tuple[str, ...]:
    """The registered schedules, in the registry's order (indices of the planner's arrays)."""
    return tuple(SCHEDULE_REGISTRY)


def check_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1, layers: int | None = None,
                   flags: dict | None = None) -> ScheduleSpec:
    """The registry's entry for ``name``, or ConfigError (one line) for a layout it cannot run.

    Without ``layers`` only what building the action lists needs is checked; with the model's
    layer count, also what running it needs (a block per stage; each schedule's own rules).
    ``flags`` names the settings in the message as the user gave them (default: config keys)."""
    flags = {**_RUN_FLAGS, **(flags or {})}
    if name not in SCHEDULE_REGISTRY:
        raise ConfigError(f"{flags['schedule']}: must be one of {', '.join(SCHEDULE_REGISTRY)}, got {name!r}")
    for key, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if value < 1:
            raise ConfigError(f"{flags[key]}: must be a positive integer, got {value}")
    if layers is not None and pp > 1 and pp * virtual_stages > layers:
        raise ConfigError(f"{flags['pp']}: pp × virtual_stages = {pp} × {virtual_stages} = {pp * virtual_stages} "
                          f"stages, more than the model's {plural(layers, 'layer')} (each stage needs a block)")
    spec = SCHEDULE_REGISTRY[name]
    spec.constraints(flags, pp, microbatches, virtual_stages, layers, name)
    return spec
