"""Expert parallelism (threefold/parallel/expert_parallel.py) against one process, and its parts.

Every layout case trains the tiny model of tests/equivalence.py with 4 experts (top-2) in every
layer for 5 fp32 AdamW steps and must reproduce the single-process run's losses, gradient norms
and every tensor of the final state, the routing biases included (``assert_same_training``).
"""
from __future__ import annotations

import pytest
import torch

from equivalence import TINY, assert_same_training, case, reference
from test_train import corpus  # noqa: F401  (the corpus fixture)

MOE = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn=32"]
BIAS = ["model.moe_bias_rate=0.01", "model.moe_aux_loss_coef=0"]  # DeepSeek-V3's balancing instead of the loss

LAYOUTS = {
    "dp2-ep2": ["parallel.dp=2", "parallel.ep=2"],
    "dp2-ep2-bias": ["parallel.dp=2", "parallel.ep=2"] + BIAS,
    "dp2-ep2-capacity": ["parallel.dp=2", "parallel.ep=2", "model.moe_capacity_factor=0.5"],
    "dp4-ep2-zero1": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"],
    "dp4-ep2-zero1-expert-lr": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=1", "model.moe_expert_lr_scale=3"],
    "dp2-ep2-zero3": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3"],
    "dp4-ep2-zero3": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"],  # experts sharded over edp = 2
    # hybrid sharding: the dense weights ZeRO-3 over each ep pair, the experts (one rank of each
    # pair holds them) all-reduced between the pairs
    "dp4-ep2-hsdp2": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3", "parallel.dp_shard=2"],
    # and ZeRO-2 over each ep pair, the experts likewise all-reduced between the pairs
    "dp4-ep2-zero2-shard2": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=2", "parallel.dp_shard=2"],
    # the recomputed forward keeps the experts gathered for the backward that follows it
    "dp4-ep2-zero3-full": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=3", "train.recompute=full"],
    "dp4-ep2-zero2-full": ["parallel.dp=4", "parallel.ep=2", "parallel.zero=2", "train.recompute=full"] + BIAS,
    "dp2-ep2-zero2-full": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=2", "train.recompute=full"],
    "dp2-ep2-zero3-selective": ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3", "train.recompute=selective"],
    "dp2-tp2-ep2-sp": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"],
    # under SP each tp rank runs the experts on its own positions (tensor_parallel.SequenceSplitMoE):
    # their gradients partial sums over tp, the balance loss's given back 1/t on each rank
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2-sp-capacity-bias": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.moe_capacity_factor=0.5",
                             "model.moe_bias_rate=0.01", "model.moe_router_z_loss_coef=0.001"],
    "dp2-tp2-ep2-sp-zero3-full": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
                                  "parallel.zero=3", "train.recompute=full"],
    "tp2-cp2-sp-capacity": ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                            "model.moe_capacity_factor=0.5"],
    "pp2-tp2-sp-zb-h1": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                         "parallel.schedule=zb-h1"],
    "dp2-tp2-ep2-zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.zero=1"],  # without SP
    "pp2-dp2-ep2": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2"] + BIAS,
    "pp2-dp2-ep2-first-dense": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "model.moe_first_dense=2"]
    + BIAS,  # stage 0 holds no MoE layer
    "pp2-dp2-ep2-zero3": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3",
                          "parallel.reshard_after_forward=true"],
    # the dense units and the experts' kept gathered through the step, reduced once at its last backward
    "pp2-dp4-ep2-zero3-keep": ["parallel.pp=2", "parallel.dp=4", "parallel.ep=2", "parallel.zero=3"],  # the default
    "pp2-dp2-ep2-zb-h1-zero1": ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1",
                                "parallel.schedule=zb-h1"],
    # ZeRO-3 under a split backward, the experts sharded over edp = 2 by a sync of their own
    "pp2-dp4-ep2-zb-h1-zero3": ["parallel.pp=2", "parallel.dp=4", "parallel.ep=2", "parallel.zero=3",
                                "parallel.schedule=zb-h1", "parallel.reshard_after_forward=true"],
    # the ep group folded over tp and cp (parallel.expert_tp = 1, Megatron-Core's expert-tp 1):
    # each tp rank routes its own positions, the experts split over tp ranks instead of repeated
    "tp2-ep2-fold": ["parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1", "parallel.sequence_parallel=true"],
    "tp2-ep2-fold-shared-capacity": ["parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1",
                                     "parallel.sequence_parallel=true", "model.moe_shared_experts=1",
                                     "model.moe_capacity_factor=0.5", "model.moe_router_z_loss_coef=0.001"],
    "dp2-tp2-ep4-fold-zero1": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=4", "parallel.expert_tp=1",
                               "parallel.sequence_parallel=true", "parallel.zero=1"] + BIAS,
    # ep = tp: the experts replicated over the dp ranks, reduced over edp = 2
    "dp2-tp2-ep2-fold-zero3-full": ["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1",
                                    "parallel.sequence_parallel=true", "parallel.zero=3", "train.recompute=full"],
    "cp2-ep2-fold-capacity": ["parallel.cp=2", "parallel.ep=2", "parallel.expert_tp=1",
                              "model.moe_capacity_factor=0.5"],
    "tp2-cp2-ep4-fold-shared-capacity": ["parallel.tp=2", "parallel.cp=2", "parallel.ep=4", "parallel.expert_tp=1",
                                         "parallel.sequence_parallel=true", "model.moe_shared_experts=1",
                                         "model.moe_capacity_factor=0.5"],
    "pp2-tp2-ep2-fold-zb-h1": ["parallel.pp=2", "parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1",
                               "parallel.sequence_parallel=true", "parallel.schedule=zb-h1"],
    # stage 0 all dense: its ranks hold nothing split over cp, yet must meet the MoE stage's sums
    # over cp in the gradient norm and the full state dict (placements._counted)
    "pp2-cp2-ep2-fold-first-dense": ["parallel.pp=2", "parallel.cp=2", "parallel.ep=2", "parallel.expert_tp=1",
                                     "model.moe_first_dense=2"] + BIAS,
}


