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


# ---- Mixture-of-Experts: parameters, FLOPs, memory, time ---------------------------------------

import dataclasses
import json

from threefold.cli import main
from threefold.config import ModelConfig
from threefold.models.presets import get_preset
from threefold.models.sizes import is_moe_layer
from threefold.plan import context, search
from threefold.plan.hardware import CATALOG

H100 = CATALOG["h100-sxm"]
MIXTRAL = get_preset("mixtral-8x7b")


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_moe_parameters_are_the_modules_total_and_the_top_k_active():
    from threefold.models.llama import Llama

    cfg = ModelConfig(layers=3, hidden=32, heads=4, kv_heads=2, ffn=64, vocab_size=50, seq_len=16, moe_experts=4,
                      moe_top_k=2, moe_ffn=24, moe_shared_experts=1, moe_first_dense=1)
    assert costs.param_count(cfg) == sum(p.numel() for p in Llama(cfg).parameters())
    # Active, by hand: 2 MoE layers each run 2 of 4 routed experts (3·32·24 each) besides the rest.
    assert costs.active_param_count(cfg) == costs.param_count(cfg) - 2 * 2 * 3 * 32 * 24
    assert costs.active_param_count(MIXTRAL) / 1e9 == pytest.approx(12.88, abs=0.005)
    assert costs.param_count(MIXTRAL) / 1e9 == pytest.approx(46.70, abs=0.005)


def test_moe_model_flops_count_the_active_parameters():
    """MFU's FLOPs: 6 · (active − lookup table) + 12·L·s·q per token; a dense peer of equal active
    width computes the same but for the routers."""
    cfg = MIXTRAL
    active_matmul = costs.active_param_count(cfg) - cfg.vocab_size * cfg.hidden  # untied: only the input table
    assert costs.model_flops_per_token(cfg) == 6 * active_matmul + 12 * cfg.layers * cfg.seq_len * cfg.hidden
    dense_peer = dataclasses.replace(cfg, moe_experts=0, moe_top_k=None, ffn=2 * cfg.ffn_hidden)
    routers = cfg.layers * cfg.moe_experts * cfg.hidden
    assert costs.model_flops_per_token(cfg) - costs.model_flops_per_token(dense_peer) == 6 * routers
    # Full recomputation repeats the blocks' active forward: 2 · (active blocks) + attention.
    blocks = costs.active_param_count(cfg) - 2 * cfg.vocab_size * cfg.hidden - cfg.hidden
    assert costs.recompute_flops_per_token(cfg)[2] == 2 * blocks + costs.attention_flops_per_token(cfg)


@pytest.mark.parametrize("first_dense, every", [(0, 1), (3, 1), (1, 2), (2, 3)])
def test_moe_layers_below_counts_what_is_moe_layer_picks(first_dense, every):
    cfg = ModelConfig(layers=12, hidden=32, heads=4, moe_experts=4, moe_first_dense=first_dense, moe_every=every)
    n = np.arange(13)
    expected = [sum(is_moe_layer(cfg, layer) for layer in range(i)) for i in n]
    assert costs.moe_layers_below(cfg, n).tolist() == expected


def _mixtral(**layout):
    return costs.estimate(costs.Workload(MIXTRAL, 256), costs.Layout.named(**layout), H100)


def test_expert_states_are_split_over_ep():
    """Without ZeRO each rank holds E/ep of each MoE layer's experts: going from ep 1 to ep 8 frees
    7/8 of the experts' parameters (2 bytes each), exactly."""
    experts = MIXTRAL.layers * MIXTRAL.moe_experts * 3 * MIXTRAL.hidden * MIXTRAL.ffn_hidden
    one, eight = _mixtral(dp=8, ep=1), _mixtral(dp=8, ep=8)
    assert one["params_bytes"] - eight["params_bytes"] == pytest.approx(experts * 7 / 8 * costs.PARAM_BYTES)
    assert one["grads_bytes"] - eight["grads_bytes"] == pytest.approx(experts * 7 / 8 * 4)


