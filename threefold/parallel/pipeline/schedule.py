"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it performs
in one optimizer step. The runtime executes these lists; the planner's simulator plays them on
a cost model; the timeline drawer draws them. Nothing here touches torch.

Stages. The model is cut into ``pp · virtual_stages`` consecutive stages. Stage ``s`` lives on
rank ``s % pp`` as that rank's model chunk ``s // pp`` (Megatron's looping placement), so with
one virtual stage, stage and rank coincide. The first stage reads the micro-batch's tokens; the
last stage's forward ends with the loss, so its backward needs no received gradient.

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
from functools import cached_property
from typing import Iterator

from threefold.config import SCHEDULES, ConfigError


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
        return stage % self.pp

    def stages_of(self, rank: int) -> range:
        return range(rank, self.num_stages, self.pp)

    def chunk_of(self, stage: int) -> int:
        """Which of its rank's model chunks a stage is (0 unless interleaved)."""
        return stage // self.pp

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
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.schedule: must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if pp < 1:
        raise ConfigError(f"parallel.pp: must be a positive integer, got {pp}")
    if microbatches < 1:
        raise ConfigError(f"parallel.microbatches: must be a positive integer, got {microbatches}")
    if virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages: must be a positive integer, got {virtual_stages}")
    if name == "interleaved":
        _check_interleaved(pp, microbatches, virtual_stages)
    elif virtual_stages != 1:
        raise ConfigError(f"parallel.virtual_stages: {name} has one stage per rank; only interleaved takes "
                          f"virtual_stages > 1, got {virtual_stages}")
    compute_order = {
        "gpipe": _gpipe_order,
        "1f1b": _one_f_one_b_order,
        "interleaved": _interleaved_order,
        "zb-h1": _zb_h1_order,
    }[name]
    compute = [compute_order(rank, pp, microbatches, virtual_stages) for rank in range(pp)]
    return Schedule(name, pp, microbatches, virtual_stages, _with_p2p(compute, pp, virtual_stages))


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


def _check_interleaved(pp: int, m: int, v: int) -> None:
    if v < 2:
        raise ConfigError(f"parallel.virtual_stages: interleaved needs at least 2 (with 1 it is 1f1b), got {v}")
    if pp < 2:
        raise ConfigError("parallel.pp: interleaved needs at least 2 pipeline ranks (its chunks go round a ring), "
                          "got 1")


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
    group = next(g for g in range(min(pp, m), m + 1) if m % g == 0)
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


def _with_p2p(compute: list[list[Action]], pp: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """Put each receive just before the compute that consumes it, so a rank blocks only when it
    needs the data, and each send just after the compute that produced its tensor, unless the
    receiver takes an earlier message on the same channel first: then the send waits for that
    message (interleaved with pp = 2 sends activations and gradients on one channel). A send
    held back only waits for a message its receiver needs first, so it costs no time."""
    last = pp * v - 1
    naive = []
    for order in compute:
        actions = []
        for action in order:
            mb, stage = action.microbatch, action.stage
            if action.kind is Kind.FORWARD:
                if stage > 0:
                    actions.append(Action(Kind.RECV_ACT, mb, stage, (stage - 1) % pp))
                actions.append(action)
                if stage < last:
                    actions.append(Action(Kind.SEND_ACT, mb, stage, (stage + 1) % pp))
            elif action.kind is Kind.BACKWARD:
                if stage < last:
                    actions.append(Action(Kind.RECV_GRAD, mb, stage, (stage + 1) % pp))
                actions.append(action)
                if stage > 0:
                    actions.append(Action(Kind.SEND_GRAD, mb, stage, (stage - 1) % pp))
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
        for action in actions:
            if action.kind.is_send:
                held.add(action)
            else:
                ordered.append(action)
            for peer in sorted({(rank - 1) % pp, (rank + 1) % pp}):
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
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for pp={p}")
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
            if action.peer != expected_peer:
                raise ScheduleError(f"{where}: peer should be rank {expected_peer}")
            missing = [need for need in needs if (need, mb, stage) not in done]
            if missing:
                raise ScheduleError(f"{where}: comes before its {missing[0].name} on this rank")
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


def _neighbour_rank(schedule: Schedule, action: Action) -> int | None:
    if action.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
        return schedule.rank_of(action.stage + 1)
    if action.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
        return schedule.rank_of(action.stage - 1)
    return None