def overrides(name: str) -> list[str]:
    return TINY + MOE + LAYOUTS[name]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_layouts_train_like_one_process(distributed, name):
    results = case(distributed, overrides(name))
    ref = reference(overrides(name))
    assert_same_training(results, ref)
    expert_parallel = any(o.startswith("parallel.ep=") for o in overrides(name))
    for r in results:  # the tokens did travel, on the ranks that hold MoE layers
        holds_moe = "model.moe_first_dense=2" not in overrides(name) or r["pp_rank"] == 1
        if "model.moe_first_dense=2" in overrides(name):  # every rank's norm and full state dict are the model's
            assert r["state"].keys() == ref["state"].keys()
        assert (r["comm"][0].get("ep", 0) > 0) == (holds_moe and expert_parallel)
        folded = "parallel.expert_tp=1" in overrides(name)  # folded, no expert's gradient is a partial sum
        if "parallel.sequence_parallel=true" in overrides(name) and not folded:  # the MoE blocks' partial ones
            assert r["comm"][0].get("tp.partial_grads", 0) > 0
        # the busiest of the ep = 2 ranks' routed rows over the mean: between balanced and all of them
        assert all(1 <= m.get("ep_max_over_mean", 0) <= 2 for m in r["moe"]) == expert_parallel
    assert_same_routing(results, ref)
    if "capacity" in name:  # the capacity rule dropped tokens, the same ones as on one process
        assert all(m["dropped"] > 0 for m in ref["moe"])
    if "model.moe_bias_rate=0.01" in overrides(name):  # the biases moved, and as on one process
        biases = [k for k in ref["state"] if k.endswith("expert_bias")]
        assert biases and all(ref["state"][k].abs().sum() > 0 for k in biases)


