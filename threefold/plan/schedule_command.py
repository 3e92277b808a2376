"""``threefold schedule``: build a pipeline schedule, play it on relative costs, print its bubble
and the peak activations each rank holds, and draw its timeline.

Costs are relative to one pipeline stage's forward (= 1). An interleaved schedule's chunk is
1/virtual_stages of a stage, so its forward costs 1/v and schedules compare on the same model.
"""
from __future__ import annotations

import json
import math

import click
from rich.console import Console
from rich.table import Table

from threefold.config import ConfigError
from threefold.parallel.pipeline.schedule import (SCHEDULE_REGISTRY, build_schedule, check_schedule, schedule_names,
                                                 stages_per_rank)
from threefold.plan.commands import SCHEDULE_SYNONYMS, choice
from threefold.plan.pictures import check_picture_path
from threefold.plan.simulate import ActionCosts, SimResult, simulate
from threefold.words import plural


# what --from-metrics reads off the run: a flag for them beside it would be ignored
FROM_RUN_FLAGS = {"name": "--schedule", "pp": "--pp", "microbatches": "--microbatches",
                  "virtual_stages": "--virtual-stages", "backward_ratio": "--backward-ratio",
                  "weight_grad_share": "--weight-grad-share", "p2p_ratio": "--p2p-ratio", "show_actions": "--actions"}
MAX_PAIRS = 50_000  # (stage, micro-batch) pairs played: about 10 s of building and simulating here


@click.command("schedule")
@click.option("--schedule", "name", type=choice(schedule_names(), SCHEDULE_SYNONYMS), default="1f1b",
              show_default=True, help="Pipeline schedule (any case; interleaved-1f1b, pipedream-flush and the other "
                                      "frameworks' names too).")
@click.option("--pp", type=int, default=4, show_default=True, help="Pipeline ranks.")
@click.option("--microbatches", type=int, default=8, show_default=True, help="Micro-batches per step.")
@click.option("--virtual-stages", type=int, default=None,
              help="Model chunks per rank (a chunked schedule's: interleaved's; default 2 there, else 1).")
