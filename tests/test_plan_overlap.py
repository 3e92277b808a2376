"""Issue 16's planner inputs: the overlap switches, your own cluster (link bandwidths, a cluster
file), products timed by their shapes, and the pictures."""
import dataclasses
import math
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from threefold.cli import main
from threefold.models.presets import get_preset
from threefold.plan import costs, search
from threefold.plan.hardware import CATALOG, load_cluster, power_clock_scale

A100 = CATALOG["a100-80gb"]
GPT3 = ["--model", "gpt3-175b", "--global-batch", "1536", "--gpu", "a100-80gb", "--num-gpus", "1024"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def estimate(capsys, *args):
    code, out, err = run(capsys, "estimate", *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_no_overlap_dp_exposes_every_reduction(capsys):
    layout = [*GPT3, "--tp", "8", "--zero", "1"]
    on, off = estimate(capsys, *layout), estimate(capsys, *layout, "--no-overlap-dp")
    assert off["time_s"]["dp_exposed"] == pytest.approx(off["comm"]["dp_s"])
    assert on["time_s"]["dp_exposed"] < off["time_s"]["dp_exposed"]
    # what overlapping saves is the exposure less the contention the overlapped traffic costs (one
    # NIC a GPU across nodes here: a tenth of the NVLink rate's)
    assert 0 < on["time_s"]["contention"] < 0.1 * (on["comm"]["dp_s"] - on["time_s"]["dp_exposed"])
    # (and the slowest GPU's lag, a fixed share of each step)
    assert off["step_time_s"] - on["step_time_s"] == pytest.approx(
        off["time_s"]["dp_exposed"] - on["time_s"]["dp_exposed"] - on["time_s"]["contention"]
        + off["time_s"]["stragglers"] - on["time_s"]["stragglers"])


def test_tp_comm_overlap_hides_tp_behind_the_products(capsys):
    layout = [*GPT3, "--tp", "8", "--pp", "16", "--sequence-parallel"]
    plain, overlapped = estimate(capsys, *layout), estimate(capsys, *layout, "--tp-comm-overlap")
    assert plain["time_s"]["tp_exposed"] == pytest.approx(plain["comm"]["tp_s"])  # all exposed by default
    # With the GEMMs longer than the traffic, the rings hide all of theirs: what stays exposed is
    # the traffic with no product beside it, here the loss's all-reduces (the last of 16 stages
    # holds no embedding), their share of the bytes.
    model, b = get_preset("gpt3-175b"), 1
    loss = costs.tp_loss_bytes_per_step(1, b, model.seq_len, 8)
    blocks = costs.tp_bytes_per_step(model.layers // 16, 1, b, model.seq_len, model.hidden, 8, True, "none", 2,
                                     model.arch, embedding=False)
    assert overlapped["time_s"]["tp_exposed"] == pytest.approx(plain["comm"]["tp_s"] * loss / (loss + blocks))
    assert overlapped["comm"]["tp_bytes"] == plain["comm"]["tp_bytes"]
    # Without SP there is nothing to pipeline (Megatron-Core refuses --tp-comm-overlap without it).
    no_sp = [x for x in layout if x != "--sequence-parallel"]
    assert estimate(capsys, *no_sp, "--tp-comm-overlap")["step_time_s"] == estimate(capsys, *no_sp)["step_time_s"]


def test_the_pipeline_drain_hides_the_last_stages_reduction():
    work = costs.Workload(get_preset("gpt3-175b"), 64)
    layout = costs.Layout.named(tp=8, pp=8, dp=2)
    est = costs.estimate(work, layout, A100)
    no_drain = costs.estimate(costs.Workload(get_preset("gpt3-175b"), 64, overlap_dp=False), layout, A100)
    assert est["dp_exposed_s"] < no_drain["dp_exposed_s"]


def test_batch_keys_for_overlap_and_links(capsys, tmp_path):
    base = dict(model="gpt3-175b", global_batch=1536, gpu="a100-80gb", num_gpus=1024, tp=8, pp=16, zero=1,
                sequence_parallel=True)
    lines = [base, dict(base, overlap_dp=False), dict(base, tp_comm_overlap=True), dict(base, inter_node_gbps=400),
             dict(base, intra_node_gbps=4800), dict(base, inter_node_gbps=0)]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    code, out, _ = run(capsys, "estimate", "--batch", str(path))
    results = [json.loads(x) for x in out.splitlines()]
    assert code == 0 and len(results) == 6
    first = results[0]["step_time_s"]
    assert results[1]["step_time_s"] > first and results[2]["step_time_s"] < first
    assert results[3]["comm"]["dp_s"] < results[0]["comm"]["dp_s"]  # 400 Gb/s: DP crosses nodes faster
    assert results[4]["comm"]["tp_s"] < results[0]["comm"]["tp_s"]  # TP inside a node
    assert "inter-node-gbps: must be a positive number" in results[5]["error"]


@pytest.mark.parametrize("flag,value", [("--inter-node-gbps", "0"), ("--inter-node-gbps", "-200"),
                                        ("--intra-node-gbps", "nan"), ("--intra-node-gbps", "inf")])
def test_bad_bandwidth_is_one_line(capsys, flag, value):
    code, _, err = run(capsys, "estimate", *GPT3, flag, value)
    assert code == 2 and f"{flag}: must be a positive number" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags,message", [
    # so small or large that the cost model's step came out NaN or 300 digits long
    (["--intra-node-gbps", "5e-324"], "--intra-node-gbps: 5e-324 is outside what any GPU or link has (0.008 to 8e+06 "
                                      "Gbit/s per GPU)"),
    (["--inter-node-gbps", "1e300"], "--inter-node-gbps: 1e+300 is outside what any GPU or link has"),
    (["--power-limit-w", "0.7"], "--power-limit-w: 0.7 is outside what any GPU or link has (50 to 100000 W)"),  # kW?
])
def test_an_implausible_number_is_one_line(capsys, flags, message):
    code, _, err = run(capsys, "estimate", *GPT3, *flags, "--json")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_link_latency_matters_at_small_messages():
    """A tiny model's many small all-reduces: the ring's latency, not its bandwidth, sets the time."""
    tiny = costs.Workload(get_preset("tiny").__class__(layers=2, hidden=64, heads=4, vocab_size=320, seq_len=32), 8)
    layout = costs.Layout.named(dp=8)
    import dataclasses

    fast_links = dataclasses.replace(A100, inter_node_bw=A100.inter_node_bw * 100, intra_node_bw=A100.intra_node_bw * 100)
    slow_start = dataclasses.replace(A100, intra_node_latency_s=A100.intra_node_latency_s * 100)
    base = costs.estimate(tiny, layout, A100)["dp_s"]
    assert costs.estimate(tiny, layout, fast_links)["dp_s"] > 0.7 * base  # 100× the bandwidth: 23% faster
    assert costs.estimate(tiny, layout, slow_start)["dp_s"] > 50 * base  # latency does