def test_the_experts_learning_rate_scale_trains_like_one_process_without_ep_too(distributed):
    """``model.moe_expert_lr_scale`` puts the experts in a sync of their own even at ep = 1 (here
    their own ZeRO-2 chunks over dp), so that they can step at their own learning rate: as on one
    process, and not as without the scale."""
    scaled = TINY + MOE + ["parallel.dp=2", "parallel.zero=2", "model.moe_expert_lr_scale=3"]
    assert_same_training(case(distributed, scaled), reference(scaled))
    assert reference(scaled)["losses"][1:] != pytest.approx(reference(scaled[:-1])["losses"][1:], rel=1e-6)


def assert_same_routing(results: list[dict], ref: dict) -> None:
    """Every rank's step statistics (summed over the ranks and stages by ``Engine.end_moe_step``)
    are one process's: dropped assignments and tokens per expert exactly, the aux loss to 1e-5."""
    for r in results:
        assert [m["dropped"] for m in r["moe"]] == [m["dropped"] for m in ref["moe"]]
        assert [m["tokens_per_expert"] for m in r["moe"]] == [m["tokens_per_expert"] for m in ref["moe"]]
        assert [m["aux_loss"] for m in r["moe"]] == pytest.approx([m["aux_loss"] for m in ref["moe"]], rel=1e-5)


# --- the exchange itself --------------------------------------------------------------------------
def dispatch_then_combine() -> dict:
    """dp2·ep2, 4 experts: rank r sends rows sorted by expert with counts of its own; dispatch
    must deliver each rank's rows for expert e to e's rank, and combine (experts = identity,
    weights 1) must return the input and, backward, its gradient, bit for bit."""
    from threefold.config import ParallelConfig
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.expert_parallel import combine, dispatch

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, ep=2, timeout_s=30))
    comm = Comm(mesh)
    everyone = {r: torch.tensor([[3, 0, 2, 1], [1, 4, 0, 2]][r]) for r in range(2)}  # rank 0 sends expert 1 nothing
    rows = {r: torch.randn(int(c.sum()), 8, generator=torch.Generator().manual_seed(r)) for r, c in everyone.items()}
    me = mesh.coord("ep")
    x = rows[me].clone().requires_grad_()
    local, exchange = dispatch(x, everyone[me], comm)
    y = combine(local * 1.0, exchange, comm)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(10 + me))
    y.backward(grad)
    expected = torch.cat([rows[r].split(everyone[r].tolist())[e] for e in (2 * me, 2 * me + 1) for r in range(2)])
    out = {"local": torch.equal(local.detach(), expected), "values": torch.equal(y.detach(), x.detach()),
           "grad": torch.equal(x.grad, grad), "local_counts": exchange.local_counts, "bytes": comm.ledger.take()}
    mesh.shutdown()
    return out


def test_dispatch_then_combine_is_the_identity_values_and_gradient(distributed):
    results = distributed.run(2, dispatch_then_combine)
    for r in results:
        assert r["local"] and r["values"] and r["grad"]
    assert results[0]["local_counts"] == [3 + 1, 0 + 4] and results[1]["local_counts"] == [2 + 0, 1 + 2]
    # rank 0 sends its 2 + 1 rows for experts 2, 3 twice (dispatch, the combine's gradient) and the
    # 1 + 4 rows rank 1 sent it back twice (combine, the dispatch's gradient), 8 fp32 each; and its
    # counts for rank 1's experts once (2 int64). Rank 1 the other way round.
    assert results[0]["bytes"] == results[1]["bytes"] == {"ep": (2 * 3 + 2 * 5) * 8 * 4 + 2 * 8}


# --- the gradients: ep=1 and ep=2 at the same dp; an expert without tokens ----------------------
SCALING = TINY + MOE + ["model.moe_bias_rate=0.01"]


