"""The planner's Mixture-of-Experts and context-parallel terms: exact formulas against hand counts."""
import numpy as np
import pytest

from threefold.plan import costs


# ---- expert parallelism: bytes on the ep axis ------------------------------------------------

def test_ep_bytes_are_four_all_to_alls_of_the_rows_plus_the_count_exchange():
    # T = 2·64 tokens, k = 2, h = 16, ep = 4, E = 8, fp32, 3 MoE layers, 5 micro-batches, by hand:
    # rows: 3/4 · 128·2·16·4 = 12,288 bytes per all_to_all; counts: 3 · 8/4 · 8 = 48 bytes.
    per_layer = 4 * 12_288 + 48
    assert costs.ep_bytes_per_step(128, 2, 16, 4, 3, 5, 8) == 5 * 3 * per_layer


def test_ep_bytes_under_recompute():
    args = dict(tokens=128, top_k=2, hidden=16, ep=4, moe_layers=1, microbatches=1, num_experts=8)
    none = costs.ep_bytes_per_step(**args)
    assert costs.ep_bytes_per_step(**args, recompute="selective") == none
    assert costs.ep_bytes_per_step(**args, recompute="full") == none + 2 * 12_288 + 48


def test_ep_bytes_vanish_at_ep_1_and_work_on_arrays():
    assert costs.ep_bytes_per_step(128, 2, 16, 1, 3, 5, 8) == 0
    got = costs.ep_bytes_per_step(128, 2, 16, np.array([1, 2, 8]), 1, 1, 8, recompute=np.array([0, 0, 2]),
                                  dtype_bytes=2)
    rows = lambda ep: (ep - 1) / ep * 128 * 2 * 16 * 2
    counts = lambda ep: (ep - 1) * 8 / ep * 8
    assert got.tolist() == [0, 4 * rows(2) + counts(2), 6 * rows(8) + 2 * counts(8)]