CLUSTER = """
[gpu]
name = "h100-500w"
peak_tflops_bf16 = "800 TFLOP/s"
hbm_gib = 96
hbm_tb_s = 3.35
[node]
gpus_per_node = 8
intra_node_gbps = "450 GB/s"
inter_node_gbps = 400
"""


def test_cluster_file_describes_a_gpu_not_in_the_catalog(capsys, tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER)
    gpu = load_cluster(path)
    assert (gpu.name, gpu.peak_flops, gpu.hbm_bytes, gpu.intra_node_bw, gpu.inter_node_bw) == (
        "h100-500w", 800e12, 96 * 2**30, 450e9, 50e9)
    result = estimate(capsys, "--model", "llama3-8b", "--global-batch", "16", "--cluster", str(path), "--dp", "8",
                      "--zero", "3")
    reference = estimate(capsys, "--model", "llama3-8b", "--global-batch", "16", "--gpu", "h100-sxm", "--dp", "8",
                         "--zero", "3")
    assert result["step_time_s"] != reference["step_time_s"] and result["fits"]


def test_flash_attention_runs_at_flashattention2s_rate(tmp_path):
    """FlashAttention-2 at its best (Dao 2023): 335 TFLOP/s on an H100 and 73% of the A100's peak,
    counting a backward as 2.5 forwards; 287 and 195 TFLOP/s in the planner's count of 2. Eager
    attention's core (batched products and a softmax) runs at the GEMM rate."""
    work = costs.Workload(get_preset("llama3-8b"), 8)
    layout = costs.Layout.named(dp=8, micro_batch=1)
    h100 = CATALOG["h100-sxm"]
    core_flops = 1 * 8192 * 4 * 8192 * 4096 * 0.5  # one layer's causal forward, 8,192 tokens
    assert costs.part_seconds(work, layout, h100)["core"] == pytest.approx(core_flops / (335e12 * 3 / 3.5))
    assert costs.part_seconds(work, layout, A100)["core"] == pytest.approx(core_flops / (0.73 * 312e12 * 3 / 3.5))
    eager = costs.Workload(get_preset("llama3-8b"), 8, attention="eager")
    assert costs.part_seconds(eager, layout, A100)["core"] == pytest.approx(2 * core_flops / (312e12 * A100.matmul_efficiency))
    # A cluster file that runs a faster kernel says so: efficiency.attention (default 1).
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER.replace('"800 TFLOP/s"', "989") + "[efficiency]\nmatmul = 0.55\n")
    assert load_cluster(path).attention_efficiency == 1.0
    path.write_text(CLUSTER + "[efficiency]\nattention = 0.53\n")
    assert load_cluster(path).attention_efficiency == 0.53
    gemm_rate = dataclasses.replace(h100, attention_efficiency=1.0)
    slow, fast = (costs.estimate(work, layout, g)["step_time_s"] for g in (h100, gemm_rate))
    assert slow > fast


