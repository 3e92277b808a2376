"""The layout matrix (tests/equivalence.py): each case equals one process, and its bytes per
mesh axis equal the planner's formulas exactly."""
from __future__ import annotations

import pytest

from equivalence import CASES, assert_same_training, case, matrix_case, matrix_config, reference
from threefold.plan import costs


def run(distributed, name: str) -> list[dict]:
    return case(distributed, matrix_case(name))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(distributed, name):
    assert_same_training(run(distributed, name), reference(matrix_case(name)))


@pytest.mark.parametrize("name", list(CASES))
def test_bytes_per_axis_equal_the_planner(distributed, name):
    cfg = matrix_config(*CASES[name])
    p, t, m = cfg.parallel, cfg.train, cfg.microbatches
    for r in run(distributed, name):
        pp_rank = r["coords"]["pp"]
        zero = p.zero if p.dp > 1 else 0
        for step in r["comm"]:
            assert step.get("dp", 0) == round(costs.dp_bytes_per_step(r["stage_numel"], p.dp, zero, m)), name
            if p.pp > 1:
                assert step["pp"] == costs.pp_bytes_per_step(pp_rank, p.pp, m, p.virtual_stages, t.micro_batch,
                                                             cfg.model.seq_len, cfg.model.hidden, p.tp,
                                                             p.sequence_parallel), name
            elif p.tp > 1:
                assert step["tp"] == round(costs.tp_bytes_per_step(cfg.model.layers, m, t.micro_batch,
                                                                   cfg.model.seq_len, cfg.model.hidden, p.tp,
                                                                   p.sequence_parallel, t.recompute)), name
