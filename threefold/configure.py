"""``load_config``: what every command calls to turn a TOML file and ``--set`` overrides into a
checked ``Config``, before any process starts.

Three steps, each owned by its own module: ``config.read_config`` reads and validates the
fields (config.py is a leaf), ``models.presets`` supplies a named model size, and
``parallel.layout.check_layout`` asks each strategy whether it can run the layout. Nothing here
imports torch.
"""
from __future__ import annotations

import typing
from pathlib import Path

from threefold.config import Config, note_once, read_config
from threefold.models.presets import get_preset
from threefold.parallel.layout import check_layout


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    cfg = read_config(path, overrides, preset_of=get_preset)
    check_layout(cfg)
    if cfg.parallel.stage_costs == "planner":  # the planned GPU is the planner's catalog's
        from threefold.plan.stage_costs import check_stage_costs

        check_stage_costs(cfg)
    for line in unused_settings(cfg):  # after every check: a refused config gets its error line alone
        note_once(line)
    return cfg


def resolve_world(cfg: Config, world: int) -> Config:
    """``cfg`` on ``world`` processes: ``parallel.dp = "auto"`` becomes the degree the world
    leaves (config.py), and the strategies check the concrete layout."""
    cfg = cfg.resolve_world(world)
    check_layout(cfg)
    return cfg


def unused_settings(cfg: Config) -> list[str]:
    """A ``note:`` line for each setting the layout makes no use of: the engine simply ignores it
    (as ``threefold estimate`` does sequence parallelism at --tp 1), so the run is valid, but the
    user asked for something that will not happen. (interleaved and dualpipev at pp 1 are refused
    in config.py: they exist only on a ring of pipeline ranks.)"""
    p, notes = cfg.parallel, []
    if p.sequence_parallel and p.tp == 1:  # nothing to split the sequence over: Megatron turns it off too
        notes.append("note: parallel.sequence_parallel has no effect at parallel.tp = 1; running without it")
    if p.pp == 1 and p.schedule != "1f1b":
        notes.append(f"note: parallel.schedule = \"{p.schedule}\" has no effect at parallel.pp = 1 "
                     "(no pipeline to schedule)")
    if p.cp == 1 and p.cp_method != "ring":
        notes.append(f"note: parallel.cp_method = \"{p.cp_method}\" has no effect at parallel.cp = 1 "
                     "(no sequence split to attend across)")
    if p.pp == 1 and p.virtual_stages != 1:
        notes.append(f"note: parallel.virtual_stages = {p.virtual_stages} has no effect at parallel.pp = 1 "
                     "(no pipeline to split into stages)")
    return notes
