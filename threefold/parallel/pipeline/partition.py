"""Which blocks of the model each pipeline stage runs.

The stage placement itself (``StageSpan``, ``partition``, ``stage_costs``) lives with the schedule
registry in schedule.py, torch-free, so the planner reads the same spans the engine builds; it is
re-exported here for the engine (stages.py). The layout checks are in parallel/layout.py.
"""
from __future__ import annotations

from threefold.parallel.pipeline.schedule import StageSpan, partition, stage_costs  # noqa: F401