def test_a_power_limit_slows_the_products_by_the_clock_it_allows(tmp_path):
    """Dynamic power goes as the cube of the clock, so a 500 W limit on a part whose efficiency
    holds at 700 W runs its products at (5/7)^(1/3) = 0.894 of the rate; HBM and links keep theirs."""
    assert power_clock_scale(500, 700) == pytest.approx(0.8939, abs=1e-4)
    assert power_clock_scale(800, 700) == 1.0  # no faster than the rated clock
    path = tmp_path / "cluster.toml"
    efficiency = "[efficiency]\nmatmul = 0.55\n"
    path.write_text(CLUSTER + efficiency)
    rated = load_cluster(path)
    path.write_text(CLUSTER.replace("hbm_tb_s = 3.35", 'hbm_tb_s = 3.35\npower_limit_w = "0.5 kW"\nrated_power_w = 700')
                    + efficiency)
    capped = load_cluster(path)
    assert capped.matmul_efficiency == pytest.approx(0.55 * (500 / 700) ** (1 / 3))
    assert (capped.hbm_efficiency, capped.inter_link_efficiency) == (rated.hbm_efficiency, rated.inter_link_efficiency)
    work = costs.Workload(get_preset("llama3-8b"), 16)
    layout = costs.Layout.named(dp=8, zero=3, micro_batch=2)
    slow, fast = (costs.estimate(work, layout, gpu) for gpu in (capped, rated))
    assert slow["compute_s"] == pytest.approx(fast["compute_s"] / power_clock_scale(500, 700), rel=0.02)
    assert slow["step_time_s"] > fast["step_time_s"]


def test_power_limit_flag_holds_a_catalog_gpu_at_a_lower_clock(capsys):
    """--power-limit-w (batch key power_limit_w) on a catalog part uses its datasheet power: an
    H100 SXM at 500 W is the 700 W part's products at (5/7)^(1/3); bad watts are one line."""
    line = ["--model", "llama3-8b", "--global-batch", "16", "--dp", "8", "--zero", "3", "--micro-batch", "2"]
    full = estimate(capsys, *line, "--gpu", "h100-sxm")
    capped = estimate(capsys, *line, "--gpu", "h100-sxm", "--power-limit-w", "500")
    assert capped["step_time_s"] > full["step_time_s"]
    assert estimate(capsys, *line, "--gpu", "h100-sxm", "--power-limit-w", "700") == full
    h100 = CATALOG["h100-sxm"]
    assert h100.with_power_limit(500).matmul_efficiency == pytest.approx(h100.matmul_efficiency
                                                                         * power_clock_scale(500, 700))
    assert h100.with_power_limit(500).with_power_limit(700).matmul_efficiency == pytest.approx(h100.matmul_efficiency)
    for watts, message in (("0", "--power-limit-w: must be a positive number of watts"),
                           ("-300", "--power-limit-w: must be a positive number of watts")):
        code, _, err = run(capsys, "estimate", *line, "--gpu", "h100-sxm", "--power-limit-w", watts)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.replace('hbm_gib = 96\n', ''), "missing key gpu.hbm_gib"),
    (lambda t: t.replace('"800 TFLOP/s"', '"800 furlongs"'), "unknown unit in '800 furlongs'"),
    (lambda t: t.replace('"450 GB/s"', '"450 GiB"'), "unknown unit in '450 GiB'"),
    (lambda t: t.replace("hbm_tb_s = 3.35", "hbm_tb_s = 3.35e-9"), "gpu.hbm_tb_s: 3.35e-09 is outside what any GPU"),
    (lambda t: t.replace('inter_node_gbps = 400', 'inter_node_gbps = -1'), "must be positive"),
    (lambda t: t + "colour = 3\n", "unknown key node.colour"),
    (lambda t: t + "[efficiency]\nattention = 1.5\n", "efficiency.attention: must be in (0, 1]"),
    (lambda t: t + "[rack]\n", "unknown section [rack]"),
    (lambda t: t.replace("[gpu]", "[gpu"), "is not valid TOML"),
    (lambda t: t.replace("hbm_tb_s = 3.35", "hbm_tb_s = 3.35\npower_limit_w = 500"), "gpu.power_limit_w needs gpu.rated_power_w"),
    (lambda t: t.replace("hbm_tb_s = 3.35", 'hbm_tb_s = 3.35\npower_limit_w = "500 V"\nrated_power_w = 700'),
     "unknown unit in '500 V'"),
])
def test_bad_cluster_files_are_one_line(capsys, tmp_path, edit, message):
    path = tmp_path / "cluster.toml"
    path.write_text(edit(CLUSTER))
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--global-batch", "16", "--cluster", str(path))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_thin_products_run_below_the_large_gemm_rate():
    large = costs.matmul_seconds(8192, 12288, 12288, A100)
    assert large == pytest.approx(2 * 8192 * 12288**2 / (A100.peak_flops * A100.matmul_efficiency), rel=0.01)
    # A thin shard (hidden 256 over tp 8: n = 32) is memory-bound: far below the large-GEMM rate.
    thin = costs.matmul_seconds(2048, 256, 32, A100)
    rate = 2 * 2048 * 256 * 32 / thin
    assert rate < 0.3 * A100.peak_flops * A100.matmul_efficiency