@click.option("--backward-ratio", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Full backward time over forward time.")
@click.option("--weight-grad-share", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Share of the backward that computes weight gradients (W, deferred by zb-h1).")
@click.option("--p2p-ratio", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Time to send one activation to the next stage, over forward time.")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Draw the timeline to this picture (.png, .svg or .pdf).")
@click.option("--actions", "show_actions", is_flag=True, help="Also print each rank's ordered actions.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--from-metrics", "metrics_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Metrics file of a pipeline run: its last step's measured timeline beside the simulation of "
                   "the same schedule on the measured stage costs (the schedule and cost flags come from the run: "
                   "giving one with it is refused).")
def schedule(name, pp, microbatches, virtual_stages, backward_ratio, weight_grad_share, p2p_ratio, out,
             show_actions, as_json, metrics_file):
    """Draw a pipeline schedule and print its bubble fraction and peak activations per rank."""
    if metrics_file:
        given = [flag for param, flag in FROM_RUN_FLAGS.items()
                 if click.get_current_context().get_parameter_source(param) != click.core.ParameterSource.DEFAULT]
        if given:
            raise ConfigError(f"{given[0]}: the schedule and its costs come from the run with --from-metrics; "
                              f"leave {given[0]} out")
        from threefold.plan.measured import measured_vs_simulated

        check_picture_path("--out", out)
        report = measured_vs_simulated(metrics_file, out)
        warmups = report["warmup_steps"]
        over = ("over its one step, warm-up included (a longer run gives a steadier figure)" if not warmups
                else f"over {plural(report['mean_steps'], 'step')} after the first" if warmups == 1
                else f"over {plural(report['mean_steps'], 'step')}, without each of its {warmups} launches' first")
        click.echo(json.dumps(report) if as_json else "\n".join(
            [f"rank {rank}: idle {got:.1%} measured in the last step, {want:.1%} simulated on its costs; "
             f"{mean:.1%} {over}, {replayed:.1%} replayed at each "
             f"action's measured time ({100 * (mean - replayed):+.1f} points from the messages: transfers, waking)"
             for rank, (got, want, mean, replayed) in enumerate(zip(
                 report["measured_idle"], report["simulated_idle"], report["mean_measured_idle"],
                 report["mean_replayed_idle"]))]
            + [report["bottleneck"]["line"]]))
        return
    for flag, value in (("--backward-ratio", backward_ratio), ("--weight-grad-share", weight_grad_share),
                        ("--p2p-ratio", p2p_ratio)):
        if not math.isfinite(value):
            raise ConfigError(f"{flag}: must be a finite number, got {value}")
    check_picture_path("--out", out)
    if virtual_stages is None:  # as estimate and plan take it
        virtual_stages = 2 if SCHEDULE_REGISTRY[name].chunked else 1
    spec = check_schedule(name, pp, microbatches, virtual_stages,
                          flags={"schedule": "--schedule", "pp": "--pp", "microbatches": "--microbatches",
                                 "virtual_stages": "--virtual-stages"})
    virtual_stages = stages_per_rank(name, virtual_stages)  # DualPipeV: always 2
    pairs = pp * microbatches * virtual_stages
    if pairs > MAX_PAIRS:
        raise ConfigError(f"--pp {pp} × --microbatches {microbatches} × --virtual-stages {virtual_stages} = {pairs:,} "
                          f"(stage, micro-batch) pairs, more than the {MAX_PAIRS:,} this command plays (about 10 s "
                          f"here); at uniform "
                          f"costs the bubble is {float(spec.bubble(pp, microbatches, virtual_stages)):.1%} "
                          "(the registry's closed form)")
    plan = build_schedule(name, pp, microbatches, virtual_stages)
    chunk = 1.0 / virtual_stages
    costs = ActionCosts(forward=chunk, backward=backward_ratio * chunk,
                        weight_grad=weight_grad_share * backward_ratio * chunk, p2p=p2p_ratio)
    result = simulate(plan, costs)
    # 2bw, pipedream never flush: a step alone is a run's first, which fills the pipeline; in the
    # run's steady steps the next step's forwards fill this one's drain (SteadyForms)
    steady = SCHEDULE_REGISTRY[name].steady
    steady_bubble = float(steady.bubble(pp, microbatches, virtual_stages)) if steady else None
    if out:
        from threefold.plan.timeline import draw_timelines  # matplotlib only when drawing

        draw_timelines([(_describe(result), result.segments())], out, unit="time (one stage's forward = 1)")
    if as_json:
        click.echo(json.dumps({
            "schedule": name, "pp": pp, "microbatches": microbatches, "virtual_stages": virtual_stages,
            "bubble_fraction": result.bubble_fraction, "steady_bubble_fraction": steady_bubble,
            "makespan": result.makespan,
            "peak_activations": list(result.peak_activations),
            "past_backward_at_peak": list(result.past_backward_at_peak),
            "costs": {"forward": 1.0, "backward": backward_ratio, "weight_grad": weight_grad_share * backward_ratio,
                      "p2p": p2p_ratio},
            "out": out,
        }))
        return
    console = Console()
    if show_actions:
        click.echo(str(plan))
    console.print(f"{_describe(result)}: bubble [bold]{result.bubble_fraction:.1%}[/bold], "
                  f"step {result.makespan:g} forward-units"
                  + (f" (a run's first step, which fills the pipeline; its steady steps: bubble "
                     f"[bold]{steady_bubble:.1%}[/bold], the next step's forwards filling each drain)"
                     if steady else ""))
    split = result.schedule.split_backward
    table = Table("rank", "busy", "idle", "peak activations (micro-batches)" + (", past B" if split else ""))
    for rank, busy in enumerate(result.busy):
        peak = f"{result.peak_activations[rank]:g}"
        if split:
            peak += f", {result.past_backward_at_peak[rank]:g}"
        table.add_row(str(rank), f"{busy:g}", f"{result.makespan - busy:g}", peak)
    console.print(table)
    if split:
        console.print("past B: a micro-batch that has run B holds only what W reads and the gradients B "
                      "captured for it until its W (docs/pipeline_parallel.md)", highlight=False)
    console.print(f"timeline drawn to {out}" if out else "draw the timeline with --out FILE.png", highlight=False)


def _describe(result: SimResult) -> str:
    plan = result.schedule
    text = f"{plan.name} pp={plan.pp} m={plan.microbatches}"
    return text + (f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else "")
