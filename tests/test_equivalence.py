"""The layout matrix (tests/equivalence.py): each case equals one process, and its bytes per
mesh axis equal the planner's formulas exactly."""
from __future__ import annotations

import pytest

from equivalence import CASES, assert_same_training, case, matrix_case, matrix_config, reference
from threefold.plan import context, costs


def run(distributed, name: str) -> list[dict]:
    return case(distributed, matrix_case(name))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(distributed, name):
    assert_same_training(run(distributed, name), reference(matrix_case(name)))


def cp_attention_bytes_per_step(cfg, layers: int) -> float:
    """plan/context.py's bytes on the cp axis for ``layers`` blocks and a step's micro-batches."""
    mdl, p, t = cfg.model, cfg.parallel, cfg.train
    return context.cp_bytes_per_step(p.cp_method, p.cp, t.recompute, layers, cfg.microbatches, t.micro_batch,
                                     mdl.seq_len, mdl.heads // p.tp, mdl.n_kv_heads // p.tp, mdl.head_dim)


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_axis_equal_the_planner(distributed, name):
    cfg = matrix_config(*CASES[name])
    p, t, m = cfg.parallel, cfg.train, cfg.microbatches
    seq = cfg.model.seq_len // p.cp  # the tokens of a sequence each rank holds
    # Weight gradients are reduced over dp × cp: counted under "dp+cp" ("dp", or "cp" when dp = 1).
    grad_key = "+".join(a for a in ("dp", "cp") if getattr(p, a) > 1) or "dp"
    for r in run(distributed, name):
        pp_rank = r["coords"]["pp"]
        zero = p.zero if p.dp * p.cp > 1 else 0
        shard = p.dp_shard * p.cp if p.dp_shard else None  # hybrid sharding: ZeRO over dp_shard × cp ranks
        grad_bytes = round(costs.dp_bytes_per_step(r["stage_numel"], p.dp * p.cp, zero, m, shard=shard,
                                                   reshard_after_forward=p.resharding))
        for step in r["comm"]:
            cp_attention = round(cp_attention_bytes_per_step(cfg, r["layers_here"])) if p.cp > 1 else 0
            if p.dp_shard and p.cp > 1:  # the all-reduce between shard groups: over dp ranks alone
                between = costs.hsdp_all_reduce_bytes(r["stage_numel"], shard, p.dp_replicate,
                                                      m if costs.priced_zero(zero, p.resharding) == 3 else 1)
                assert step["dp"] == round(between), name
                step = dict(step, **{grad_key: step[grad_key] + step["dp"]})
            if grad_key == "cp":  # dp = 1: the attention and the gradients share the cp group's key
                assert step["cp"] == cp_attention + grad_bytes, name
            else:
                assert step.get(grad_key, 0) == grad_bytes, name
                assert step.get("cp", 0) == cp_attention, name
            if p.pp > 1:
                assert step["pp"] == costs.pp_bytes_per_step(pp_rank, p.pp, m, p.virtual_stages, t.micro_batch,
                                                             seq, cfg.model.hidden, p.tp,
                                                             p.sequence_parallel, schedule=p.schedule), name
            elif p.tp > 1:
                assert step["tp"] == round(costs.tp_bytes_per_step(cfg.model.layers, m, t.micro_batch,
                                                                   seq, cfg.model.hidden, p.tp,
                                                                   p.sequence_parallel, t.recompute)), name
