"""Context parallelism composed with Mixture-of-Experts blocks and expert parallelism.

Under cp an MoE block sees this rank's zigzag share of every sequence. Routing is per token, so
the experts' outputs need nothing; the statistics over the micro-batch's tokens are made the
whole micro-batch's by the seam ``apply_cp`` installs (``SplitMicroBatch``): the balance loss's
f, the capacity rule, and the step's counters (summed over dp × cp by ``Engine.end_moe_step``,
which the DeepSeek-V3 bias update reads). Every layout here trains the tiny MoE of
tests/test_expert_parallel.py (4 experts, top-2, every layer) for 5 fp32 AdamW steps and must
reproduce the single-process run (``assert_same_training``: losses, norms, every tensor of the
final state, the routing biases included), its step's routing statistics, and send exactly the
bytes per key the planner predicts for the rank (``dryrun_predict.predict_rank``).
"""
from __future__ import annotations

import pytest

from equivalence import TINY, assert_same_training, case, reference
from test_expert_parallel import BIAS, MOE, assert_same_routing

LAYOUTS = {
    "cp2-ring": ["parallel.cp=2", "parallel.cp_method=ring"],  # the aux loss (its default coefficient 0.01)
    "dp2-cp2-ring-bias": ["parallel.dp=2", "parallel.cp=2", "parallel.cp_method=ring"] + BIAS,
    "dp2-cp2-ep2-ring": ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "parallel.cp_method=ring"],
    "cp2-allgather": ["parallel.cp=2", "parallel.cp_method=allgather"],
    "cp2-ulysses-capacity": ["parallel.cp=2", "parallel.cp_method=ulysses", "model.moe_capacity_factor=0.5"],
    "dp2-cp2-ep2-capacity-full": ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "parallel.cp_method=allgather",
                                  "model.moe_capacity_factor=0.5", "train.recompute=full"],
    "dp2-cp2-ep2-zero3": ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "parallel.zero=3"],  # experts over cp
    "pp2-cp2-bias": ["parallel.pp=2", "parallel.cp=2"] + BIAS,  # the counts summed over cp and the stages
    "pp2-cp2-aux": ["parallel.pp=2", "parallel.cp=2"],  # each stage's balance loss over its own MoE blocks
    # ST-MoE's router z-loss beside the balance loss: a mean over the share's own tokens, nothing sent
    "dp2-cp2-ep2-ring-zloss": ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2", "parallel.cp_method=ring",
                               "model.moe_router_z_loss_coef=0.01"],
    "pp2-cp2-bias-zloss": ["parallel.pp=2", "parallel.cp=2", "model.moe_router_z_loss_coef=0.01"] + BIAS,
    "tp2-cp2-sp-capacity": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                            "parallel.cp_method=allgather", "model.moe_capacity_factor=0.5"],
}


def overrides(name: str) -> list[str]:
    return TINY + MOE + LAYOUTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_with_experts_trains_like_one_process(distributed, name):
    results, ref = case(distributed, overrides(name)), reference(overrides(name))
    assert_same_training(results, ref)
    assert_same_routing(results, ref)  # the step's routing, summed over dp × cp, is one process's
    if "capacity" in name:  # the capacity rule dropped tokens, the same as on one process
        assert all(m["dropped"] > 0 for m in ref["moe"])
    else:
        assert all(m["dropped"] == 0 for m in ref["moe"])
    if "model.moe_bias_rate=0.01" in overrides(name):  # the biases moved, and as on one process
        biases = [k for k in ref["state"] if k.endswith("expert_bias")]
        assert biases and all(ref["state"][k].abs().sum() > 0 for k in biases)
    else:
        assert all(m["aux_loss"] > 0 for m in ref["moe"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bytes_per_key_equal_the_planner(distributed, name):
    """Per step and rank: the attention's bytes and the routing statistics' ("cp.routing",
    plan/context.moe_bytes_per_step), the weight gradients over dp × cp, the experts' over
    edp × cp under the same key, and tp's and pp's, exactly as the planner predicts. The "ep"
    bytes of learned routing follow the recorded splits (tests/test_expert_parallel.py), not a
    closed form."""
    from threefold.configure import load_config
    from threefold.plan import context
    from threefold.plan.dryrun_predict import predict_rank, rank_share

    cfg = load_config(None, overrides(name))
    p, m = cfg.parallel, cfg.model
    grad_key = "+".join(a for a in ("dp", "cp") if getattr(p, a) > 1)
    for rank, r in enumerate(case(distributed, overrides(name))):
        want = predict_rank(cfg, rank)["comm_bytes"]
        pp_rank = rank // (p.world_size // p.pp)  # pp is the mesh's outermost axis
        moe_blocks = rank_share(cfg, pp_rank).moe_blocks  # the MoE blocks of this rank's stage
        assert 0 < moe_blocks <= m.layers and (moe_blocks < m.layers) == (p.pp > 1)
        moe = context.moe_bytes_per_step(p.cp, cfg.train.recompute, moe_blocks, cfg.microbatches,
                                         cfg.train.micro_batch * m.seq_len // p.cp, m.moe_top_k_experts,
                                         m.moe_experts, m.moe_aux_loss_coef > 0, m.moe_capacity_factor > 0)
        assert (moe > 0) == (m.moe_aux_loss_coef > 0 or m.moe_capacity_factor > 0)  # dropless bias: nothing to send
        assert want.get("cp.routing", 0) == moe
        assert {"cp", grad_key} <= set(want)
        for step in r["comm"]:
            assert step.get("cp.routing", 0) == moe, name
            for key, value in want.items():  # cp, the gradients' key, and tp, pp where they are
                if key != "ep":
                    assert step[key] == value, (name, key)
            assert (step.get("ep", 0) > 0) == (p.ep > 1)


# --- the dry run: the tiny MoE at dp2·cp2·ep2, against the planner ------------------------------
DRY_RUN = ["model.preset=tiny-moe", "model.vocab_size=4096", "parallel.dp=2", "parallel.cp=2", "parallel.ep=2",
           "parallel.zero=1", "train.global_batch=8", "train.micro_batch=2"]


@pytest.mark.parametrize("rank", [0, 3])
def test_dryrun_of_an_moe_model_under_cp_equals_the_planner(rank):
    """Fake tensors, round-robin routing (dropless: the dry run's rule, per call, sends what
    learned routing does): states, the attention's and the routing statistics' bytes, the
    gradients over dp × cp (experts over edp × cp) and the dispatch, all exactly the planner's."""
    from threefold.configure import load_config
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config, dry_run_rank

    cfg = dry_run_config(load_config(None, DRY_RUN), 4)
    result, want = dry_run_rank(cfg, rank), predict_rank(cfg, rank)
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    assert set(want["comm_bytes"]) == {"cp", "cp.routing", "dp+cp", "ep"}
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key


def test_the_dryrun_command_runs_an_moe_model_under_cp(capsys):
    import json

    from threefold.cli import main

    assert main(["dryrun", "--config", "configs/moe.toml", "--set", "parallel.dp=2", "--set", "parallel.cp=2",
                 "--set", "parallel.ep=2", "--world-size", "4", "--json", "--compare"]) == 0  # in this process
    out = json.loads(capsys.readouterr().out.strip().splitlines()[0])
    assert out["comm_bytes"]["cp.routing"] == out["predicted"]["comm_bytes"]["cp.routing"] > 0