def test_zero_shards_expert_states_over_the_expert_data_parallel_ranks():
    """ZeRO-1 shards the experts' optimizer states over the dp/ep ranks that hold the same experts:
    (E/ep experts) / (dp/ep ranks) = E/dp, whatever ep; ZeRO-3 the parameters too."""
    for zero in (1, 3):
        states = [_mixtral(dp=8, ep=ep, zero=zero)["optimizer_bytes"] for ep in (1, 2, 4, 8)]
        assert states == pytest.approx([states[0]] * 4)


def test_ep_bytes_and_time_in_the_estimate():
    est = _mixtral(dp=8, pp=2, ep=4, micro_batch=2)
    tokens, m = 2 * MIXTRAL.seq_len, 256 / (8 * 2)
    expected = costs.ep_bytes_per_step(tokens, 2, MIXTRAL.hidden, 4, MIXTRAL.layers // 2, m, 8, dtype_bytes=2)
    assert est["ep_bytes"] == pytest.approx(expected)
    assert est["ep_exposed_s"] == est["ep_s"] > 0  # every all-to-all sits between the products
    assert _mixtral(dp=8, ep=1)["ep_bytes"] == 0


def test_ep_across_nodes_pays_the_network():
    """EP=8 inside an 8-GPU node runs on NVLink; with tp=2 the same ep group spans two nodes and
    4 of its 7 peers are on the network: slower, by the bandwidths' ratio on those bytes."""
    inside, across = _mixtral(dp=8, ep=8), _mixtral(tp=2, dp=8, ep=8)
    assert across["ep_s"] > 3 * inside["ep_s"]
    sent = across["ep_bytes"] * 4 / 7  # to the ranks of the other node
    network = H100.inter_node_bw * H100.inter_link_efficiency
    rounds = 256 / 8 * MIXTRAL.layers * 5 * 7  # micro-batches × MoE layers × all-to-alls × (ep − 1) rounds
    assert across["ep_s"] == pytest.approx(sent / network + rounds * H100.inter_node_latency_s)


def test_dense_models_are_unchanged_by_the_moe_terms():
    work = costs.Workload(get_preset("llama3-8b"), 64)
    est = costs.estimate(work, costs.Layout.named(tp=2, dp=4, zero=1), H100)
    assert est["ep_bytes"] == est["ep_s"] == 0
    assert est["params_total"] == est["params_active"] == costs.param_count(work.model)


# ---- context parallelism: each method's bytes, their time, activations ----------------------------

LLAMA70 = get_preset("llama3-70b")


def _llama70(**layout):
    return costs.estimate(costs.Workload(LLAMA70, 64), costs.Layout.named(**layout), H100)


@pytest.mark.parametrize("method", context.METHODS)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_cp_bytes_are_plan_contexts_formula_per_layer(method, recompute):
    """The estimate's cp bytes: plan/context.py's per-layer bytes (the engine's, exact), for one tp
    rank's heads, times the stage's layers and the micro-batches."""
    cp, tp, pp, b = 4, 2, 4, 1
    est = _llama70(tp=tp, pp=pp, cp=cp, dp=2, micro_batch=b, cp_method=method, recompute=recompute)
    b_q, b_kv = context.qkv_bytes(b, LLAMA70.seq_len, LLAMA70.heads // tp, LLAMA70.n_kv_heads // tp,
                                  LLAMA70.head_dim, cp, bytes_per_element=2)
    per_layer = (context.cp_bytes_per_layer(method, cp, b_q, b_kv)
                 + context.recompute_bytes_per_layer(method, recompute, cp, b_q, b_kv))
    assert est["cp_bytes"] == pytest.approx(64 / 2 * (80 // pp) * per_layer)


def test_cp_bytes_by_hand():
    # One rank's 8192/4 tokens, 8 kv heads of 128, 16-bit: B_kv = 2·2048·8·128·2 = 8 MiB; tp 1.
    b_kv = 2 * 2048 * 8 * 128 * 2
    ring = _llama70(pp=8, cp=4, dp=8, cp_method="ring")
    allgather = _llama70(pp=8, cp=4, dp=8, cp_method="allgather")
    m, layers = 64 / 8, 10
    assert ring["cp_bytes"] == m * layers * (3 * 4 - 2) * b_kv
    assert allgather["cp_bytes"] == m * layers * 3 * (4 - 1) * b_kv


def test_the_ring_hides_behind_the_attention_the_others_do_not():
    ring = _llama70(pp=8, cp=4, dp=8, cp_method="ring")
    allgather = _llama70(pp=8, cp=4, dp=8, cp_method="allgather")
    assert allgather["cp_exposed_s"] == pytest.approx(allgather["cp_s"])
    assert ring["cp_exposed_s"] < ring["cp_s"]
    # What stays exposed of the ring within a node: the last hop of the key/value gradient home.
    b_kv = 2 * 2048 * 8 * 128 * 2
    hop = H100.intra_node_latency_s + b_kv / (H100.intra_node_bw * H100.intra_link_efficiency)
    assert ring["cp_exposed_s"] == pytest.approx(64 / 8 * 10 * hop)


def test_activations_are_divided_by_cp():
    """With flash attention a layer's activations are linear in its tokens: cp = 4 holds a quarter."""
    one, four = _llama70(pp=8, dp=8), _llama70(pp=8, dp=2, cp=4)
    assert four["block_activations_bytes"] == pytest.approx(one["block_activations_bytes"] / 4)


def test_search_covers_ep_and_the_cp_methods():
    work = costs.Workload(MIXTRAL, 256)
    layouts = search.candidate_layouts(work, 64, {"tp": 1, "pp": 1})
    assert set(np.unique(layouts.ep)) == {1, 2, 4, 8}
    # ep divides dp on the engine's placement, cp·dp where it is folded over cp (Megatron-Core's grid)
    engine = layouts.expert_tp == 0
    assert np.all(layouts.dp[engine] % layouts.ep[engine] == 0)
    assert np.all((layouts.cp * layouts.dp) % layouts.ep == 0) and np.all(layouts.expert_tp[~engine] == 1)
    grid = ~engine  # Megatron-Core's folding: where it differs from the engine's (ep over cp, or past dp)
    assert np.any(grid) and np.all((layouts.cp[grid] > 1) | (layouts.dp[grid] % layouts.ep[grid] > 0))
    with_cp = layouts.cp > 1
    assert set(np.unique(layouts.cp_method[with_cp])) == {0, 1, 2}
    # Dense models: ep stays 1.
    assert set(np.unique(search.candidate_layouts(costs.Workload(LLAMA70, 64), 64).ep)) == {1}


def test_plan_explains_ep_across_nodes():
    found = search.search(costs.Workload(MIXTRAL, 256), H100, 64, {"tp": 2, "pp": 1, "ep": 8, "cp": 1, "expert_tp": 2})
    i = int(found.order[0])
    assert found._phrase("ep_exposed", i).startswith("EP=8 crosses nodes: ")
    assert " of all-to-all per step" in found._phrase("ep_exposed", i)
    found = search.search(costs.Workload(LLAMA70, 64), H100, 64, {"cp": 4, "cp_method": "ring", "tp": 2})
    assert found._phrase("cp_exposed", int(found.order[0])).startswith("CP=4 ring within a node: ")


# ---- the commands --------------------------------------------------------------------------------

def test_estimate_moe_flags_and_json(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama3-8b", "--moe-experts", "8", "--moe-top-k", "2",
                       "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "8", "--ep", "8", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["layout"]["ep"] == 8 and result["comm"]["ep_bytes"] > 0
    cfg = dataclasses.replace(get_preset("llama3-8b"), moe_experts=8, moe_top_k=2)
    assert result["parameters"] == {"total": costs.param_count(cfg), "active": costs.active_param_count(cfg)}


MIXTRAL_FLAGS = ["--model", "mixtral-8x7b", "--global-batch", "256", "--gpu", "h100-sxm"]


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "24", "--ep", "3"], "--ep: 3 does not divide the 8 experts (--moe-experts)"),
    (["--dp", "4", "--ep", "8"], "--ep: 8 does not divide --dp 4"),
    (["--dp", "4", "--ep", "0"], "--ep: must be a positive integer, got 0"),
    (["--dp", "4", "--moe-top-k", "9"], "--moe-top-k: must be between 1 and --moe-experts 8, got 9"),
    (["--tp", "8", "--cp", "2", "--cp-method", "ulysses"], "--cp-method ulysses: --cp 2 does not divide the 1 "
                                                          "key/value head of one tp rank"),
    (["--cp", "3", "--seq-len", "4100"], "--cp: 3 does not divide half the sequence, 4100/2"),
])
def test_bad_moe_and_cp_input_is_one_line_and_exit_2(capsys, args, message):
    code, _, err = run(capsys, "estimate", *MIXTRAL_FLAGS, *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unknown_cp_method_is_refused(capsys):
    """click's own choice check, in one line like every other bad input, exit 2."""
    code, _, err = run(capsys, "estimate", *MIXTRAL_FLAGS, "--dp", "4", "--cp", "2", "--cp-method", "bogus")
    assert code == 2 and "Invalid value for '--cp-method': 'bogus' is not one of 'ring', 'allgather', 'ulysses'" in err
    assert len(err.strip().splitlines()) == 1 and "threefold estimate --help" in err, err


@pytest.mark.parametrize("flag", ["--moe-top-k", "--moe-ffn", "--moe-shared-experts"])
def test_moe_keys_without_experts_are_refused(capsys, flag):
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm",
                       flag, "2")
    assert code == 2 and f"{flag}: set without --moe-experts" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--dp", "2", "--ep", "2", "--global-batch", "64",
                       "--gpu", "h100-sxm")
    assert code == 2 and "--ep: 2 needs an MoE model (--moe-experts)" in err