def expert_gradients(overrides: tuple[str, ...]) -> dict:
    """One step's reduced gradients, full tensors, with expert 3 never chosen (its routing bias
    −100 in every layer); then the optimizer step and expert 3's Adam moments."""
    from threefold.configure import load_config
    from threefold.parallel.placements import full_tensors

    from equivalence import global_batches, my_micro_batches, new_engine

    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    for layer in engine.moe_layers():
        layer.expert_bias[3] = -100.0
    engine.forward_backward(my_micro_batches(global_batches(cfg, 1)[0], cfg, engine.dp_rank, engine.dp_size))
    experts = [k for k in engine.shapes if ".experts." in k]
    shards = engine.grad_shards()
    found = {s.name for s in shards}
    grads = full_tensors(shards, {f"grad/{k}": engine.shapes[k] for k in experts}, engine.mesh, engine.comm)
    routed = engine.end_moe_step(update_bias=False)["tokens_per_expert"]
    engine.optimizer_step(cfg.train.lr)
    moments = full_tensors(engine.moment_shards(), {f"{m}/{k}": engine.shapes[k] for k in experts
                                                    for m in ("exp_avg", "exp_avg_sq")}, engine.mesh, engine.comm)
    engine.shutdown()
    return {"grads": grads, "held": found, "routed": routed, "moments": moments, "experts": experts}


@pytest.mark.parametrize("dp, zero", [(2, 0), (2, 1), (4, 1)])  # dp4: the experts reduced over edp = 2
def test_expert_gradients_are_the_same_for_ep1_and_ep2_and_zero_for_an_unused_expert(distributed, dp, zero):
    layout = SCALING + [f"parallel.dp={dp}", f"parallel.zero={zero}"]
    ep1 = distributed.run(dp, expert_gradients, tuple(layout))
    ep2 = distributed.run(dp, expert_gradients, tuple(layout + ["parallel.ep=2"]))
    assert ep1[0]["routed"]["min"] == 0 and ep2[0]["routed"]["min"] == 0  # expert 3 got no tokens
    for name, want in ep1[0]["grads"].items():
        assert want.norm() > 0
        for r in ep2:  # the same on every rank; ep times too large would be off by 100 %
            got = r["grads"][name]
            assert (got - want).norm() <= 1e-5 * want.norm(), name
            assert got[3].abs().max() == 0 and got[:3].abs().sum() > 0, name  # zero, and there
    for r in ep2:  # ep rank 1 holds experts 2 and 3: expert 3's gradient is a tensor (of zeros), not None
        assert any(f"grad/{k}" in r["held"] for k in r["experts"])
        for name, moment in r["moments"].items():  # its Adam state exists and saw a zero gradient
            assert moment[3].abs().max() == 0 and moment[:3].abs().sum() > 0, name
            assert torch.equal(moment, ep2[0]["moments"][name])


# --- bytes: the formula, exactly -------------------------------------------------------------------
BYTES = TINY + MOE + ["parallel.dp=2", "parallel.ep=2"]


def ep_step_bytes(overrides: tuple[str, ...], round_robin: bool) -> dict:
    """One step's "ep" bytes of this rank, and the per-expert counts of every MoE call it made
    (recorded before the dispatch, recomputed forwards included)."""
    from threefold.configure import load_config

    from equivalence import global_batches, my_micro_batches, new_engine

    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    calls = []
    for layer in engine.moe_layers():
        layer.routing = "round_robin" if round_robin else "learned"
        layer.experts.register_forward_pre_hook(lambda m, args: calls.append(args[1].tolist()), prepend=True)
    engine.comm_bytes()
    engine.forward_backward(my_micro_batches(global_batches(cfg, 1)[0], cfg, engine.dp_rank, engine.dp_size))
    out = {"bytes": engine.comm_bytes(), "calls": calls, "ep_rank": engine.mesh.coord("ep"),
           "microbatches": cfg.microbatches}
    engine.shutdown()
    return out


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_round_robin_bytes_equal_the_planner_formula(distributed, recompute):
    from threefold.plan.costs import ep_bytes_per_step

    results = distributed.run(2, ep_step_bytes, tuple(BYTES + [f"train.recompute={recompute}"]), True)
    predicted = ep_bytes_per_step(tokens=2 * 32, top_k=2, hidden=64, ep=2, moe_layers=4,
                                  microbatches=results[0]["microbatches"], num_experts=4, recompute=recompute)
    assert predicted > 0
    for r in results:
        assert r["bytes"]["ep"] == predicted