def test_estimate_and_plan_draw_their_breakdown(capsys, tmp_path):
    out = tmp_path / "estimate.png"
    code, _, err = run(capsys, "estimate", *GPT3, "--tp", "8", "--pp", "16", "--out", str(out))
    assert code == 0 and out.stat().st_size > 10_000, err
    out = tmp_path / "plan.png"
    code, text, err = run(capsys, "plan", *GPT3, "--top", "3", "--out", str(out))
    assert code == 0 and out.stat().st_size > 10_000 and "drawn to" in text, err
    code, _, err = run(capsys, "plan", *GPT3, "--out", str(tmp_path / "plan.txt"))
    assert code == 2 and "--out: " in err and not (tmp_path / "plan.txt").exists()


def test_overlapped_nvlink_traffic_slows_the_compute_it_hides_behind():
    """MosaicML's MPT-13B on 8 H100 (FSDP): the gathers and reduce-scatters hide behind compute
    but cost overlap_slowdown seconds of it per second of their bytes at NVLink's rate, whatever
    link carries them; the rings' latency moves no bytes and costs nothing."""
    model = costs.ModelConfig(arch="gpt", layers=40, hidden=5120, heads=40, ffn=20480, vocab_size=50368, seq_len=2048)
    work = costs.Workload(model, 16)
    h100 = CATALOG["h100-sxm"]
    nvlink = h100.intra_node_bw * h100.intra_link_efficiency
    layout = costs.Layout.named(dp=8, zero=3, micro_batch=2)
    for gpu in (h100, h100.with_gpus_per_node(4)):  # one node; two of 4, over the members' NICs
        est = costs.estimate(work, layout, gpu)
        overlapped_share = (est["dp_s"] - est["dp_exposed_s"]) / est["dp_s"]
        assert overlapped_share > 0.5
        assert est["contention_s"] == pytest.approx(h100.overlap_slowdown * overlapped_share * est["dp_bytes"] / nvlink)
    # the same bytes on the two nodes' slower links (4 NICs: 180 GB/s against NVLink's 315), all
    # still hidden, cost the same
    one_node = costs.estimate(work, layout, h100)
    across = costs.estimate(work, layout, h100.with_gpus_per_node(4))
    assert across["dp_bytes"] == one_node["dp_bytes"]
    assert across["dp_s"] > 1.5 * one_node["dp_s"] and across["contention_s"] == pytest.approx(one_node["contention_s"], rel=1e-3)


@pytest.mark.parametrize("gpu, model, global_batch, num_gpus", [
    ("a100-80gb", dict(arch="gpt", layers=40, hidden=5120, heads=40, ffn=20480, vocab_size=50257, seq_len=2048), 512, 64),
    ("h100-sxm", dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128256, seq_len=8192), 2048,
     2048)])