def test_batch_lines_take_the_moe_and_cp_keys(capsys, tmp_path):
    lines = [{"model": "mixtral-8x7b", "num_gpus": 16, "ep": 8, "zero": 1},
             {"model": "llama3-8b", "moe_top_k": 2, "num_gpus": 8},
             {"model": "llama3-70b", "num_gpus": 64, "tp": 8, "cp": 2, "cp_method": "allgather", "zero": 1},
             {"model": "llama3-70b", "num_gpus": 64, "cp": 2, "cp_method": "zigzag"}]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    code, out, _ = run(capsys, "estimate", "--global-batch", "64", "--gpu", "h100-sxm", "--batch", str(path))
    results = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(results) == 4
    assert results[0]["layout"]["ep"] == 8 and results[0]["comm"]["ep_bytes"] > 0
    assert results[1] == {"error": "--moe-top-k: set without --moe-experts (a dense model)"}
    assert results[2]["layout"]["cp_method"] == "allgather" and results[2]["comm"]["cp_bytes"] > 0
    assert "cp_method" in results[3]["error"] and "zigzag" in results[3]["error"]


# ---- the dry run: one real step of a cp rank against the planner's figures for it --------------

@pytest.mark.parametrize("name", ["cp2-ring", "pp2-cp2-ring", "cp2-ulysses-full"])  # tp2·cp2·dp2: test_dryrun.py
def test_dry_run_of_a_cp_layout_equals_the_planner(name):
    from tests.equivalence import dry_run, dry_run_case
    from threefold.plan.dryrun_predict import predict_rank

    cfg = dry_run_case(name)  # the matrix's layout on fewer micro-batches, as test_dryrun.py runs it
    for rank in sorted({0, cfg.parallel.world_size - 1}):
        result, want = dry_run(cfg, rank), predict_rank(cfg, rank)
        for key in ("params", "grads", "optimizer"):
            assert result["memory"][key] == want["memory"][key], key
        assert "cp" in want["comm_bytes"]
        for key, value in want["comm_bytes"].items():
            assert result["comm_bytes"][key] == value, key


