"""Which blocks of the model each pipeline stage runs: contiguous ranges, balanced by the cost model.

The model is cut into ``pp · virtual_stages`` stages. Stage ``s`` runs blocks ``spans[s].blocks``
of the plain model; the first stage also runs the embedding, the last the final norm, the
output head and the loss. Stage ``s`` lives on pipeline rank ``s % pp`` (schedule.py).

Balance. With one stage per rank, the blocks are split so that the costliest stage is as
cheap as possible: a stage costs its blocks plus, on the last stage, the output head (forward
FLOPs per token, ``plan.costs``: a block 2·params + 4·s·(heads·head_dim), the head 2·V·h, the
embedding a lookup, 0). The first and last stages may therefore get fewer blocks. Among equally
good splits the most even one wins (the smallest sum of squared stage costs).

Interleaved schedules take equal chunks instead, as Megatron does: the schedule orders its
micro-batches assuming every chunk costs the same, so each rank's layers must split into
``virtual_stages`` equal chunks.

Nothing here imports torch: the planner and the layout checks (parallel/layout.py) use it
before any process is started.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from threefold.config import ConfigError, ModelConfig
from threefold.plan.costs import attention_width, block_param_count


@dataclass(frozen=True)
class StageSpan:
    """What stage ``stage`` runs: ``blocks`` (indices into the plain model's blocks), plus the
    embedding when ``first`` and the final norm, head and loss when ``last``."""
    stage: int
    blocks: range
    first: bool
    last: bool


def stage_costs(cfg: ModelConfig) -> tuple[float, float]:
    """Forward FLOPs per token of one block, and of the output head (the last stage's extra)."""
    q, _ = attention_width(cfg)
    return 2.0 * block_param_count(cfg) + 4.0 * cfg.seq_len * q, 2.0 * cfg.vocab_size * cfg.hidden


def partition(cfg: ModelConfig, pp: int, virtual_stages: int = 1) -> list[StageSpan]:
    """The stages of a ``pp``-rank pipeline with ``virtual_stages`` chunks per rank."""
    num_stages = pp * virtual_stages
    if num_stages > cfg.layers:
        raise ConfigError(f"parallel.pp: {num_stages} stages, more than the model's {cfg.layers} layers")
    if virtual_stages > 1:
        if cfg.layers % num_stages:
            raise ConfigError(f"parallel.virtual_stages: {cfg.layers} layers do not split into "
                              f"{num_stages} equal chunks")
        counts = [cfg.layers // num_stages] * num_stages
    else:
        block, head = stage_costs(cfg)
        counts = list(_balanced_counts(cfg.layers, num_stages, head / block))
    spans, start = [], 0
    for stage, count in enumerate(counts):
        spans.append(StageSpan(stage, range(start, start + count), stage == 0, stage == num_stages - 1))
        start += count
    return spans


@lru_cache(maxsize=64)
def _balanced_counts(layers: int, stages: int, head: float) -> tuple[int, ...]:
    """Blocks per stage, each ≥ 1, minimising (largest stage cost, sum of squared costs), in
    units of one block's cost; the last stage also pays ``head``. Dynamic programming over
    (stages placed, blocks placed)."""
    # best[k][n]: the best (max, sum of squares, counts) for the first k stages holding n blocks
    best: list[dict[int, tuple[float, float, tuple[int, ...]]]] = [{0: (0.0, 0.0, ())}]
    for k in range(stages):
        extra = head if k == stages - 1 else 0.0
        layer = {}
        for placed, (worst, squares, counts) in best[k].items():
            room = layers - placed - (stages - k - 1)  # leave a block for each later stage
            for count in range(1, room + 1):
                cost = count + extra
                candidate = (max(worst, cost), squares + cost * cost, counts + (count,))
                n = placed + count
                if n not in layer or candidate[:2] < layer[n][:2]:
                    layer[n] = candidate
        best.append(layer)
    return best[stages][layers][2]