def test_bf16_sends_bf16_rows_and_trains_like_one_process_in_bf16(distributed):
    from threefold.plan.costs import ep_bytes_per_step

    bf16 = BYTES + ["train.dtype=bfloat16"]
    results = distributed.run(2, ep_step_bytes, tuple(bf16), True)
    assert results[0]["bytes"]["ep"] == ep_bytes_per_step(tokens=2 * 32, top_k=2, hidden=64, ep=2, moe_layers=4,
                                                          microbatches=results[0]["microbatches"], num_experts=4,
                                                          dtype_bytes=2)
    trained, ref = case(distributed, bf16), reference(bf16)
    for r in trained:  # bf16 rounds differently in another summation order: close, not equal
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-2)


def test_learned_routing_bytes_equal_the_formula_on_the_recorded_splits(distributed):
    results = distributed.run(2, ep_step_bytes, tuple(BYTES), False)
    assert len(results[0]["calls"]) == len(results[1]["calls"]) == 4 * results[0]["microbatches"]
    row_bytes, counts_bytes = 64 * 4, (2 - 1) * 4 // 2 * 8
    uneven = False
    for r in results:
        me, other = r["ep_rank"], results[1 - r["ep_rank"]]
        mine = range(2 * me, 2 * me + 2)
        sent = sum(c for call in r["calls"] for e, c in enumerate(call) if e not in mine)
        received = sum(c for call in other["calls"] for e, c in enumerate(call) if e in mine)
        uneven |= sent != received
        # dispatch and the combine's gradient send my rows for the other rank's experts; combine
        # and the dispatch's gradient send back the rows it sent me; the counts once per call
        assert r["bytes"]["ep"] == 2 * (sent + received) * row_bytes + len(r["calls"]) * counts_bytes
    assert uneven  # learned routing is not round-robin: the formula is applied to real splits


# --- bad input: one line, before any process starts --------------------------------------------
@pytest.mark.parametrize("sets, message", [
    (["parallel.dp=2", "parallel.ep=2"], "parallel.ep: 2 needs a Mixture-of-Experts model (model.moe_experts is 0)"),
    (MOE + ["parallel.dp=4", "parallel.ep=4", "model.moe_experts=6"],
     "parallel.ep: 4 does not divide model.moe_experts=6 (each rank holds whole experts)"),
    (MOE + ["parallel.dp=3", "parallel.ep=2", "train.global_batch=12"],
     "parallel.ep: 2 does not divide parallel.dp=3 (expert parallelism splits the experts over data-parallel "
     "ranks; parallel.expert_tp = 1 folds them over tp and cp too)"),
    # folding the ep group over tp and cp (parallel.expert_tp = 1)
    (MOE + ["parallel.expert_tp=2", "parallel.tp=2"], "parallel.expert_tp: must be 0 (experts whole on every tp "
     "rank) or 1 (the ep group folded over tp and cp); the engine does not split experts over tp, got 2"),
    (MOE + ["parallel.expert_tp=1", "parallel.dp=2"],
     "parallel.expert_tp: 1 folds the expert-parallel group over tp and cp; it needs parallel.ep > 1"),
    (MOE + ["parallel.expert_tp=1", "parallel.tp=4", "parallel.ep=2", "parallel.sequence_parallel=true"],
     "parallel.ep: folded over tp and cp (parallel.expert_tp = 1), ep=2 must be a multiple of tp·cp = 4"),
    (MOE + ["parallel.expert_tp=1", "parallel.tp=2", "parallel.ep=2"],
     "parallel.expert_tp: folding the experts over tp routes each tp rank's own positions; it needs "
     "parallel.sequence_parallel = true (as Megatron-Core's MoE under tp does)"),
    (MOE + ["parallel.expert_tp=1", "parallel.tp=2", "parallel.dp=3", "parallel.ep=4", "train.global_batch=12",
            "parallel.sequence_parallel=true"],
     "parallel.ep: folded over tp·cp = 2, ep=4 takes 2 dp ranks, which does not divide parallel.dp=3"),
    (MOE + ["parallel.expert_tp=1", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3",
            "parallel.dp_shard=2", "parallel.sequence_parallel=true"],
     "parallel.dp_shard: hybrid sharding with the ep group folded over tp and cp (parallel.expert_tp = 1) is not "
     "supported; use expert_tp 0 or dp_shard 0"),
    (MOE + ["parallel.expert_tp=1", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true",
            "model.moe_shared_experts=1", "model.moe_ffn=33"],
     "model.moe_shared_experts: folded over tp (parallel.expert_tp = 1) the shared experts are split over tp=2, "
     "which does not divide their width 33 (moe_shared_experts · moe_ffn)"),
])
def test_bad_expert_parallel_layouts_are_refused_in_one_line(sets, message):
    from threefold.config import ConfigError
    from threefold.configure import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, TINY + sets)
    assert str(err.value) == message


