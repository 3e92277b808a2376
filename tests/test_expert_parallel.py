"""Expert parallelism (threefold/parallel/expert_parallel.py) against one process, and its parts.

Every layout case trains the tiny model of tests/equivalence.py with 4 experts (top-2) in every
layer for 5 fp32 AdamW steps and must reproduce the single-process run's losses, gradient norms
and every tensor of the final state, the routing biases included (``assert_same_training``).
"""
from __future__ import annotations

import pytest
import torch

from equivalence import TINY, assert_same_training, case, reference

MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn=32"]
BIAS = ["model.moe_bias_rate=0.01", "model.moe_aux_loss_coef=0"]  # DeepSeek-V3's balancing instead of the loss

LAYOUTS = {
    "dp2-ep2": ["parallel.dp=2", "parallel.ep=2"],
    "dp2-ep2-bias": ["parallel.dp=2", "parallel.ep=2"] + BIAS,
    "dp2-ep2-capacity": ["parallel.dp=2", "parallel.ep=2", "model.moe_capacity_factor=0.5"],
    "dp4-ep2-zero1": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"],
    "dp2-ep2-zero3": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3"],
    "dp2-tp2-ep2-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    "pp2-dp2-ep2": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"] + BIAS,
}


def overrides(name: str) -> list[str]:
    return TINY + MOE + LAYOUTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_process(distributed, name):
    results = case(distributed, overrides(name))
    ref = reference(overrides(name))
    assert_same_training(results, ref)
    assert all(r["comm"][0].get("ep", 0) > 0 for r in results)  # the tokens did travel
    if "model.moe_bias_rate=0.01" in overrides(name):  # the biases moved, and as on one process
        biases = [k for k in ref["state"] if k.endswith("expert_bias")]
        assert biases and all(ref["state"][k].abs().sum() > 0 for k in biases)
