"""Draw pipeline timelines: one row per rank, a box per forward, backward and weight-gradient
action, idle time showing through in grey. Simulated and measured timelines take the same
form, so a real run can be drawn beside its simulation:

    draw_timelines([("simulated", result.segments()), ("measured", measured)], "timeline.png")

A timeline is, per rank, a list of (start, end, kind, micro-batch[, chunk]) with kind "F", "B"
or "W" (or a schedule Kind); the optional chunk (model chunk of an interleaved schedule) darkens
the box so that a rank's chunks can be told apart.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from threefold.parallel.pipeline.schedule import Kind
from threefold.plan.pictures import save_figure
from threefold.plan.simulate import Segment, bubble_fraction

COLOURS = {Kind.FORWARD: "#4c72b0", Kind.BACKWARD: "#dd8452", Kind.WEIGHT_GRAD: "#55a868"}
IDLE = "#e6e6e6"
FIGURE_WIDTH_IN = 12
AXIS_POINTS = FIGURE_WIDTH_IN * 72 * 0.88  # the time axis's length, less the rank labels


def draw_timelines(timelines: Sequence[tuple[str, Sequence[Sequence[Segment]]]], path: str | Path,
                   title: str | None = None, unit: str = "time") -> Path:
    """Draw each (label, per-rank segments) as one panel, stacked, and save a PNG to ``path``.
    Each panel's title carries its bubble fraction; panels keep their own time axis, since a
    simulation in relative units and a measurement in seconds need not share one."""
    if not timelines:
        raise ValueError("draw_timelines: nothing to draw")
    height = sum(0.4 * max(len(ranks), 1) + 1.0 for _, ranks in timelines) + 0.8
    fig = Figure(figsize=(FIGURE_WIDTH_IN, height), layout="constrained")
    axes = fig.subplots(len(timelines), 1, squeeze=False)[:, 0]
    for ax, (label, ranks) in zip(axes, timelines):
        _draw_panel(ax, label, ranks)
        ax.set_xlabel(unit)
    kinds_drawn = {Kind(seg[2]) for _, ranks in timelines for rank in ranks for seg in rank}
    split = Kind.WEIGHT_GRAD in kinds_drawn
    labels = {Kind.FORWARD: "forward", Kind.BACKWARD: "input grad (B)" if split else "backward",
              Kind.WEIGHT_GRAD: "weight grad (W)"}
    handles = [Patch(color=COLOURS[k], label=labels[k]) for k in COLOURS if k in kinds_drawn]
    handles.append(Patch(color=IDLE, label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), frameon=False)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def _draw_panel(ax, label: str, ranks: Sequence[Sequence[Segment]]) -> None:
    segments = [seg for rank in ranks for seg in rank]
    t0, t1 = (min(s[0] for s in segments), max(s[1] for s in segments)) if segments else (0.0, 1.0)
    span = (t1 - t0) or 1.0
    font_size = _number_font_size(segments, span)
    for rank, rank_segments in enumerate(ranks):
        ax.barh(rank, t1 - t0, left=t0, height=0.8, color=IDLE)
        for start, end, kind, microbatch, *chunk in rank_segments:
            ax.barh(rank, end - start, left=start, height=0.8, color=_shade(COLOURS[Kind(kind)], *chunk),
                    edgecolor="white", linewidth=0.5)
            if font_size:
                ax.text((start + end) / 2, rank, str(microbatch), ha="center", va="center",
                        fontsize=font_size, color="white")
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top, as the papers draw it
    ax.set_xlim(t0, t1)
    chunks = "; darker: later model chunk" if any(len(s) > 4 and s[4] for s in segments) else ""
    ax.set_title(f"{label}: bubble {bubble_fraction(ranks):.1%}{chunks}")


def _number_font_size(segments: Sequence[Segment], span: float) -> float | None:
    """One font size for a panel's micro-batch numbers, so that the longest fits the narrowest
    box (a digit is about 0.65 of the font size wide); None when it would be unreadable."""
    if not segments:
        return None
    narrowest = min(s[1] - s[0] for s in segments) / span * AXIS_POINTS
    digits = max(len(str(s[3])) for s in segments)
    size = min(7.0, (narrowest - 2) / (0.65 * digits))
    return size if size >= 4.5 else None


def _shade(colour: str, chunk: int = 0) -> tuple[float, float, float]:
    """Darken a colour for later model chunks (chunk 0 keeps the base colour)."""
    factor = 0.7 ** chunk
    return tuple(c * factor for c in to_rgb(colour))
