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

from threefold.config import Config, read_config
from threefold.models.presets import get_preset
from threefold.parallel.layout import check_layout


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    cfg = read_config(path, overrides, preset_of=get_preset)
    check_layout(cfg)
    if cfg.parallel.stage_costs == "planner":  # the planned GPU is the planner's catalog's
        from threefold.plan.stage_costs import check_stage_costs

        check_stage_costs(cfg)
    return cfg


def resolve_world(cfg: Config, world: int) -> Config:
    """``cfg`` on ``world`` processes: ``parallel.dp = "auto"`` becomes the degree the world
    leaves (config.py), and the strategies check the concrete layout."""
    cfg = cfg.resolve_world(world)
    check_layout(cfg)
    return cfg