# ---- the dry run of MoE layouts ----------------------------------------------------------------

TINY_MOE = ["model.layers=4", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.vocab_size=250",
            "model.seq_len=32", "train.global_batch=16", "train.micro_batch=2", "model.moe_experts=4",
            "model.moe_top_k=2", "model.moe_ffn=32"]


@pytest.mark.parametrize("layout, rank", [
    (["parallel.dp=2", "parallel.ep=2"], 1),
    (["parallel.dp=4", "parallel.ep=2", "parallel.zero=1"], 3),
    (["parallel.dp=4", "parallel.ep=2", "parallel.zero=3"], 0),
    (["parallel.dp=2", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true"], 3),
    (["parallel.dp=2", "parallel.tp=2"], 0),
    (["parallel.dp=2", "parallel.ep=2", "parallel.pp=2"], 3),
    (["parallel.dp=2", "parallel.ep=2", "train.recompute=full", "model.moe_every=2"], 0),
    # the experts' ZeRO-3 units sit inside the recomputed block: gathered twice a micro-batch, not three times
    (["parallel.dp=4", "parallel.ep=2", "parallel.zero=3", "train.recompute=full"], 0),
    (["model.preset=mixtral-8x7b", "parallel.dp=8", "parallel.ep=8", "parallel.zero=1", "train.global_batch=8",
      "train.micro_batch=1", "train.dtype=bfloat16"], 7),
])
def test_dry_run_of_an_moe_layout_equals_the_planner(layout, rank):
    """States and bytes exact (dp, ep, tp, pp), activations within 0.5% in fp32 (0.3% at most: the
    routing's int64 bookkeeping is estimated, the rest counted to the byte); Mixtral 8x7B at
    ep8 in bf16 (its activations under autocast are above the planner's 16-bit count: not checked)."""
    from tests.equivalence import dry_run, few_micro_batches
    from threefold.configure import load_config
    from threefold.plan.dryrun_predict import predict_rank
    from threefold.train.dryrun import dry_run_config

    sizes = {"dp": 1, "tp": 1, "pp": 1}
    for item in layout:
        key, _, value = item.partition("=")
        if key in ("parallel.dp", "parallel.tp", "parallel.pp"):
            sizes[key.split(".")[1]] = int(value)
    if layout[0].startswith("model.preset"):
        overrides = layout
    else:  # the tiny MoE on 2 micro-batches a replica (2 × pp), as test_dryrun.py runs the matrix's layouts
        overrides = TINY_MOE + layout
        overrides.append(few_micro_batches(load_config(None, overrides)))
    cfg = dry_run_config(load_config(None, overrides), sizes["dp"] * sizes["tp"] * sizes["pp"])
    assert cfg.model.preset != "mixtral-8x7b" or cfg.model.moe_ffn_hidden == 14336
    result, want = dry_run(cfg, rank), predict_rank(cfg, rank)  # Mixtral's: test_dryrun.py's bf16 step too
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    if cfg.parallel.ep > 1:
        assert "ep" in want["comm_bytes"]
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    if cfg.train.dtype == "float32":
        assert result["memory"]["activations"] == pytest.approx(want["memory"]["activations"], rel=0.005)


def test_a_replicated_moe_block_has_only_the_attentions_tp_collectives():
    """In all-reduces of a micro-batch's activations: a dense Llama block 4 (SP 5); an MoE block,
    replicated over tp, 2 (SP 3½: the attention's 2½, and the block input's gather for the router
    and its gradient's reduce-scatter); recomputation the same 1 (SP 1½) for both."""
    dense = costs.tp_collectives_per_microbatch(4, False, "none")
    assert dense == 4 * 4 + 1 + 1
    assert costs.tp_collectives_per_microbatch(4, False, "none", moe_layers=3) == 4 + 3 * 2 + 1 + 1
    assert costs.tp_collectives_per_microbatch(4, True, "none", moe_layers=4) == 4 * 3.5 + 1 + 1.5
    assert costs.tp_collectives_per_microbatch(4, True, "full", moe_layers=4) == 4 * 5 + 1 + 1.5


def test_under_sp_a_tp_rank_runs_the_experts_on_its_own_positions():
    """tensor_parallel.SequenceSplitMoE: with sequence parallelism each of t tp ranks runs the
    experts and the shared experts on 1/t of the tokens (the router on all of them), where
    without SP every tp rank repeats the whole block's experts. So the experts' products, the
    rows each rank dispatches and the experts' saved tensors are 1/t of tp 1's, and the MoE
    blocks' gradients, partial sums over tp, are all-reduced once a step."""
    mixtral = costs.ModelConfig(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=32_000,
                                seq_len=4096, moe_experts=8, moe_top_k=2, moe_ffn=14336)
    gpu, work = CATALOG["h100-sxm"], costs.Workload(mixtral, 64)
    assert costs.moe_token_share(2, True) == 0.5 and costs.moe_token_share(2, False) == costs.moe_token_share(1, True) == 1

    def experts_gemm(tp, sp):
        parts = costs.part_seconds(work, costs.Layout.named(tp=tp, dp=8, ep=8, sequence_parallel=sp), gpu)
        return parts["moe_block"]["gemm"] - parts["block"]["gemm"]

    assert experts_gemm(2, True) == pytest.approx(experts_gemm(1, False) / 2, rel=0.05)  # the attention's thinner shards aside
    assert experts_gemm(2, False) > 0.9 * experts_gemm(1, False)  # without SP: repeated on both tp ranks
    one, split = (costs.estimate(work, costs.Layout.named(tp=tp, dp=8, ep=8, sequence_parallel=tp > 1, zero=1), gpu)
                  for tp in (1, 2))
    assert split["ep_bytes"] == pytest.approx(one["ep_bytes"] / 2, rel=1e-3)  # the counts' exchange aside
    assert split["mfu"] > 0.75 * one["mfu"]  # it was half of it while the experts were repeated
    # fp32 gradients of this rank's one expert of each of the 4 layers (no other dp rank holds it:
    # ep = dp) and of the router, whose ZeRO-1 shard is one of 8
    expert = 3 * 4096 * 14336
    assert split["tp_partial_bytes"] == pytest.approx(2 * (2 - 1) / 2 * 4 * 4 * (expert + 8 * 4096 / 8))


def test_the_moe_blocks_partial_gradients_are_the_engines():
    """The bytes the planner prices for summing the MoE blocks' partial gradients over tp once a
    step are what the engine's dry run sends under "tp.partial_grads", but for the norm gains'
    (2 a block and the final one, h each), which the planner leaves out."""
    from tests.equivalence import dry_run
    from threefold.configure import load_config
    from threefold.plan.compare import run_layout
    from threefold.train.dryrun import dry_run_config

    cfg = dry_run_config(load_config(None, TINY_MOE + ["parallel.tp=2", "parallel.sequence_parallel=true"]), 2)
    measured = dry_run(cfg, 0)["comm_bytes"]["tp.partial_grads"]
    norms = 2 * (2 - 1) / 2 * 4 * (2 * cfg.model.layers + 1) * cfg.model.hidden
    work, layout = run_layout(cfg)
    assert measured - norms == costs.estimate(work, layout, CATALOG["h100-sxm"])["tp_partial_bytes"] > 0


def test_an_moe_estimate_with_tp_but_without_sp_says_the_experts_repeat(capsys):
    from threefold import config

    config.note_once.cache_clear()  # once a process: an earlier test may have printed it
    args = ["estimate", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--num-gpus", "64", "--global-batch", "256",
            "--tp", "2", "--ep", "8", "--micro-batch", "1", "--json", "--expert-tp", "0"]  # the engine's placement
    assert main(args) == 0
    assert capsys.readouterr().err.strip() == (
        "note: without --sequence-parallel each of the --tp 2 ranks runs the experts on the whole sequence, "
        "repeating their work; with it each runs them on its own positions (Megatron-LM requires it for MoE under TP)")
    config.note_once.cache_clear()
    assert main(args + ["--sequence-parallel"]) == 0 and capsys.readouterr().err == ""
