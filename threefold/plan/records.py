"""The records of a metrics file (``threefold train --metrics-file``), read and checked for the
commands that read them back: ``compare``, ``calibrate --from-runs`` and ``schedule
--from-metrics``. Every field any of them reads is checked here, so that a damaged or foreign
file is one line naming its line and key, never a failure later on a wrong type."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path

from threefold.config import ConfigError
from threefold.words import plural
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY, Kind, build_schedule, check_schedule, steps_ahead

METRICS_KEYS = ("step", "step_time_s", "comm_bytes", "memory")
MEMORY_KEYS = ("params", "grads", "optimizer", "activations")  # what compare reads of a step's memory
# figures per key (an axis, a kind of memory) that a step record may hold besides comm_bytes and memory
OPTIONAL_FIGURES = ("comm_exposed_s", "comm_exposed_least_s", "comm_exposed_call_least_s")


def steady(records: list) -> list:
    """The records of steps that ran at a run's steady speed: without each launch's first step,
    which pays for warm-up (the trainer marks it ``"warmup": true``; in a file without the mark,
    the first record), or all of them when nothing else is left. A run resumed from a checkpoint
    warms up again at its first step."""
    kept = [r for i, r in enumerate(records) if i > 0 and not (isinstance(r, dict) and r.get("warmup"))]
    return kept or records


def is_number(value) -> bool:
    """A finite JSON number that fits a float (not a boolean, which Python counts as an int)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer of hundreds of digits
        return False


def record_problem(record, required=METRICS_KEYS) -> str | None:
    """What makes ``record`` (a parsed line of a metrics file) not a step record that compare,
    calibrate --from-runs and schedule --from-metrics can read, in a few words; None if nothing.
    The ``required`` keys must be there (with METRICS_KEYS, MEMORY_KEYS in its memory too); every
    field any of them reads is checked where it is there, so that none fails later on a wrong type."""
    if not isinstance(record, dict):
        return "not a JSON object: a run stopped mid-write leaves half a line"
    missing = [key for key in required if key not in record]
    if missing:
        return f"no {missing[0]!r}"
    if "step" in record and (not isinstance(record["step"], int) or isinstance(record["step"], bool)):
        return f"'step' is {record['step']!r}, not an integer"
    seconds = record.get("step_time_s", 1.0)
    if not is_number(seconds) or seconds <= 0:
        return f"'step_time_s' is {seconds!r}, not a positive number of seconds"
    for key in ("comm_bytes", "memory", *OPTIONAL_FIGURES):
        if key not in record:
            continue
        figures = record[key]
        if not isinstance(figures, dict):
            return f"{key!r} is {figures!r}, not an object of numbers"
        for name, value in figures.items():
            if not is_number(value) or value < 0:
                return f"{key}[{name!r}] is {value!r}, not a number at least 0"
    lacking = [key for key in MEMORY_KEYS if "memory" in required and key not in record["memory"]]
    if lacking:
        return f"'memory' has no {lacking[0]!r}"
    if "timeline" in record:
        return timeline_problem(record["timeline"])
    return None


def read_records(metrics_path: str | Path, flag: str = "--metrics-file", required=METRICS_KEYS) -> list[dict]:
    """Every step record of a metrics file written by ``threefold train --metrics-file``, in
    order; ConfigError, one line starting with ``flag`` (the option, or the run, that named the
    file), for a file that is not one: unreadable, empty, or a line that is not a step record
    (``record_problem`` with the ``required`` keys), such as the half line of a run killed mid-write."""
    records = []
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{flag}: cannot read {metrics_path} as text ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            record = None
        why = record_problem(record, required)
        if why:
            raise ConfigError(f"{flag}: {metrics_path} line {number} is not a step record of "
                              f"`threefold train --metrics-file` ({why})")
        records.append(_current_keys(record))
    if not records:
        raise ConfigError(f"{flag}: {metrics_path} holds no steps")
    return records


# Ledger keys renamed since a metrics file may have been written: old name → new
RENAMED_KEYS = {"tp.norm_grads": "tp.partial_grads"}  # 2026-12-07: MoE blocks' partial gradients too
PER_KEY_FIGURES = ("comm_bytes", "comm_exposed_s", "comm_exposed_least_s", "comm_exposed_call_least_s")


