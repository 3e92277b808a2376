"""Parallel strategies, each a transformation of the plain model in its own file.

``build_engine`` is the one entry point the trainer uses: it joins the job's process group,
builds the mesh, and wraps the model in the engine of the requested layout.

Nothing is imported here at import time: the planner imports the torch-free schedule registry
(``parallel/pipeline/schedule.py``), which runs this file first, and must not pay for torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from threefold.config import Config
    from threefold.models.llama import Llama
    from threefold.train.engine import Engine


def build_engine(model: Llama, cfg: Config) -> Engine:
    """The engine for ``cfg.parallel`` on this rank. Every rank passes the same full model
    (built from the same seed); each strategy keeps its part of it."""
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.train.engine import Engine

    mesh = ParallelMesh.from_config(cfg.parallel)
    if mesh.world_size == 1:
        return Engine(model, cfg)
    model.to(mesh.device)
    comm = Comm(mesh)
    if cfg.parallel.pp > 1:  # pp × dp (zero 0, 1) × tp on one mesh
        from threefold.parallel.pipeline.engine import PipelineEngine

        return PipelineEngine(model, cfg, mesh, comm)
    if cfg.parallel.tp > 1:
        from threefold.parallel.tensor_parallel import build_tensor_parallel_engine

        return build_tensor_parallel_engine(model, cfg, mesh, comm)
    if cfg.parallel.zero == 3:
        from threefold.parallel.fsdp import FullyShardedEngine

        return FullyShardedEngine(model, cfg, mesh, comm)
    from threefold.parallel.data_parallel import DataParallelEngine

    return DataParallelEngine(model, cfg, mesh, comm)
