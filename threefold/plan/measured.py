"""Measured pipeline timelines beside the simulator: what a step's actions took (the runtime
records them; ``threefold train --metrics-file`` writes them for pipeline runs) and what the
simulator predicts for the same schedule on the same measured stage costs. The runtime only
executes; the comparison lives here, in the planner (``threefold schedule --from-metrics``)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from threefold.config import ConfigError
from threefold.parallel.pipeline.schedule import Kind, build_schedule
from threefold.plan.records import read_records, steady
from threefold.plan.simulate import ActionCosts, SimResult, replay, simulate


def measured_segments(timeline: dict) -> list[list[tuple]]:
    """The compute actions of a gathered timeline (``Engine.step_timeline()``, as the
    metrics file holds it) per rank, as (start, end, kind, micro-batch, model chunk) for drawing."""
    pp = timeline["pp"]
    return [[(start, end, kind, mb, stage // pp) for start, end, kind, mb, stage in rank if Kind(kind).is_compute]
            for rank in timeline["ranks"]]


def idle_fractions(segments: list[list[tuple]]) -> list[float]:
    """Each rank's idle share of the step: 1 − its compute time / the span from the earliest
    start to the latest end over all ranks. Works on measured and simulated segments alike."""
    start = min(seg[0] for rank in segments for seg in rank)
    span = max(seg[1] for rank in segments for seg in rank) - start
    return [1.0 - sum(seg[1] - seg[0] for seg in rank) / span for rank in segments]


def measured_costs(timeline: dict) -> ActionCosts:
    """Each stage's mean measured F, B and W durations, as the simulator's costs (p2p 0: the
    transfers' latency shows up in the measured idle time)."""
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for rank in timeline["ranks"]:
        for start, end, kind, _, stage in rank:
            durations[kind, stage].append(end - start)
    num_stages = timeline["pp"] * timeline["virtual_stages"]

    def mean(kind: str, stage: int) -> float:
        values = durations[kind, stage]
        return sum(values) / len(values) if values else 0.0

    weight_grad = [mean(Kind.WEIGHT_GRAD.value, s) for s in range(num_stages)]
    return ActionCosts(forward=[mean(Kind.FORWARD.value, s) for s in range(num_stages)],
                       backward=[mean(Kind.BACKWARD.value, s) + w for s, w in enumerate(weight_grad)],
                       weight_grad=weight_grad)


def stage_bottleneck(timeline: dict) -> dict:
    """Which stage the others wait for: each stage's measured compute (F + B + W) per
    micro-batch, the slowest, and how far above the mean stage it is (0: balanced); with the
    split that produced it (blocks per stage), and a line saying so."""
    measured = measured_costs(timeline)
    per_stage = [f + b for f, b in zip(measured.forward, measured.backward)]
    mean = sum(per_stage) / len(per_stage)
    slowest = max(range(len(per_stage)), key=per_stage.__getitem__)
    excess = per_stage[slowest] / mean - 1 if mean > 0 else 0.0
    split = timeline.get("stage_layers")
    line = (f"stage {slowest} is the bottleneck: {per_stage[slowest] * 1e3:.3g} ms of compute per micro-batch, "
            f"{excess:.0%} above the mean stage's {mean * 1e3:.3g} ms" + (f" (blocks per stage {split})" if split else ""))
    return {"stage_seconds": per_stage, "slowest_stage": slowest, "excess": excess, "stage_layers": split,
            "line": line}


def simulate_measured(timeline: dict) -> SimResult:
    """The simulator's play of the same schedule, on the stage costs this step measured."""
    schedule = build_schedule(timeline["schedule"], timeline["pp"], timeline["microbatches"],
                              timeline["virtual_stages"])
    return simulate(schedule, measured_costs(timeline))


def replayed_idle(timeline: dict) -> list[float]:
    """Each rank's idle share when the step's schedule is played with each compute action at
    the duration it measured and every message arriving as it is sent (``simulate.replay``).
    The measured share less this one is what the messages cost: their transfers, and on shared
    cores the wait for a receiving rank to be scheduled again."""
    schedule = build_schedule(timeline["schedule"], timeline["pp"], timeline["microbatches"],
                              timeline["virtual_stages"])
    measured = {(Kind(kind), stage, mb): end - start for rank in timeline["ranks"]
                for start, end, kind, mb, stage in rank if Kind(kind).is_compute}
    played = replay(schedule, lambda action: measured[action.kind, action.stage, action.microbatch])
    return idle_fractions([[(t.start, t.end) for t in rank if t.action.kind.is_compute] for rank in played])


def measured_idle(timeline: dict) -> list[float]:
    """Each rank's idle share of one measured step."""
    return idle_fractions(measured_segments(timeline))


def mean_idle(steps: list[dict], idle=measured_idle) -> list[float]:
    """Each rank's idle share (``idle`` of a step: measured_idle, or replayed_idle) averaged over
    the timelines ``steps`` (a run's steady ones: records.steady). One step's share swings with
    the moment it ran in: on 2 cores, ten-step windows of the demo ranged 16-29% around a run's 21%."""
    shares = [idle(timeline) for timeline in steps]
    return [sum(step[rank] for step in shares) / len(shares) for rank in range(len(shares[0]))]


def read_timeline_records(metrics_path: str | Path) -> list[dict]:
    """Every step record with a measured timeline in a metrics file written by ``threefold train
    --metrics-file`` on a pipeline run, in order, read by ``records.read_records`` (each line checked,
    its timeline by ``timeline_problem``); one line and exit 2 for a file that is not one or
    that holds no timeline."""
    timelines = [record for record in read_records(metrics_path, "--from-metrics", required=("step",))
                 if "timeline" in record]
    if not timelines:
        raise ConfigError(f"--from-metrics: {metrics_path} holds no pipeline timeline for any step "
                          "(it is written by runs with parallel.pp > 1)")
    return timelines


def measured_vs_simulated(metrics_path: str | Path, out: str | Path | None = None) -> dict:
    """For ``threefold schedule --from-metrics``: each rank's idle share in a run's last measured
    step and in the simulator's play of the same schedule on that step's stage costs, and the
    measured share averaged over the run's steady steps (``mean_idle``: each launch's first left
    out, ``records.steady``); with ``out``, both timelines drawn there (measured above simulated)."""
    records = read_timeline_records(metrics_path)
    steady_timelines = [record["timeline"] for record in steady(records)]
    timeline = records[-1]["timeline"]
    simulated = simulate_measured(timeline)
    measured_segs, simulated_segs = measured_segments(timeline), simulated.segments()
    name = f"{timeline['schedule']} pp={timeline['pp']} m={timeline['microbatches']}"
    name += f" v={timeline['virtual_stages']}" if timeline["virtual_stages"] > 1 else ""
    neck = stage_bottleneck(timeline)
    if out:
        from threefold.plan.timeline import draw_timelines  # matplotlib only when drawing

        title = f"measured: {name}; stage {neck['slowest_stage']} is the bottleneck, {neck['excess']:.0%} above the mean"
        draw_timelines([(title, measured_segs),
                        ("simulated on the measured stage costs", simulated_segs)], out, unit="seconds")
    return {"schedule": timeline["schedule"], "pp": timeline["pp"], "microbatches": timeline["microbatches"],
            "virtual_stages": timeline["virtual_stages"], "measured_idle": idle_fractions(measured_segs),
            "simulated_idle": idle_fractions(simulated_segs), "bottleneck": neck,
            "mean_measured_idle": mean_idle(steady_timelines),
            "mean_replayed_idle": mean_idle(steady_timelines, replayed_idle),
            "mean_steps": len(steady_timelines), "warmup_steps": len(records) - len(steady_timelines),
            "out": str(out) if out else None}