# --- checkpoints: full tensors, resharded to another ep ----------------------------------------
CHECKPOINT = TINY + MOE + BIAS


def checkpoint_segment(layout: tuple[str, ...], folder: str, start: int, steps: int) -> dict:
    """Resume from ``folder``'s checkpoint of step ``start`` (if any), train ``steps`` steps, save."""
    from threefold.configure import load_config
    from threefold.train import checkpoint

    from equivalence import global_batches, new_engine, train_steps

    cfg = load_config(None, CHECKPOINT + list(layout))
    engine = new_engine(cfg)
    if start:
        checkpoint.load(checkpoint.step_dir(folder, start), engine, cfg)
    out = train_steps(engine, cfg, global_batches(cfg, start + steps)[start:])
    checkpoint.save(folder, start + steps, engine, cfg, sampler_state={})
    out["state"] = engine.model_state_dict()
    engine.shutdown()
    return out


@pytest.mark.parametrize("saved_on, resumed_on", [
    (("parallel.dp=2", "parallel.ep=2", "parallel.zero=1"), ("parallel.dp=4", "parallel.ep=4")),
    # hybrid sharding: the dense chunks of each ep pair and the experts' whole, replicated over the pairs
    (("parallel.dp=4", "parallel.ep=2", "parallel.zero=3", "parallel.dp_shard=2"),
     ("parallel.dp=2", "parallel.ep=2", "parallel.zero=1")),
    # the ep group folded over tp (each tp rank one expert pair) to ep within dp, and back
    (("parallel.dp=2", "parallel.tp=2", "parallel.ep=4", "parallel.expert_tp=1", "parallel.sequence_parallel=true",
      "parallel.zero=1"), ("parallel.dp=2", "parallel.ep=2", "parallel.zero=3")),
    (("parallel.dp=4", "parallel.ep=4"), ("parallel.tp=2", "parallel.ep=2", "parallel.expert_tp=1",
                                          "parallel.sequence_parallel=true")),
], ids=["dp2-ep2-to-dp4-ep4", "dp4-ep2-hsdp2-to-dp2-ep2", "folded-tp2-ep4-to-dp2-ep2", "dp4-ep4-to-folded-tp2-ep2"])
def test_a_checkpoint_resumes_on_another_expert_layout(distributed, tmp_path, saved_on, resumed_on):
    from threefold.configure import load_config
    from threefold.train import checkpoint

    from equivalence import train_reference

    def world(overrides):  # dp·tp ranks: ep splits them
        return load_config(None, CHECKPOINT + list(overrides)).parallel.world_size

    _, uninterrupted = train_reference(load_config(None, CHECKPOINT), 4)
    distributed.run(world(saved_on), checkpoint_segment, saved_on, str(tmp_path), 0, 2)
    saved = checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 2))
    assert saved["model/blocks.0.mlp.experts.w_up"].shape == (4, 32, 64)  # full tensors, whatever the ep
    resumed = distributed.run(world(resumed_on), checkpoint_segment, resumed_on, str(tmp_path), 2, 2)
    for r in resumed:
        assert r["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-6)
    for key, want in uninterrupted["state"].items():
        assert (resumed[0]["state"][key] - want).norm() <= 1e-4 * want.norm().clamp_min(1e-12), key
    assert any(v.abs().sum() > 0 for k, v in uninterrupted["state"].items() if k.endswith("expert_bias"))


# --- the trainer's metrics file under dp2·ep2 --------------------------------------------------
def test_training_dp2_ep2_writes_global_moe_metrics_and_ep_bytes(tmp_path, corpus, distributed):  # noqa: F811
    import json

    from threefold.data import prepare_dataset

    from test_train import config, train_rank

    cfg = config(tmp_path, corpus, "train.steps=3", "train.threads=1", *MOE, "model.moe_capacity_factor=1.0",
                 "model.moe_bias_rate=0.01", "parallel.dp=2", "parallel.ep=2")
    prepare_dataset(cfg.data, cfg.model.seq_len, progress=False)  # once, before the ranks read it
    metrics = tmp_path / "m.jsonl"
    distributed.run(2, train_rank, cfg, str(metrics), timeout=240)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    routed = cfg.model.layers * cfg.train.global_batch * cfg.model.seq_len * 2  # both ranks' tokens, top-2
    for r in records:
        per_expert = r["moe"]["tokens_per_expert"]
        assert per_expert["mean"] * 4 * cfg.model.layers == pytest.approx(routed)
        assert per_expert["min"] <= per_expert["mean"] <= per_expert["max"]
        assert 0 <= r["moe"]["dropped"] < routed and r["moe"]["aux_loss"] > 0
        assert r["comm_bytes"]["ep"] > 0 and r["comm_bytes"]["dp.moe"] > 0
    # compare prices rank 0 as the dry run does (E/ep experts, their states over edp): exact states;
    # the learned routing's ep bytes beside the round-robin formula
    from threefold.plan.compare import compare_run

    rows = {row.quantity: row for row in compare_run(cfg, metrics)}
    for kind in ("params", "grads", "optimizer"):
        assert rows[f"memory: {kind}"].ratio == 1.0, rows[f"memory: {kind}"]
    assert rows["bytes/step: ep"].predicted > 0 and rows["bytes/step: ep"].measured > 0


# --- the dry run: Mixtral-8x7B at ep8, one rank, against the planner ----------------------------
MIXTRAL_EP8 = ["model.preset=mixtral-8x7b", "model.seq_len=4096", "parallel.dp=8", "parallel.ep=8",
               "parallel.zero=1", "train.global_batch=8", "train.micro_batch=1"]


def test_dryrun_of_mixtral_8x7b_at_ep8_equals_the_planner():
    from threefold.configure import load_config
    from threefold.plan.costs import ep_bytes_per_step
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config, dry_run_rank

    cfg = dry_run_config(load_config(None, MIXTRAL_EP8), 8)
    result = dry_run_rank(cfg, 0)
    # round-robin routing: every rank's experts get 1/8 of the 4096·2 assignments of each layer
    assert result["comm_bytes"]["ep"] == ep_bytes_per_step(tokens=4096, top_k=2, hidden=4096, ep=8, moe_layers=32,
                                                           microbatches=1, num_experts=8)
    want = predict_rank(cfg, 0)
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    assert set(want["comm_bytes"]) == {"dp", "ep"}


# Megatron-Core's grid at expert-tp 1 (parallel.expert_tp = 1): the ep group folded over tp and cp
MIXTRAL_FOLDED = ["model.preset=mixtral-8x7b", "model.seq_len=4096", "parallel.tp=2", "parallel.dp=4", "parallel.ep=8",
                  "parallel.expert_tp=1", "parallel.sequence_parallel=true", "parallel.zero=1",
                  "train.global_batch=8", "train.micro_batch=1"]


def test_dryrun_of_mixtral_8x7b_with_ep8_folded_over_tp2_equals_the_planner():
    """tp 2 · dp 4, ep 8 over both: each rank holds one expert a layer (not one per tp rank pair's
    four dp ranks, as ep within dp would), dispatches its own 2,048 positions' rows, and sends
    nothing on tp to route them; states, ep, tp and dp bytes are the planner's at expert-tp 1."""
    from threefold.configure import load_config
    from threefold.models.sizes import rank_expert_param_count
    from threefold.plan.costs import ep_bytes_per_step
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config, dry_run_rank

    cfg = dry_run_config(load_config(None, MIXTRAL_FOLDED), 8)
    result, want = dry_run_rank(cfg, 7), predict_rank(cfg, 7)
    assert result["comm_bytes"]["ep"] == ep_bytes_per_step(tokens=2048, top_k=2, hidden=4096, ep=8, moe_layers=32,
                                                           microbatches=2, num_experts=8)
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    assert set(want["comm_bytes"]) == {"dp", "ep", "tp", "tp.loss", "tp.routing"}  # the balance loss's counts
    # one expert a layer on every rank: its fp32 weights, 32 × 3·4096·14336, in the params
    assert result["memory"]["params"] > 32 * rank_expert_param_count(cfg.model, 8) * 4


# Each folded layout at world 8 on fake tensors, every rank of the first and the last stage. The
# activations an MoE block adds are estimated (dryrun_predict): within 0.01% here.
FOLDED_DRY_RUNS = {
    "tp2-dp4-ep4-zero1": ["parallel.tp=2", "parallel.dp=4", "parallel.ep=4", "parallel.zero=1"],
    "tp2-dp4-ep2-shared-aux": ["parallel.tp=2", "parallel.dp=4", "parallel.ep=2", "model.moe_shared_experts=1",
                               "model.moe_aux_loss_coef=0.01"],
    "tp2-cp2-dp2-ep8-shared-zero3-full": ["parallel.tp=2", "parallel.cp=2", "parallel.dp=2", "parallel.ep=8",
                                          "parallel.zero=3", "train.recompute=full", "model.moe_shared_experts=1"],
    "pp2-tp2-dp2-ep4-zb-h1": ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.ep=4",
                              "parallel.schedule=zb-h1"],
    "cp2-dp4-ep4-aux": ["parallel.cp=2", "parallel.dp=4", "parallel.ep=4", "model.moe_aux_loss_coef=0.01"],
    # bf16 autocast: the router's fp32 input is this rank's shard, the shared experts copy w_down alone
    "tp2-dp4-ep4-shared-bf16-overlap": ["parallel.tp=2", "parallel.dp=4", "parallel.ep=4", "model.moe_shared_experts=1",
                                        "train.dtype=bfloat16", "parallel.tp_overlap=true"],
    "pp2-tp2-dp2-ep4-shared-bf16-zb-h1": ["parallel.pp=2", "parallel.tp=2", "parallel.dp=2", "parallel.ep=4",
                                          "model.moe_shared_experts=1", "train.dtype=bfloat16",
                                          "parallel.schedule=zb-h1"],
}


