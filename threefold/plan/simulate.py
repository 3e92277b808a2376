"""Play a pipeline schedule (the same objects the runtime executes) on per-action costs.

Time model: each rank runs its actions in order, one at a time. A compute action takes its
cost. A send is posted asynchronously and takes no time on the rank; its tensor arrives
``p2p`` later. A receive waits until its tensor has arrived. Idle time is any time a rank
spends waiting inside the step's span, so with ``p2p > 0`` the transfer latency that is not
hidden shows up as bubble.

Bubble fraction, as the GPipe, Megatron and zero-bubble papers define it: idle rank-time over
total rank-time, ``1 - Σ busy / (pp · makespan)``. With uniform costs (every stage's forward
f and backward b equal, p2p = 0) GPipe and 1F1B give (pp−1)/(m+pp−1) for any b/f, interleaved
(pp−1)/(v·m+pp−1), ZB-H1 with f = B = W (p−1)/(3m+p−1).

Activations in flight: +1 when a forward of a (micro-batch, stage) starts, −1 when the last
backward action that reads its stored activations ends: B for a full backward, W for a split
one (the weight gradient needs each layer's stored input). Reported per rank in units of one
micro-batch through all of the rank's layers, so a model chunk counts 1/virtual_stages.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from threefold.config import ConfigError
from threefold.parallel.pipeline.schedule import Action, Kind, Schedule, play
from threefold.words import plural

# A drawn or measured timeline: per rank, (start, end, kind, micro-batch[, model chunk]) of each
# compute action, kind being "F", "B" or "W" (a Kind's value) or the Kind itself.
Segment = tuple


@dataclass(frozen=True)
class ActionCosts:
    """Duration of each action, in any unit (seconds, or multiples of one forward).

    ``forward``: one micro-batch's forward through one stage (the last stage's includes the loss);
    ``backward``: its full backward, input and weight gradients together;
    ``weight_grad``: the part of ``backward`` that computes weight gradients. A schedule that splits
    the backward runs ``backward − weight_grad`` as B and ``weight_grad`` as W, so one set of costs
    compares split and unsplit schedules fairly;
    ``p2p``: the time for one activation or gradient to reach the neighbouring stage.
    The first three are one number for all stages or a sequence with one per (virtual) stage.
    """
    forward: float | Sequence[float] = 1.0
    backward: float | Sequence[float] = 2.0
    weight_grad: float | Sequence[float] = 1.0
    p2p: float = 0.0

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float], list[float]]:
        """Forward, backward and weight-gradient cost of every stage, checked."""
        values = {}
        for name in ("forward", "backward", "weight_grad"):
            value = getattr(self, name)
            stages = [float(value)] * num_stages if isinstance(value, (int, float)) else [float(x) for x in value]
            if len(stages) != num_stages:
                raise ConfigError(f"costs.{name}: {plural(len(stages), 'value')} for {plural(num_stages, 'stage')}")
            if min(stages) < 0:
                raise ConfigError(f"costs.{name}: must not be negative, got {min(stages)}")
            values[name] = stages
        if self.p2p < 0:
            raise ConfigError(f"costs.p2p: must not be negative, got {self.p2p}")
        if any(w > b for w, b in zip(values["weight_grad"], values["backward"])):
            raise ConfigError("costs.weight_grad: must not exceed the full backward of its stage")
        return values["forward"], values["backward"], values["weight_grad"]


@dataclass(frozen=True)
class TimedAction:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    schedule: Schedule
    timelines: tuple[tuple[TimedAction, ...], ...]  # per rank, every action with its times
    makespan: float
    bubble_fraction: float
    peak_activations: tuple[float, ...]  # per rank, in micro-batches through the rank's layers
    # per rank, how many of those have run B and wait for W at the peak (split backward only; the
    # registry's captured_first/last): they hold only what W reads and what B captured for it
    past_backward_at_peak: tuple[float, ...] = ()

    @property
    def busy(self) -> list[float]:
        """Compute time of each rank."""
        return [sum(t.end - t.start for t in rank if t.action.kind.is_compute) for rank in self.timelines]

    def segments(self) -> list[list[Segment]]:
        """The compute actions per rank as (start, end, kind, micro-batch, model chunk), for drawing."""
        chunk_of = self.schedule.chunk_of
        return [[(t.start, t.end, t.action.kind, t.action.microbatch, chunk_of(t.action.stage))
                 for t in rank if t.action.kind.is_compute] for rank in self.timelines]


def _timed(schedule: Schedule, forward, backward, weight_grad, p2p, maximum) -> list[list[TimedAction]]:
    """Every rank's actions with their start and end, per-stage costs given (full backwards:
    a split schedule runs ``backward − weight_grad`` as B); ``maximum`` of two times: ``max`` on
    numbers, ``np.maximum`` on arrays of costs, one schedule played for many cost sets at once."""
    split = schedule.split_backward
    duration = {
        Kind.FORWARD: forward,
        Kind.BACKWARD: [b - w for b, w in zip(backward, weight_grad)] if split else backward,
        Kind.WEIGHT_GRAD: weight_grad,
    }
    return _played(schedule, lambda action: duration[action.kind][action.stage], p2p, maximum)


def replay(schedule: Schedule, duration_of) -> list[list[TimedAction]]:
    """Every rank's actions played with each compute action's own duration
    (``duration_of(action)``: a measured step's, micro-batch by micro-batch) and messages that
    arrive as they are sent: the idle time the schedule and those durations alone leave."""
    return _played(schedule, duration_of, 0.0, max)


def _played(schedule: Schedule, duration_of, p2p, maximum) -> list[list[TimedAction]]:
    clock = [0.0] * schedule.pp
    sent_at: dict[tuple[int, int], float] = {}
    timelines: list[list[TimedAction]] = [[] for _ in range(schedule.pp)]
    for step in play(schedule):
        action, rank = step.action, step.rank
        start = end = clock[rank]
        if action.kind.is_compute:
            end = start + duration_of(action)
        elif action.kind.is_send:
            sent_at[rank, step.index] = start
        else:
            end = maximum(start, sent_at[step.sent_by] + p2p)
        clock[rank] = end
        timelines[rank].append(TimedAction(start, end, action))
    return timelines


def play_costs(schedule: Schedule, forward, backward, weight_grad, p2p=0.0):
    """(makespan, each rank's compute time) of ``schedule`` with per-stage costs that may be
    numpy arrays of equal shape (the planner's costs of many GPUs or fitted rates): the play of
    ``simulate``, its arithmetic elementwise."""
    timelines = _timed(schedule, forward, backward, weight_grad, p2p, np.maximum)
    ends = [rank[-1].end if rank else 0.0 for rank in timelines]
    makespan = functools.reduce(np.maximum, ends)
    busy = [sum((t.end - t.start for t in rank if t.action.kind.is_compute), 0.0) for rank in timelines]
    return makespan, busy


def simulate(schedule: Schedule, costs: ActionCosts = ActionCosts()) -> SimResult:
    """Play ``schedule`` with ``costs``; raises ScheduleError if it cannot run to the end."""
    forward, backward, weight_grad = costs.per_stage(schedule.num_stages)
    timelines = _timed(schedule, forward, backward, weight_grad, costs.p2p, max)
    split = schedule.split_backward
    result_timelines = tuple(tuple(rank) for rank in timelines)
    return SimResult(
        schedule=schedule,
        timelines=result_timelines,
        makespan=max((rank[-1].end for rank in timelines if rank), default=0.0),
        bubble_fraction=bubble_fraction([[(t.start, t.end) for t in rank if t.action.kind.is_compute]
                                         for rank in result_timelines]),
        peak_activations=tuple(peak_in_flight(actions, split) / schedule.virtual_stages
                               for actions in schedule.actions),
        past_backward_at_peak=tuple(past_backward_at_peak(actions, split) / schedule.virtual_stages
                                    for actions in schedule.actions),
    )


def past_backward_at_peak(actions: Sequence[Action], split_backward: bool) -> int:
    """Of the (micro-batch, stage) pairs a rank holds at its peak (``peak_in_flight``), the most
    that have run B and wait for W, over the moments the peak is reached; 0 unless the backward
    is split."""
    if not split_backward:
        return 0
    whole = past = peak = most = 0
    for action in actions:
        if action.kind is Kind.FORWARD:
            whole += 1
        elif action.kind is Kind.BACKWARD:
            whole, past = whole - 1, past + 1
        elif action.kind is Kind.WEIGHT_GRAD:
            past -= 1
        if whole + past > peak:
            peak, most = whole + past, past
        elif whole + past == peak:
            most = max(most, past)
    return most


def bubble_fraction(busy_intervals: Sequence[Sequence[tuple[float, ...]]]) -> float:
    """Idle over total rank-time, from each rank's busy (start, end, …) intervals; the span
    runs from the earliest start to the latest end over all ranks. Works on measured timelines."""
    starts = [seg[0] for rank in busy_intervals for seg in rank]
    ends = [seg[1] for rank in busy_intervals for seg in rank]
    if not starts:
        return 0.0
    span = max(ends) - min(starts)
    if span <= 0:
        return 0.0
    busy = sum(seg[1] - seg[0] for rank in busy_intervals for seg in rank)
    return 1.0 - busy / (len(busy_intervals) * span)


def peak_in_flight(actions: Sequence[Action], split_backward: bool, weight=lambda action: 1, kept=None,
                   during_backward=None):
    """Most (micro-batch, stage) activation sets a rank stores at once, following its order;
    with ``weight(action)``, the most of their weights (e.g. the stage's blocks). Under a split
    backward a micro-batch holds its ``weight`` from F to B, then ``kept(action)`` until W (what
    W reads and the gradients B captured for it: dryrun_predict.split_activation_peak); without
    ``kept``, all of its weight. ``during_backward(action)``: what a B holds at most beyond what
    was in flight when it began (a block's gradients captured before its tensors are released)."""
    release = Kind.WEIGHT_GRAD if split_backward else Kind.BACKWARD
    kept = kept if split_backward and kept is not None else weight
    in_flight = peak = 0
    for action in actions:
        if action.kind is Kind.FORWARD:
            in_flight += weight(action)
        elif split_backward and action.kind is Kind.BACKWARD:
            if during_backward is not None:
                peak = max(peak, in_flight + during_backward(action))
            in_flight += kept(action) - weight(action)
        elif action.kind is release:
            in_flight -= kept(action)
        peak = max(peak, in_flight)
    return peak
