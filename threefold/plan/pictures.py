"""Pictures of the planner's estimates: ``threefold estimate --out`` and ``threefold plan --out``;
and of a dry run's memory, ``threefold dryrun --memory-out``.

One horizontal bar per layout in each of two panels: where the step's time goes (compute,
memory-bound work, exposed communication per axis, the pipeline bubble, the optimizer step;
the parts add up to the step time), and memory per GPU by kind against the GPU's capacity.
The same picture for one layout and for the top layouts of a search, side by side.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from threefold.config import ConfigError, check_output_path
from threefold.plan.report import TIME_PARTS
from threefold.plan.report import capacity_gib as capacity_text

FORMATS = (".png", ".svg", ".pdf")
TIME_COLOURS = {"compute": "#4c72b0", "memory_bound": "#8172b3", "tp_exposed": "#dd8452", "cp_exposed": "#937860", "ep_exposed": "#8c8c3c",
                "pp_exposed": "#da8bc3", "bubble": "#c8c8c8", "dp_exposed": "#c44e52", "optimizer": "#55a868",
                "contention": "#b07aa1", "stragglers": "#e0c341"}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "reserved")
MEMORY_COLOURS = dict(zip(MEMORY_PARTS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#c8c8c8")))


def check_picture_path(flag: str, path: str | None) -> None:
    """ConfigError, one line, unless ``path`` names a picture matplotlib writes here."""
    if path is not None and Path(path).suffix.lower() not in FORMATS:
        raise ConfigError(f"{flag}: {path} is not a picture; the file name must end in {', '.join(FORMATS)}")
    if path is not None:
        check_output_path(flag, path)


def draw_breakdown(results: Sequence[dict], labels: Sequence[str], capacity_gib: float, path: str | Path,
                   title: str) -> Path:
    """Draw each result (``report.result_json``) as one bar per panel and save to ``path``."""
    from matplotlib.figure import Figure  # matplotlib only when drawing

    check_picture_path("--out", str(path))
    rows = len(results)
    fig = Figure(figsize=(12, 1.2 + 0.55 * rows * 2 + 1.2), layout="constrained")
    time_ax, memory_ax = fig.subplots(2, 1)
    ranks = list(range(rows))
    # in the legend, not over the bars or the title; the driver's figure to a tenth, as the tables print it
    memory_ax.axvline(capacity_gib, color="black", linestyle="--", linewidth=1,
                      label=f"capacity {capacity_text(capacity_gib * 2**30)} GiB")
    for ax, parts, colours, values, unit in (
            (time_ax, TIME_PARTS, TIME_COLOURS, [r["time_s"] for r in results], "seconds per step"),
            (memory_ax, MEMORY_PARTS, MEMORY_COLOURS, [r["memory_gib"] for r in results], "GiB per GPU")):
        left = [0.0] * rows
        for part in parts:
            widths = [float(v.get(part, 0.0)) for v in values]
            if not any(widths):
                continue
            ax.barh(ranks, widths, left=left, color=colours[part], label=part.replace("_", " "), height=0.7)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_yticks(ranks, labels)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_xlabel(unit)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # beside the bars
    time_ax.set_title("where the step's time goes (exposed communication per axis, bubble, memory-bound work)")
    memory_ax.set_title("memory per GPU (fuller pipeline stage) against the GPU's capacity")
    fig.suptitle(title)
    return save_figure(fig, path)


def draw_live_memory(traces: Sequence[dict], labels: Sequence[str], states: Sequence[float],
                     models: Sequence[float | None], path: str | Path, title: str) -> Path:
    """Each dry-run rank's live bytes after every operator of its step (``traces``: the dry run's
    ``live_trace``), over the step's operators, its peak marked; dashed, what it keeps between
    steps (``states``: parameters, gradients, Adam's moments) and, where given, train's memory
    model (``models``); dotted, where its optimizer step begins."""
    from matplotlib.figure import Figure  # matplotlib only when drawing

    top_bytes = max(max(t["bytes"]) for t in traces)
    gib, unit = (2**30, "GiB") if top_bytes >= 2**30 else (2**20, "MiB")  # the tiny model's are MiB
    fig = Figure(figsize=(12, 5), layout="constrained")
    ax = fig.subplots()
    colours = ["#4c72b0", "#c44e52", "#55a868", "#8172b3", "#dd8452", "#937860"]
    for i, (trace, label, kept, model) in enumerate(zip(traces, labels, states, models)):
        colour = colours[i % len(colours)]
        live = [b / gib for b in trace["bytes"]]
        ax.plot(range(len(live)), live, color=colour, linewidth=1, label=label)
        top = max(range(len(live)), key=live.__getitem__)
        ax.plot([top], [live[top]], "o", color=colour)
        ax.annotate(f"peak {live[top]:,.1f} {unit}", (top, live[top]), textcoords="offset points", xytext=(6, 4),
                    color=colour, fontsize=8)
        ax.axhline(kept / gib, color=colour, linestyle="--", linewidth=0.8, alpha=0.6,
                   label=f"{label}: states {kept / gib:,.1f} {unit}")
        if model is not None:
            ax.axhline(model / gib, color=colour, linestyle="-.", linewidth=0.8,
                       label=f"{label}: train's memory model {model / gib:,.1f} {unit}")
        for start, name in trace["phases"]:
            if name.startswith("gradient norm"):
                ax.axvline(start, color=colour, linestyle=":", linewidth=0.8)
    ax.set_xlabel("operators of the step, in order (dotted: the gradient norm and optimizer step begin)")
    ax.set_ylabel(f"{unit} alive on the rank")
    ax.set_ylim(0, 1.1 * max(top_bytes, *(m for m in models if m is not None)) / gib)  # room for the labels
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.suptitle(title)
    return save_figure(fig, path, "--memory-out")


def save_figure(fig, path: str | Path, flag: str = "--out") -> Path:
    """Save ``fig`` to ``path``, its folders made; a path this process cannot write is one line."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    except OSError as err:  # a folder this process may not write to, a full disk, …
        raise ConfigError(f"{flag}: cannot write {path} ({err.strerror or err})") from None
    return path