def test_a_faster_network_never_slows_a_step(gpu, model, global_batch, num_gpus):
    """Every layout of a search, priced at 50 to 1600 Gbit/s a GPU: none is slower on the faster
    network. (Contention priced by overlapped seconds at the link's rate, latency included, made
    about 1 layout in 20 slower at 400 than at 200 Gb/s, by up to 12%.)"""
    work = costs.Workload(costs.ModelConfig(**model), global_batch)
    layouts = search.candidate_layouts(work, num_gpus)
    steps = [costs.estimate(work, layouts, CATALOG[gpu].with_links(None, gbps))["step_time_s"]
             for gbps in (50, 100, 200, 400, 800, 1600)]
    assert len(steps[0]) > 10_000
    for slower, faster in zip(steps, steps[1:]):
        assert (faster <= slower * (1 + 1e-12)).all()
    assert (steps[-1] < steps[0]).mean() > 0.5  # and the network matters to most of them
    # and inside a node: faster NVLink never slows a step either
    steps = [costs.estimate(work, layouts, CATALOG[gpu].with_links(gbps, None))["step_time_s"]
             for gbps in (1200, 2400, 3600, 7200)]
    for slower, faster in zip(steps, steps[1:]):
        assert (faster <= slower * (1 + 1e-12)).all()


def test_overlapping_the_data_parallel_traffic_never_exposes_more_than_all_of_it():
    """Every layout of a search with --overlap-dp against --no-overlap-dp: overlap never makes a
    step slower. (ZeRO-3's units that nothing hides were counted twice where the traffic outlasts
    the compute, once unhidden and once in the excess: 713 layouts of this search came out slower
    with overlap, by up to 11%.)"""
    work = costs.Workload(costs.ModelConfig(arch="gpt", layers=40, hidden=5120, heads=40, ffn=20480,
                                            vocab_size=50257, seq_len=2048), 512)
    layouts = search.candidate_layouts(work, 64)
    on, off = (costs.estimate(dataclasses.replace(work, overlap_dp=flag), layouts, A100) for flag in (True, False))
    assert (on["dp_exposed_s"] <= off["dp_exposed_s"] * (1 + 1e-12)).all()  # off: all of it, either stage's
    assert (on["step_time_s"] <= off["step_time_s"] * (1 + 1e-12)).all()
    comm_bound = on["dp_s"] > 2 * on["step_time_s"] - 2 * on["dp_exposed_s"]  # collectives outlast the compute
    assert comm_bound.sum() > 100  # the regime that was wrong is in the search


def test_zero3_exposes_the_root_units_gathers_and_the_first_blocks():
    """ZeRO-3 as parallel/fsdp.py runs it, unit by unit: per micro-batch the root unit (embedding,
    final norm, head) is gathered twice with nothing to hide behind, the first block once, and
    the first block's reduce-scatter waits for the embedding's gradient; once per step the root's
    reduce-scatter. A larger vocabulary grows only the root: the exposure grows by exactly two
    gathers and one reduce-scatter of the extra rows, at the ring's rate on this link."""
    h100 = CATALOG["h100-sxm"]
    dp, m, b = 16, 2, 16  # across nodes, so the ring's rate is the nodes' NICs'; compute hides the rest
    exposed = {}
    for vocab in (32_000, 128_000):
        model = costs.ModelConfig(layers=8, hidden=4096, heads=32, ffn=14336, vocab_size=vocab, seq_len=4096,
                                  tie_embeddings=False)
        work = costs.Workload(model, dp * m * b)
        est = costs.estimate(work, costs.Layout.named(dp=dp, zero=3, micro_batch=b), h100)
        assert est["dp_s"] < est["compute_s"]  # what hides behind compute stays hidden
        exposed[vocab] = est["dp_exposed_s"]
    extra = (dp - 1) / dp * 2 * (128_000 - 32_000) * 4096  # the elements each rank receives of the new rows
    # 8 members a node: their 8 NICs at once, capped by NVLink's rate (NVIDIA/nccl#812)
    per_byte = 1 / min(8 * h100.inter_node_bw * h100.inter_link_efficiency,
                       h100.intra_node_bw * h100.intra_link_efficiency)
    expected = (m * 2 * work.param_bytes + work.grad_bytes) * extra * per_byte
    assert exposed[128_000] - exposed[32_000] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("tp, dp, gpus_per_node, members", [(1, 16, 8, 8), (2, 16, 8, 4), (8, 4, 8, 1), (4, 8, 4, 1)])
