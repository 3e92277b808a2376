"""Which blocks of the model each pipeline stage runs, and the layout checks a pipeline run needs.

The stage placement itself (``StageSpan``, ``partition``, ``stage_costs``) lives with the schedule
registry in schedule.py, torch-free, so the planner reads the same spans the engine builds; it is
re-exported here for the engine.

Nothing here imports torch: ``check_pipeline`` runs while a config is read, before any
process is started.
"""
from __future__ import annotations

from threefold.config import Config, ConfigError
from threefold.parallel.pipeline.schedule import StageSpan, check_schedule, partition, stage_costs  # noqa: F401


def check_pipeline(cfg: Config) -> None:
    """Raise ConfigError, one line, for a pipeline layout the runtime cannot run."""
    p = cfg.parallel
    if p.pp == 1:
        return
    check_schedule(p.schedule, p.pp, cfg.microbatches, p.virtual_stages, cfg.model.layers)
    if p.zero >= 2:
        raise ConfigError(f"parallel.zero: ZeRO-{p.zero} with pp > 1 is not supported: every micro-batch's backward "
                          f"adds to the gradients until the schedule ends, so sharding them (and the parameters) "
                          f"would cost a reduce-scatter (and all-gathers) per micro-batch; use zero 0 or 1")