@pytest.mark.parametrize("name", list(FOLDED_DRY_RUNS))
def test_a_folded_layouts_dry_run_equals_the_planner(name):
    from threefold.configure import load_config
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config

    from equivalence import dry_run

    overrides = ['model.preset="tiny"', "model.vocab_size=256", "model.seq_len=32", "model.layers=4",
                 "model.moe_experts=8", "model.moe_top_k=2", "model.moe_aux_loss_coef=0", "parallel.expert_tp=1",
                 "train.global_batch=16", "train.micro_batch=2"] + FOLDED_DRY_RUNS[name]
    if "parallel.tp=2" in overrides:
        overrides.append("parallel.sequence_parallel=true")
    cfg = load_config(None, overrides)
    world = cfg.parallel.world_size
    cfg = dry_run_config(cfg, world)
    for rank in sorted({0, world - 1}):
        got, want = dry_run(cfg, rank), predict_rank(cfg, rank)
        for key in ("params", "grads", "optimizer"):
            assert got["memory"][key] == want["memory"][key], key
        assert got["memory"]["activations"] == pytest.approx(want["memory"]["activations"], rel=1e-4)
        for key, value in want["comm_bytes"].items():
            assert got["comm_bytes"][key] == value, key
        assert want["comm_bytes"]["ep"] > 0
        # the routing statistics over the ranks that route shares of a micro-batch, where it has any
        shares = "+".join(a for a in ("cp", "tp") if getattr(cfg.parallel, a) > 1)
        assert (f"{shares}.routing" in want["comm_bytes"]) == (cfg.model.moe_aux_loss_coef > 0)