def test_a_group_across_nodes_sends_over_its_members_nics(tp, dp, gpus_per_node, members):
    """NCCL runs a ring per NIC: a data-parallel group with k members in each node moves its bytes
    over their k NICs at once, never faster than NVLink (NVIDIA/nccl#812: 192 GB/s of all-reduce
    bus bandwidth across DGX A100 nodes, 8 HDR ports of 25). The same layout inside one node
    (gpus_per_node = all of them) differs only by the link, so without the rings' latency dp_s
    scales by the ratio of rates, exactly."""
    gpu = dataclasses.replace(A100, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    model = costs.ModelConfig(layers=8, hidden=4096, heads=32, ffn=14336, vocab_size=32_000, seq_len=4096)
    work = costs.Workload(model, 8 * dp)
    layout = costs.Layout.named(tp=tp, dp=dp, zero=1, micro_batch=1, sequence_parallel=tp > 1)
    inside = costs.estimate(work, layout, gpu.with_gpus_per_node(tp * dp))
    across = costs.estimate(work, layout, gpu.with_gpus_per_node(gpus_per_node))
    nvlink = gpu.intra_node_bw * gpu.intra_link_efficiency
    one_nic = gpu.inter_node_bw * gpu.inter_link_efficiency
    rate = min(members * one_nic, nvlink)
    assert across["dp_bytes"] == inside["dp_bytes"]
    assert across["dp_s"] == pytest.approx(inside["dp_s"] * nvlink / rate, rel=1e-9)


def test_tensor_parallel_across_nodes_uses_a_nodes_nics():
    """tp = 16 on nodes of 8: its ring crosses nodes over 8 NICs a node (180 GB/s on an A100's
    HDR ports at 0.9, under NVLink's 210), not one GPU's 22.5."""
    model = costs.ModelConfig(layers=8, hidden=8192, heads=64, ffn=28672, vocab_size=32_000, seq_len=4096)
    work = costs.Workload(model, 4)
    layout = costs.Layout.named(tp=16, micro_batch=1, sequence_parallel=True)
    gpu = dataclasses.replace(A100, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    inside = costs.estimate(work, layout, gpu.with_gpus_per_node(16))
    across = costs.estimate(work, layout, gpu)
    eight_nics = 8 * gpu.inter_node_bw * gpu.inter_link_efficiency
    assert across["tp_s"] == pytest.approx(inside["tp_s"] * gpu.intra_node_bw * gpu.intra_link_efficiency / eight_nics,
                                           rel=1e-9)


@pytest.mark.parametrize("tp, dp, gpus_per_node", [(8, 128, 8), (1, 64, 8), (2, 16, 8), (8, 2, 8), (1, 8, 8)])
def test_ddp_all_reduce_latency_is_the_ring_or_nccls_tree_whichever_is_shorter(tp, dp, gpus_per_node):
    """A DDP all-reduce over k members in each of n/k nodes: the ring pays 2(n − 1) steps (a
    network hop on one step in k), NCCL's double binary tree 2(log2(n/k) network hops + k − 1
    NVLink hops), and NCCL takes the shorter (src/graph/tuning.cc). dp_s is the bytes at the
    link's rate plus, per bucket, that latency: measured here as the difference between the GPU
    with its latencies and without them."""
    model = costs.ModelConfig(layers=8, hidden=4096, heads=32, ffn=14336, vocab_size=32_000, seq_len=4096)
    work = costs.Workload(model, 8 * dp)
    layout = costs.Layout.named(tp=tp, dp=dp, zero=0, micro_batch=1, sequence_parallel=tp > 1)
    gpu = A100.with_gpus_per_node(gpus_per_node)
    without = costs.estimate(work, layout, dataclasses.replace(gpu, intra_node_latency_s=0.0, inter_node_latency_s=0.0))
    est = costs.estimate(work, layout, gpu)
    numel = est["dp_bytes"] / (2 * (dp - 1) / dp * work.grad_bytes)  # DDP sends 2(n−1)/n of its gradients
    buckets = -(-numel // max(40e6, 1e6 * dp))  # Megatron-Core's default bucket: max(40M, 1M × dp) parameters
    k = min(max(gpus_per_node // tp, 1), dp)
    nodes, intra, inter = dp / k, gpu.intra_node_latency_s, gpu.inter_node_latency_s
    ring = 2 * (dp - 1) * (intra if nodes == 1 else (inter + (k - 1) * intra) / k)
    tree = 2 * (math.log2(nodes) * inter + (k - 1) * intra)
    assert est["dp_s"] - without["dp_s"] == pytest.approx(buckets * (min(ring, tree) if nodes > 1 else ring), rel=1e-9)
    if nodes >= 8:  # at scale the tree is the one taken: a ring's latency grows with n, the tree's with log n
        assert tree < ring / 4


def test_float8_runs_the_blocks_products_at_the_fp8_peak(capsys, tmp_path):
    """--dtype float8: the blocks' linear layers multiply fp8 operands at the fp8 peak (the same
    fraction of it as 16-bit products of theirs), each paying its casts at 4 bytes an element; the
    head, the router and the attention core stay 16-bit, and MFU still counts the 16-bit peak."""
    h100 = CATALOG["h100-sxm"]
    m = k = n = 8192
    arithmetic = 2 * m * k * n / (1979e12 * h100.matmul_efficiency)
    memory = (2 * m * k + 2 * m * n) / (h100.hbm_bw * h100.hbm_efficiency)  # one-byte operands, a 2-byte result
    assert costs.matmul_seconds(m, k, n, h100, float8=True) == pytest.approx(math.hypot(arithmetic, memory))
    assert costs.matmul_seconds(m, k, n, h100) / costs.matmul_seconds(m, k, n, h100, float8=True) > 1.95
    model, layout = get_preset("llama3-8b"), costs.Layout.named(dp=8, micro_batch=1)
    mixed = costs.part_seconds(costs.Workload(model, 8), layout, h100)
    fp8 = costs.part_seconds(costs.Workload(model, 8, precision="fp8"), layout, h100)
    assert fp8["head"] == mixed["head"] and fp8["core"] == mixed["core"]
    assert fp8["block"]["gemm"] < 0.6 * mixed["block"]["gemm"]
    rows, hbm = 8192, h100.elementwise_rate
    casts = sum(4 * (rows * k + k * n + rows * n) for k, n in costs.layer_products(model, 1)) / hbm
    assert fp8["block"]["memory"] - mixed["block"]["memory"] == pytest.approx(casts)
    # Transformer Engine casts a weight in the first micro-batch of a step and reuses it (Megatron's
    # set_is_first_microbatch): at 8 micro-batches each pays an eighth; under ZeRO-3 every
    # micro-batch gathers the weights anew and casts them again
    weights = sum(4 * k * n for k, n in costs.layer_products(model, 1)) / hbm
    for zero, share in ((1, 1 / 8), (3, 1.0)):
        eight = costs.Layout.named(dp=8, micro_batch=1, zero=zero)
        cached = costs.part_seconds(costs.Workload(model, 64, precision="fp8"), eight, h100)
        plain = costs.part_seconds(costs.Workload(model, 64), eight, h100)
        assert cached["block"]["memory"] - plain["block"]["memory"] == pytest.approx(casts - (1 - share) * weights)
    common = ["--model", "llama3-8b", "--global-batch", "64", "--num-gpus", "8", "--zero", "1"]
    bf16, f8 = (estimate(capsys, *common, "--gpu", "h100-sxm", "--dtype", d) for d in ("bf16", "fp8"))
    assert 1.1 < bf16["step_time_s"] / f8["step_time_s"] < 1.9  # products are most of the step, not all
    assert f8["mfu"] / bf16["mfu"] == pytest.approx(bf16["step_time_s"] / f8["step_time_s"])
    # a part without fp8 tensor cores, or the CPU, is refused in one line
    for gpu in ("a100-80gb", "local"):
        code, _, err = run(capsys, "estimate", *common, "--gpu", gpu, "--dtype", "float8")
        assert code == 2 and len(err.strip().splitlines()) == 1 and "float8" in err, err
    # a cluster file gives its part's fp8 peak; a batch line its dtype
    path = tmp_path / "cluster.toml"
    path.write_text(CLUSTER.replace("[node]", 'peak_tflops_fp8 = "1600 TFLOP/s"\n[node]'))
    assert load_cluster(path).peak_flops_fp8 == 1600e12
    assert estimate(capsys, *common, "--cluster", str(path), "--dtype", "fp8")["step_time_s"] < estimate(
        capsys, *common, "--cluster", str(path))["step_time_s"]
    (tmp_path / "rows.jsonl").write_text(json.dumps({"dtype": "FP8", "gpu": "h100-sxm"}) + "\n")
    code, out, _ = run(capsys, "estimate", *common, "--batch", str(tmp_path / "rows.jsonl"))
    assert code == 0 and json.loads(out)["step_time_s"] == pytest.approx(f8["step_time_s"])
    # a published run scored through --batch says its precision: an fp8 run's lines ask for float8
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import published_score

    row = next(r for r in published_score.json.loads(published_score.DATA.read_text()) if r["id"].startswith("mcore"))
    assert "dtype" not in published_score.batch_line(row)
    assert published_score.batch_line(dict(row, precision="FP8 (Transformer Engine)"))["dtype"] == "float8"


@pytest.mark.parametrize("tp, cp, dp, gpus_per_node", [(2, 4, 2, 8), (1, 8, 4, 8), (2, 2, 8, 4), (8, 2, 4, 8),
                                                       (1, 16, 2, 8)])
def test_context_parallel_ranks_share_the_replicas_nics(tp, cp, dp, gpus_per_node):
    """The gradients reduce over the dp × cp replicas, ranks tp apart whatever axis they are on:
    a node holds gpus_per_node / tp of them, its cp neighbours included. Counted without them,
    tp2·cp4·dp2 of Llama 3 8B reduced over one NIC a GPU: 3.8 times the time of tp2·dp8, whose
    replicas and bytes are the same."""
    model = costs.ModelConfig(layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128_256,
                              seq_len=8192)
    gpu = CATALOG["h100-sxm"].with_gpus_per_node(gpus_per_node)
    work = costs.Workload(model, 4 * cp * dp)
    with_cp = costs.estimate(work, costs.Layout.named(tp=tp, cp=cp, dp=dp, zero=1, micro_batch=1), gpu)
    without = costs.estimate(work, costs.Layout.named(tp=tp, dp=cp * dp, zero=1, micro_batch=1), gpu)
    assert with_cp["dp_bytes"] == without["dp_bytes"]
    assert with_cp["dp_s"] == pytest.approx(without["dp_s"], rel=1e-12)


def test_expert_replicas_skip_the_expert_parallel_ranks():
    """Experts reduce over edp × cp: in a node of 8 at tp 1, ep 4, dp 8 their 2 replicas are 4
    ranks apart, so the node holds both; at ep 8 each has its own node, and one NIC carries it."""
    assert costs.members_in_node(8, (1, 1), (4, 2)) == 2
    assert costs.members_in_node(8, (1, 1), (8, 2)) == 1
    assert costs.members_in_node(8, (2, 4), (8, 2)) == 4  # tp 2, cp 4: the node is one replica's cp ring
    assert costs.members_in_node(16, (2, 4), (8, 4)) == 8


def test_zero3_over_one_replica_is_plain_data_parallelism():
    """The engine runs ZeRO over one rank as DDP over one (train/engine.py): nothing is sharded, so
    nothing is gathered. The planner had added a gathered block, its gradient and the root unit."""
    model = costs.ModelConfig(layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128_256,
                              seq_len=8192)
    gpu, work = CATALOG["h100-sxm"], costs.Workload(model, 8)
    for recompute in ("none", "full"):
        zero0, zero3 = (costs.estimate(work, costs.Layout.named(tp=8, zero=zero, micro_batch=1, recompute=recompute),
                                       gpu) for zero in (0, 3))
        assert zero3["memory_bytes"] == zero0["memory_bytes"]


def test_zero3_gathers_no_next_block_on_a_stage_of_one():
    """ZeRO-3 holds the current block gathered and the next one prefetched, and the root unit
    (what is outside the blocks) unsharded. On stages of one block there is no next one: a stage
    holds its 1/8 shard plus all of itself gathered, once. The planner had added a second block."""
    model = costs.ModelConfig(layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=32_000,
                              seq_len=4096)
    gpu, work = CATALOG["h100-sxm"], costs.Workload(model, 64)
    zero2, zero3 = (costs.estimate(work, costs.Layout.named(pp=4, dp=8, micro_batch=1, zero=zero, reshard_after_forward=True),
                                   gpu)["params_bytes"] for zero in (2, 3))
    assert zero3 == pytest.approx(zero2 * (1 + 1 / 8), rel=1e-12)


def test_a_tp_group_across_two_nodes_is_priced_on_the_network(capsys):
    """tp 4 on nodes of 6 GPUs: ranks 4-7 straddle nodes 0 and 1, so their collectives cross the
    network and hold up the step; on nodes of 4 or 8 every group stays inside one."""
    tp_s = {}
    for per_node in (4, 6, 8):
        result = estimate(capsys, "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "24", "--global-batch",
                          "24", "--tp", "4", "--sequence-parallel", "--gpus-per-node", str(per_node))
        tp_s[per_node] = result["comm"]["tp_s"]
    assert tp_s[4] == tp_s[8] < tp_s[6]
    assert costs.in_one_node(np.array([4, 4, 8, 16]), 8).tolist() == [True, True, True, False]
    assert costs.in_one_node(np.array([4, 3, 2]), 6).tolist() == [False, True, True]