def _current_keys(record: dict) -> dict:
    """``record`` with the ledger keys of its per-key figures under their current names."""
    for figure in PER_KEY_FIGURES:
        if isinstance(record.get(figure), dict):
            record[figure] = {RENAMED_KEYS.get(key, key): value for key, value in record[figure].items()}
    return record


TIMELINE_INTS = ("pp", "microbatches", "virtual_stages")
KINDS = {kind.value: kind for kind in Kind}


def timeline_problem(timeline) -> str | None:
    """What makes a step record's ``timeline`` (``Engine.step_timeline()``) one that the functions
    above cannot play, in a few words; None if nothing: its schedule must be one the registry builds,
    its ``ranks`` one list per pipeline rank of [start, end, kind, micro-batch, stage] events, with
    every compute action of its schedule among them and some taking time."""
    if not isinstance(timeline, dict):
        return f"its timeline is {timeline!r}, not an object"
    for key in ("schedule", *TIMELINE_INTS, "ranks"):
        if key not in timeline:
            return f"its timeline has no {key!r}"
    for key in TIMELINE_INTS:
        value = timeline[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"timeline[{key!r}] is {value!r}, not a positive integer"
    if not isinstance(timeline["schedule"], str):
        return f"timeline['schedule'] is {timeline['schedule']!r}, not a schedule's name"
    name, pp, microbatches, virtual = (timeline[key] for key in ("schedule", *TIMELINE_INTS))
    try:
        check_schedule(name, pp, microbatches, virtual, flags={key: f"timeline[{key!r}]" for key in
                                                               ("schedule", *TIMELINE_INTS)})
    except ConfigError as err:
        return str(err)
    stages = pp * virtual
    # an asynchronous schedule's step also forwards later steps' micro-batches (numbered on from m),
    # and its actions are some of two steps' (run_step), not one flushed step's
    steady = SCHEDULE_REGISTRY[name].steady is not None
    indices = microbatches * (1 + (steps_ahead(pp, microbatches) if steady else 0))
    ranks = timeline["ranks"]
    if not isinstance(ranks, list) or len(ranks) != pp:
        return f"timeline['ranks'] is not a list of its pp={pp} ranks' events"
    measured, busy = set(), False
    for rank, events in enumerate(ranks):
        if not isinstance(events, list) or not events:
            return f"timeline['ranks'][{rank}] is {events!r}, not a non-empty list of events"
        for event in events:
            if not isinstance(event, list) or len(event) != 5:
                return (f"timeline['ranks'][{rank}] holds {event!r}, not an event "
                        "[start, end, kind, micro-batch, stage]")
            start, end, kind, mb, stage = event
            if not (is_number(start) and is_number(end)) or end < start:
                return f"timeline['ranks'][{rank}] holds {event!r}: its start and end are not times, start first"
            if kind not in KINDS:
                return f"timeline['ranks'][{rank}] holds {event!r}: kind {kind!r} is not one of {', '.join(KINDS)}"
            for what, value, limit in (("micro-batch", mb, indices), ("stage", stage, stages)):
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
                    return f"timeline['ranks'][{rank}] holds {event!r}: its {what} is not in 0..{limit - 1}"
            if KINDS[kind].is_compute:
                measured.add((KINDS[kind], stage, mb))
                busy = busy or end > start
    if not busy:
        return "its timeline's compute actions take no time"
    if not steady and len(measured) < 2 * stages * microbatches:  # a forward and a backward each: some are missing
        return (f"its timeline holds {plural(len(measured), 'distinct compute action')}, fewer than the forward "
                f"and backward of each of {plural(microbatches, 'micro-batch')} on {plural(stages, 'stage')}")
    flushed = () if steady else _built(name, pp, microbatches, virtual).actions
    for action in (a for rank in flushed for a in rank):
        if action.kind.is_compute and (action.kind, action.stage, action.microbatch) not in measured:
            return (f"its timeline lacks the {action.kind.value} of micro-batch {action.microbatch} on stage "
                    f"{action.stage} that {name} pp={pp} m={microbatches} runs")
    split = timeline.get("stage_layers")
    if split is not None and not (isinstance(split, list) and len(split) == stages and all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split)):
        return f"timeline['stage_layers'] is {split!r}, not a list of {plural(stages, 'positive block count')}"
    return None


@functools.lru_cache(maxsize=16)
def _built(name: str, pp: int, microbatches: int, virtual_stages: int):
    """build_schedule, once per layout for the many steps of a metrics file."""
    return build_schedule(name, pp, microbatches, virtual_stages)
