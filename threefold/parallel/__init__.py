"""Parallel strategies, each a transformation of model parts in its own file.

Applied in this order by the engine (threefold/train/engine.py, ``build_engine``):

  1. tensor_parallel.apply_tp   tensor (and sequence) parallelism from the plan table;
  2. pipeline/stages.py         the pipeline split into this rank's stage modules;
  3. gradient synchronisation   per model part: data_parallel.BucketGradSync (DDP, ZeRO-1/2)
                                or fsdp.ShardedGradSync (ZeRO-3), reducing over dp.

Each records where the tensors it cuts sit in the full model (placements.py). layout.py checks,
before any process starts, that every strategy can run the requested layout. This package
imports nothing from the planner or the trainer; this file imports nothing, so the torch-free
checks load fast.
"""
