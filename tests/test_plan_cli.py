"""`threefold estimate` and `threefold plan` as a user runs them: flags, JSON, errors, batch mode."""
import dataclasses
import json

import pytest

from threefold.cli import main
from threefold.models.presets import get_preset
from threefold.plan import costs
from threefold.plan.hardware import CATALOG

GPT3 = ["--model", "gpt3-175b", "--global-batch", "1536", "--gpu", "a100-80gb"]
GPT3_LAYOUT = [*GPT3, "--num-gpus", "1024", "--tp", "8", "--pp", "16", "--zero", "1"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_json_has_the_promised_keys(capsys):
    code, out, _ = run(capsys, "estimate", *GPT3_LAYOUT, "--micro-batch", "1", "--schedule", "1f1b", "--recompute",
                       "selective", "--sequence-parallel", "--json")
    assert code == 0
    result = json.loads(out)
    assert "tuned" not in result  # every knob given
    assert {"step_time_s", "mfu", "tflops_per_gpu", "tokens_per_s", "bubble_fraction", "fits"} <= set(result)
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(result["memory_gib"])
    assert {"dp_bytes", "tp_bytes", "pp_bytes", "dp_s", "tp_s", "pp_s", "exposed_s"} <= set(result["comm"])
    assert result["layout"]["dp"] == 8 and result["microbatches"] == 192
    assert result["bubble_fraction"] == pytest.approx(15 / (192 + 15))
    # The CLI is the cost model: the same numbers as calling it directly.
    direct = costs.estimate(costs.Workload(get_preset("gpt3-175b"), 1536),
                            costs.Layout.named(recompute="selective", tp=8, pp=16, dp=8, zero=1, sequence_parallel=True),
                            CATALOG["a100-80gb"])
    assert result["step_time_s"] == pytest.approx(direct["step_time_s"])


def test_estimate_tunes_the_micro_batch_and_schedule_it_is_not_given(capsys):
    """Left out, the micro-batch and (with a pipeline) the schedule are the fastest choice that
    fits, as a run's authors tune theirs: at least as fast as every other choice that fits, and
    as fast as the same layout given them; the JSON says which knobs were tuned, and stderr what
    was chosen."""
    layout = [*GPT3_LAYOUT, "--recompute", "selective", "--sequence-parallel"]
    code, out, err = run(capsys, "estimate", *layout, "--json")
    tuned = json.loads(out)
    assert code == 0 and tuned["tuned"] == ["micro_batch", "schedule", "virtual_stages"] and not err  # JSON: no note
    chosen = tuned["layout"]
    others = []
    for micro_batch in (1, 2, 4, 8):
        for schedule, virtual in (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
            code, out, _ = run(capsys, "estimate", *layout, "--micro-batch", str(micro_batch), "--schedule", schedule,
                               "--virtual-stages", str(virtual), "--json")
            others.append(json.loads(out))
    assert any(o["fits"] for o in others) and any(not o["fits"] for o in others)  # the choice is a real one
    assert tuned["tokens_per_s"] == max(o["tokens_per_s"] for o in others if o["fits"])
    given = next(o for o in others if all(o["layout"][k] == chosen[k] for k in ("micro_batch", "schedule",
                                                                                 "virtual_stages")))
    assert given["step_time_s"] == tuned["step_time_s"] and "tuned" not in given
    _, _, err = run(capsys, "estimate", *layout)
    assert err.strip() == (f"note: --micro-batch and --schedule not given: estimating --micro-batch "
                           f"{chosen['micro_batch']} --schedule {chosen['schedule']} --virtual-stages "
                           f"{chosen['virtual_stages']}, the fastest that fits, as a run tunes them; give them to "
                           "estimate another")
    # nothing fits: the leanest choice (micro-batch 1, 1F1B), reported as not fitting
    code, out, err = run(capsys, "estimate", *GPT3, "--num-gpus", "16", "--tp", "8", "--pp", "2", "--json")
    lean = json.loads(out)
    assert code == 0 and not lean["fits"] and lean["layout"]["micro_batch"] == 1 and lean["layout"]["schedule"] == "1f1b"


def test_estimate_model_flags_without_a_preset(capsys):
    args = ["estimate", "--arch", "gpt", "--layers", "96", "--hidden", "12288", "--heads", "96", "--vocab", "51200",
            "--seq-len", "2048", "--global-batch", "1536", "--gpu", "a100-80gb", "--tp", "8", "--pp", "16", "--dp", "8",
            "--zero", "1", "--json"]
    code, out, _ = run(capsys, *args)
    _, preset_out, _ = run(capsys, "estimate", *GPT3_LAYOUT, "--json")
    assert code == 0 and json.loads(out)["step_time_s"] == pytest.approx(json.loads(preset_out)["step_time_s"])


def test_estimate_tables(capsys):
    code, out, _ = run(capsys, "estimate", *GPT3_LAYOUT)
    assert code == 0
    for text in ("step time", "Where the step's time goes", "Memory per GPU", "Communication per GPU"):
        assert text in out


@pytest.mark.parametrize("args, message", [
    (["--num-gpus", "1000", "--tp", "8", "--pp", "16", "--dp", "8"], "not --num-gpus 1000"),
    (["--num-gpus", "1024", "--tp", "7", "--pp", "16"], "--num-gpus: 1024 is not divisible"),
    (["--tp", "7", "--pp", "16", "--dp", "8"], "--tp: 7 does not divide the 96 heads"),
    (["--tp", "8", "--pp", "128", "--dp", "1"], "more than the model's 96 layers"),
    (["--tp", "8", "--pp", "16", "--dp", "8", "--schedule", "interleaved", "--virtual-stages", "7"],
     "--pp: pp × virtual_stages = 16 × 7 = 112 stages, more than"),
])
def test_estimate_bad_layouts_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, "estimate", *GPT3, *args)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


TINY_PP = ["estimate", "--model", "tiny", "--vocab", "4096", "--layers", "5", "--global-batch", "16",
           "--gpu", "a100-80gb", "--pp", "2", "--micro-batch", "2", "--json"]


def test_stage_layers_prices_the_split_it_is_given(capsys):
    """--stage-layers is costs.estimate's stage_split: the same numbers, on the command line and
    in --batch; ceil(5/2) = 3 blocks a stage is what the default prices, so 3,2 is faster."""
    _, default_out, _ = run(capsys, *TINY_PP)
    code, out, _ = run(capsys, *TINY_PP, "--stage-layers", "3,2")
    assert code == 0
    work = costs.Workload(dataclasses.replace(get_preset("tiny"), vocab_size=4096, layers=5), 16)
    direct = costs.estimate(work, costs.Layout.named(pp=2, micro_batch=2), CATALOG["a100-80gb"], stage_split=(3, 2))
    split, default = json.loads(out), json.loads(default_out)
    assert split["step_time_s"] == pytest.approx(float(direct["step_time_s"]))
    assert split["step_time_s"] < default["step_time_s"]
    _, heavy_out, _ = run(capsys, *TINY_PP, "--stage-layers", "[4, 1]")
    assert json.loads(heavy_out)["step_time_s"] > split["step_time_s"]


@pytest.mark.parametrize("value, message", [
    ("3,3", "--stage-layers: 3,3 does not split 5 blocks over 2 stages"),
    ("5", "--stage-layers: 5 does not split 5 blocks over 2 stages"),
    ("3,x", "is not a list of block counts"),
    ("5,0", "every stage needs at least one block"),
])
def test_stage_layers_bad_input_is_one_line_and_exit_2(capsys, value, message):
    code, _, err = run(capsys, *TINY_PP, "--stage-layers", value)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    no_pipeline = TINY_PP[:TINY_PP.index("--pp")] + TINY_PP[TINY_PP.index("--pp") + 2:]
    code, _, err = run(capsys, *no_pipeline, "--stage-layers", "3,2")
    assert code == 2 and "--stage-layers: needs a pipeline" in err


def test_stage_layers_in_batch_mode(capsys, tmp_path):
    line = dict(model="tiny", vocab=4096, layers=5, global_batch=16, gpu="a100-80gb", pp=2, micro_batch=2)
    path = tmp_path / "split.jsonl"
    path.write_text("\n".join(json.dumps(dict(line, stage_layers=split)) for split in ([3, 2], "3,2", [3, 3])) + "\n")
    code, out, _ = run(capsys, "estimate", "--batch", str(path))
    first, second, bad = (json.loads(text) for text in out.splitlines())
    assert code == 0 and first["step_time_s"] == second["step_time_s"]
    assert "does not split 5 blocks" in bad["error"]


def test_unknown_gpu_and_missing_inputs(capsys):
    code, _, err = run(capsys, "estimate", "--model", "gpt3-175b", "--global-batch", "8", "--gpu", "v100")
    assert code == 2 and "--gpu: unknown GPU 'v100'" in err
    code, _, err = run(capsys, "estimate", "--layers", "4", "--global-batch", "8", "--gpu", "a100-80gb")
    assert code == 2 and "--hidden: required unless --model" in err
    code, _, err = run(capsys, "estimate", "--model", "gpt3-175b", "--gpu", "a100-80gb")
    assert code == 2 and "--global-batch: required" in err


def test_local_gpu_needs_a_calibrated_profile(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path))
    code, _, err = run(capsys, "estimate", "--model", "tiny", "--vocab", "4096", "--global-batch", "8", "--gpu", "local")
    assert code == 2 and "threefold calibrate" in err and len(err.strip().splitlines()) == 1
    profile = {"name": "local", "peak_flops_fp32": 1e11, "peak_flops_bf16": 2e11, "hbm_bytes": 24 * 2**30,
               "hbm_bw": 2e10, "intra_node_bw": 1e9, "inter_node_bw": 1e9, "latency_s": 3e-4, "gpus_per_node": 2,
               "threads": 1, "measured_at": "2026-01-01T00:00:00+00:00", "torch_version": "2.13.0"}
    (tmp_path / "local.json").write_text(json.dumps(profile))
    code, out, _ = run(capsys, "estimate", "--model", "tiny", "--vocab", "4096", "--global-batch", "8", "--gpu", "local",
                       "--dp", "2", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["fits"] and result["mfu"] > 0
    # The measured rates are achieved rates: the math takes FLOPs / measured peak exactly.
    assert result["time_s"]["compute"] > 0 and result["comm"]["dp_s"] > 0
    code, out, _ = run(capsys, "estimate", "--list-gpus")
    assert "local" in out and "not measured yet" not in out


def test_list_gpus(capsys):
    code, out, _ = run(capsys, "estimate", "--list-gpus")
    assert code == 0
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "mi300x"):
        assert name in out
    h100 = next(line.split() for line in out.splitlines() if line.split()[:1] == ["h100-sxm"])
    assert h100[1:3] == ["989", "67.0"] and h100[-1] == "700"  # the rated power --power-limit-w scales from


@pytest.mark.parametrize("columns", [80, 200])
def test_list_gpus_figures_whole_at_any_width(monkeypatch, capsys, columns):
    """An 80-column terminal (or a pipe) gets every figure whole, the descriptions under the table;
    a wide one gets them in a column."""
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = run(capsys, "estimate", "--list-gpus")
    assert code == 0 and "…" not in out
    b200 = next(line.split() for line in out.splitlines() if line.split()[:1] == ["b200"])
    assert b200[1] == "2,250" and b200[10] == "1000"
    assert max(len(line) for line in out.splitlines()) <= columns
    described_below = any(line.startswith("b200: B200") for line in out.splitlines())
    assert described_below == (columns < 130)


def test_batch_mode_one_line_per_input_in_order(capsys, tmp_path):
    good = dict(arch="gpt", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152, vocab=51200, seq_len=2048,
                global_batch=1536, micro_batch=1, gpu="a100-80gb", num_gpus=1024, gpus_per_node=8, tp=8, pp=16, dp=8,
                cp=1, zero=1, recompute="selective", schedule="1f1b", sequence_parallel=True, attention="flash")
    lines = [json.dumps(good), json.dumps(dict(good, tp=7)), "not json", json.dumps(dict(good, colour="red")),
             json.dumps(dict(good, zero=3, micro_batch=2)), json.dumps({"model": "llama3-70b", "gpu": "h100-sxm",
                                                                         "global_batch": 64, "tp": 8, "pp": 8})]
    path = tmp_path / "layouts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, _ = run(capsys, "estimate", "--batch", str(path))
    assert code == 0
    results = [json.loads(line) for line in out.splitlines()]
    assert len(results) == 6
    assert "step_time_s" in results[0] and results[0]["layout"]["zero"] == 1
    assert "= 896, not --num-gpus 1024" in results[1]["error"]
    assert "not a JSON object" in results[2]["error"]
    assert "colour: unknown key" in results[3]["error"]
    assert results[4]["layout"]["zero"] == 3 and results[4]["layout"]["micro_batch"] == 2
    assert results[5]["num_gpus"] == 64 and results[5]["layout"]["dp"] == 1
    # a byte-order mark before the first line is not part of it; a file of no lines says so
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    code, out, _ = run(capsys, "estimate", "--batch", str(path))
    assert code == 0 and [json.loads(line) for line in out.splitlines()] == results
    path.write_text("\n  \n")
    code, out, err = run(capsys, "estimate", "--batch", str(path))
    assert code == 2 and out == "" and err.strip() == f"error: --batch: {path} holds no lines (one JSON object a line, " \
                                                        "a layout each)"


def test_plan_prints_the_rate_and_ranked_layouts(capsys):
    code, out, _ = run(capsys, "plan", *GPT3, "--num-gpus", "1024", "--top", "3")
    assert code == 0
    assert "layouts/s" in out and "fastest:" in out
    code, out, _ = run(capsys, "plan", *GPT3, "--num-gpus", "1024", "--top", "4", "--json")
    result = json.loads(out)
    steps = [layout["step_time_s"] for layout in result["layouts"]]
    assert len(steps) == 4 and steps == sorted(steps) and result["layouts_per_s"] > 0
    assert all(layout["fits"] and layout["why"] for layout in result["layouts"])


def test_plan_when_nothing_fits(capsys):
    code, _, err = run(capsys, "plan", *GPT3, "--num-gpus", "8")
    assert code == 2 and "no layout of this model fits on 8 × a100-80gb" in err


@pytest.mark.parametrize("args", [["--help"], ["estimate", "--model", "tiny", "--json"],
                                  ["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"]])
def test_commands_that_train_nothing_do_not_import_torch(args):
    """`--help` finds every command's module (importing its package) and the planner is pure
    arithmetic: neither may pay torch's 1.7 s import (8 ranks of a run pay it on 2 cores)."""
    import subprocess
    import sys

    probe = f"import sys; from threefold.cli import main; main({args!r}); print('torch' in sys.modules, file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "False"


def test_sequence_parallel_at_tp_1_is_turned_off_with_a_note(capsys):
    """As Megatron does (it disables SP when the tensor-parallel size is 1): a published run's
    flags may carry it, and there is nothing to split the sequence over."""
    from threefold import config

    config.note_once.cache_clear()  # once per process: a --batch file may carry it on every line
    layout = ["estimate", "--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "8", "--json"]
    code, with_sp, err = run(capsys, *layout, "--sequence-parallel")
    assert code == 0 and err.count("no effect at --tp 1") == 1
    code, _, err = run(capsys, *layout, "--sequence-parallel")
    assert code == 0 and "no effect" not in err
    code, without, _ = run(capsys, *layout)
    assert json.loads(with_sp) == json.loads(without)
    assert json.loads(with_sp)["layout"]["sequence_parallel"] is False


def test_virtual_stages_read_as_megatron_reads_them(capsys):
    """1F1B with virtual stages is Megatron's interleaved 1F1B, and interleaved with one chunk a
    rank is 1F1B: a published run may state either; each is estimated as the other, with a note."""
    from threefold import config

    config.note_once.cache_clear()
    layout = ["estimate", "--model", "gpt3-175b", "--global-batch", "512", "--gpu", "a100-80gb", "--num-gpus", "64",
              "--tp", "8", "--pp", "8", "--json"]
    code, stated, err = run(capsys, *layout, "--schedule", "1f1b", "--virtual-stages", "4")
    assert code == 0 and err.count("Megatron's interleaved 1F1B") == 1
    code, interleaved, _ = run(capsys, *layout, "--schedule", "interleaved", "--virtual-stages", "4")
    assert json.loads(stated) == json.loads(interleaved)
    assert json.loads(stated)["layout"]["schedule"] == "interleaved"
    code, one_chunk, err = run(capsys, *layout, "--schedule", "interleaved", "--virtual-stages", "1")
    assert code == 0 and "one model chunk a rank is 1F1B" in err
    code, plain, _ = run(capsys, *layout, "--schedule", "1f1b")
    assert json.loads(one_chunk) == json.loads(plain)
    # gpipe and zb-h1 have no chunked form: one line and exit 2, as before
    code, _, err = run(capsys, *layout, "--schedule", "gpipe", "--virtual-stages", "2")
    assert code == 2 and "only interleaved takes virtual_stages > 1" in err


def test_choices_are_read_in_any_case(capsys, tmp_path):
    """A published run's row may spell a schedule or a recomputation as its paper does."""
    common = ["--model", "gpt3-175b", "--global-batch", "512", "--gpu", "a100-80gb", "--num-gpus", "64", "--tp", "8",
              "--pp", "8", "--json"]
    code, shouted, err = run(capsys, "estimate", *common, "--schedule", "ZB-H1", "--recompute", "Selective",
                             "--attention", "EAGER")
    assert code == 0, err
    code, plain, _ = run(capsys, "estimate", *common, "--schedule", "zb-h1", "--recompute", "selective",
                         "--attention", "eager")
    assert json.loads(shouted) == json.loads(plain)
    line = {"model": "gpt3-175b", "global_batch": 512, "gpu": "a100-80gb", "num_gpus": 64, "tp": 8, "pp": 8,
            "schedule": "1F1B", "recompute": "FULL"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(line) + "\n")
    code, out, err = run(capsys, "estimate", "--batch", str(tmp_path / "rows.jsonl"))
    result = json.loads(out)
    assert code == 0 and "error" not in result, out
    assert (result["layout"]["schedule"], result["layout"]["recompute"]) == ("1f1b", "full")
    # dtypes as papers print them: fp16 and bf16 at the 16-bit peak, fp32 at the fp32 one
    by_dtype = {d: json.loads(run(capsys, "estimate", *common, "--dtype", d)[1])["step_time_s"]
                for d in ("bfloat16", "BF16", "fp16", "float16", "float32", "FP32")}
    assert by_dtype["bfloat16"] == by_dtype["BF16"] == by_dtype["fp16"] == by_dtype["float16"]
    assert by_dtype["float32"] == by_dtype["FP32"] > by_dtype["bfloat16"]


@pytest.mark.parametrize("spelling, name", [("A100-SXM4-80GB", "a100-80gb"), ("a100_40gb", "a100-40gb"),
                                            ("H100 SXM5 80GB", "h100-sxm"), ("H200", "h200"),
                                            ("a100-40", "a100-40gb"), ("A100 40", "a100-40gb")])
def test_the_gpu_may_be_named_as_vendors_print_it(capsys, spelling, name):
    common = ["estimate", "--model", "gpt3-175b", "--global-batch", "64", "--num-gpus", "64", "--tp", "8", "--pp", "8",
              "--json"]
    code, out, _ = run(capsys, *common, "--gpu", spelling)
    assert code == 0
    code, canonical, _ = run(capsys, *common, "--gpu", name)
    assert json.loads(out) == json.loads(canonical)


@pytest.mark.parametrize("spelling, name", [
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),  # nvidia-smi's names
    ("A100 (80 GB)", "a100-80gb"), ("A100", "a100-80gb"), ("AMD Instinct MI300X", "mi300x"), ("h200_141gb", "h200"),
    # other boards and chips are not read as a catalog part
    ("H100 PCIe", None), ("NVIDIA H100 NVL", None), ("GH200", None), ("H100 96GB HBM2e", None), ("A100 24GB", None),
    ("V100", None),
    # the spellings an alias table listed before the parts were read
    ("a100-sxm4-40gb", "a100-40gb"), ("a100-sxm-40gb", "a100-40gb"), ("a100-sxm4-80gb", "a100-80gb"),
    ("a100-sxm-80gb", "a100-80gb"), ("h100", "h100-sxm"), ("h100-sxm5", "h100-sxm"), ("h100-sxm5-80gb", "h100-sxm"),
    ("h100-sxm-80gb", "h100-sxm"), ("h100-80gb", "h100-sxm"), ("h200-sxm", "h200"), ("h200-141gb", "h200"),
    ("b200-180gb", "b200"), ("mi300x-192gb", "mi300x"),
    # a size with or without GB (a100-40 and "A100 40" were read as a100-80gb)
    ("a100-40", "a100-40gb"), ("A100 40", "a100-40gb"), ("A100-40GB", "a100-40gb"), ("a100_80", "a100-80gb"),
    ("a100 40g", "a100-40gb"), ("A100 40 GiB", "a100-40gb"), ("h200 144", "h200"), ("a100-60", None),
    # a name that only starts like a part (these were read as a100-80gb and h100-sxm)
    ("A100X", None), ("RTX A1000", None), ("H1000", None)])
def test_catalog_names_read_part_and_memory_from_any_spelling(spelling, name):
    from threefold.plan.hardware import catalog_name

    assert catalog_name(spelling) == name


@pytest.mark.parametrize("key, spelling, name", [
    ("schedule", "interleaved-1f1b", "interleaved"), ("schedule", "1F1B_interleaved", "interleaved"),
    ("schedule", "zb_h1", "zb-h1"), ("schedule", "PipeDream-Flush", "1f1b"),
    ("recompute", True, "full"), ("recompute", False, "none"), ("recompute", "Full", "full"),
    ("dtype", "amp_bf16", "bf16"), ("dtype", "fp16 mixed", "fp16"), ("dtype", "bf16-mixed", "bf16"),
    ("dtype", "fp8-hybrid", "fp8")])
def test_batch_lines_take_the_names_frameworks_give_schedules_recomputation_and_precision(capsys, tmp_path, key, spelling, name):
    line = dict(model="llama3-8b", global_batch=64, gpu="h100-sxm", num_gpus=8, pp=2)
    batch = tmp_path / "lines.jsonl"
    batch.write_text(json.dumps({**line, key: spelling}) + "\n" + json.dumps({**line, key: name}) + "\n")
    code, out, _ = run(capsys, "estimate", "--batch", str(batch))
    given, canonical = (json.loads(x) for x in out.splitlines())
    assert code == 0 and "error" not in given, given
    assert given == canonical and given["layout"].get(key, name) == name


def test_a_refused_choice_is_named_as_it_was_given(capsys):
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--global-batch", "8", "--num-gpus", "8",
                       "--gpu", "h100-sxm", "--schedule", "Foo_Bar")
    assert code == 2 and err.strip().count("\n") == 0 and "'Foo_Bar' is not one of" in err


def test_an_unknown_board_says_to_describe_it_in_a_cluster_file(capsys):
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--global-batch", "8", "--num-gpus", "8",
                       "--gpu", "H100 PCIe")
    assert code == 2 and err.strip().count("\n") == 0
    assert "unknown GPU 'H100 PCIe'" in err and "--cluster FILE.toml" in err


@pytest.mark.parametrize("schedule", ["zb-h1", "dualpipev"])
def test_full_recomputation_under_a_split_backward_is_refused_and_never_searched(capsys, schedule):
    """W apart from B would run each checkpointed block's forward again (the engine refuses it
    too): estimate says so in one line, and plan leaves those layouts out."""
    common = ["--model", "llama3-8b", "--global-batch", "64", "--gpu", "h100-sxm", "--num-gpus", "16",
              "--no-tie-embeddings"]
    code, _, err = run(capsys, "estimate", *common, "--pp", "2", "--schedule", schedule, "--recompute", "full")
    assert code == 2 and err.strip().count("\n") == 0
    assert f"--recompute: full with --schedule {schedule} is not priced" in err
    from threefold.plan import search

    candidates = search.candidate_layouts(costs.Workload(get_preset("llama3-8b"), 64), 16, {"schedule": schedule})
    split = candidates.pp > 1
    recompute = candidates.recompute[split]
    assert split.any() and costs.RECOMPUTE.index("none") in recompute
    assert costs.RECOMPUTE.index("full") not in recompute  # left out of the search


def test_an_mfu_above_100_percent_says_why(capsys):
    """The convention counts the whole s × s attention; flash computes the causal half: at 128k
    tokens on a narrow model attention dominates and MFU passes 1, with a note saying so."""
    args = ["estimate", "--arch", "gpt", "--layers", "48", "--hidden", "2048", "--heads", "32", "--vocab", "32000",
            "--seq-len", "131072", "--global-batch", "16384", "--micro-batch", "4", "--gpu", "a100-80gb",
            "--num-gpus", "384", "--pp", "3", "--dp", "64", "--cp", "2", "--cp-method", "ulysses"]
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["mfu"] > 1
    code, out, _ = run(capsys, *args)
    assert "note: MFU above 100%" in " ".join(out.split())
    code, out, _ = run(capsys, *GPT3_LAYOUT)
    assert "MFU above 100%" not in out and "HFU above 100%" not in out
    # with full recomputation the hardware count passes 1 first, with the same note
    hfu = ["estimate", "--arch", "llama", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "32000",
           "--seq-len", "131072", "--global-batch", "8", "--gpu", "a100-80gb", "--num-gpus", "64", "--cp", "8",
           "--recompute", "full"]
    code, out, _ = run(capsys, *hfu, "--json")
    assert json.loads(out)["mfu"] < 1 < json.loads(out)["hfu"]
    code, out, _ = run(capsys, *hfu)
    assert "note: HFU above 100%" in " ".join(out.split())


def test_a_gpu_holds_what_its_driver_reports(capsys):
    """An H200 "141GB" gives a process 143,771 MiB (140.4 GiB), an H100 "80GB" 81,559 MiB: Llama
    3 8B on two H200s at micro-batch 4 under ZeRO-3 needs 136.9 GiB, which fits the former and
    did not fit the 141e9 bytes (131.3 GiB) the catalog once read; --list-gpus prints them so."""
    code = main(["estimate", "--model", "llama3-8b", "--global-batch", "16", "--gpu", "h200", "--num-gpus", "2",
                 "--zero", "3", "--recompute", "full", "--micro-batch", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and 131.3 < result["memory_gib"]["total"] < 140.4 and result["fits"]
    main(["estimate", "--list-gpus"])
    listed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    assert "140.4" in listed["h200"] and "79.6" in listed["h100-sxm"] and "80" in listed["a100-80gb"]


SMALL_LLAMA = ["--arch", "llama", "--layers", "4", "--hidden", "256", "--heads", "8", "--vocab", "512",
               "--seq-len", "128", "--global-batch", "16", "--gpu", "h100-sxm", "--num-gpus", "8"]


def test_plan_writes_its_winner_as_a_config_the_engine_dry_runs(capsys, tmp_path):
    """--config-out: the search's fastest layout that the engine runs, as a config that loads, whose
    layout is the one plan names, and that one step of the engine runs at the planned world size."""
    from threefold.configure import load_config

    path = tmp_path / "run.toml"
    code, out, err = run(capsys, "plan", *SMALL_LLAMA, "--no-overlap-dp", "--top", "1", "--json", "--config-out", str(path))
    assert code == 0, err
    found = json.loads(out)
    written, best = found["config_out"], found["layouts"][0]
    assert written["rank"] == 1 and written["layout"] == best["describe"]
    cfg = load_config(path)
    lay = best["layout"]
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero, cfg.train.micro_batch,
            cfg.parallel.schedule, cfg.train.recompute) == (lay["tp"], lay["pp"], lay["dp"], lay["zero"],
                                                              lay["micro_batch"], lay["schedule"], lay["recompute"])
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.vocab_size, cfg.train.global_batch) == (4, 256, 512, 16)
    assert cfg.parallel.overlap_grad_reduce is False  # --no-overlap-dp, carried to the engine's switch
    header = path.read_text().splitlines()[0]
    assert header.startswith("# threefold plan --arch llama --layers 4")
    # the command in the first line runs again as written (switches as --flag / --no-flag)
    code, out, err = run(capsys, *header.removeprefix("# threefold ").split(), "--top", "1", "--json")
    assert code == 0 and json.loads(out)["layouts"][0]["describe"] == best["describe"], err
    assert main(["dryrun", "--config", str(path), "--world-size", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["rank"] == 0


def test_plan_says_which_row_of_its_table_the_config_holds(capsys, tmp_path, monkeypatch):
    """The table shows one row a mesh, the search counts every variant: Llama 3 70B at 128k
    tokens on 256 H100s writes the table's third row, where plan had said "the search's #6"."""
    monkeypatch.setenv("COLUMNS", "400")  # the table's rows on one line each
    path = tmp_path / "run.toml"
    code, out, err = run(capsys, "plan", "--model", "llama3-70b", "--seq-len", "131072", "--global-batch", "32",
                         "--gpu", "h100-sxm", "--num-gpus", "256", "--config-out", str(path))
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("│ ") and line[2].isdigit()]
    written = next(line for line in out.splitlines() if line.startswith("config of "))
    layout = written.removeprefix("config of ").split(" (#")[0]
    number = int(written.split(" (#")[1].split(" in the table")[0])
    assert layout in rows[number - 1] and all(layout not in row for row in rows[:number - 1])
    assert "counting every variant, do not run on the engine" in written


@pytest.mark.parametrize("dp, cp, zero, bucket_mb", [(8, 1, 1, 152.6), (16, 4, 0, 244.1), (4, 1, 2, 152.6),
                                                      (8, 1, 3, 25.0), (1, 1, 0, 25.0)])
def test_config_out_runs_the_gradient_buckets_the_layout_was_priced_with(capsys, tmp_path, dp, cp, zero, bucket_mb):
    """The planner prices Megatron-Core's bucket, max(40M, 1M × dp·cp) parameters; the config makes
    the engine run it, in MiB of fp32 gradients (40M → 152.6, 64M → 244.1). ZeRO-3 reduces unit by
    unit and one replica reduces nothing: the engine's default (25 MiB) stays."""
    from threefold.configure import load_config

    path = tmp_path / "run.toml"
    code, _, err = run(capsys, "plan", *SMALL_LLAMA[:-2], "--num-gpus", str(dp * cp), "--dp", str(dp), "--cp", str(cp),
                       "--zero", str(zero), "--top", "1", "--config-out", str(path))
    assert code == 0, err
    cfg = load_config(path)
    assert (cfg.parallel.dp, cfg.parallel.cp, cfg.parallel.zero) == (dp, cp, zero)
    assert cfg.parallel.bucket_mb == bucket_mb
    assert ("bucket_mb" in path.read_text()) == (bucket_mb != 25.0)


def test_config_out_skips_layouts_the_engine_does_not_run(capsys, tmp_path):
    """Op-level checkpointing is priced, not run by the engine: with it fixed nothing qualifies,
    and a model the engine cannot build is refused before the search."""
    code, _, err = run(capsys, "plan", *SMALL_LLAMA, "--recompute", "op", "--config-out", str(tmp_path / "a.toml"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: --config-out: none of the "), err
    assert "the fastest: op-level checkpointing, which the engine does not run" in lines[0]
    assert lines[0].endswith("plan with --recompute full or none, or a ZeRO stage below 3")
    # nothing fits: an error in JSON too, so a config left by an earlier plan is not taken for this one's
    code, out, err = run(capsys, "plan", *SMALL_LLAMA[:-2], "--num-gpus", "8", "--tp", "3", "--json",
                         "--config-out", str(tmp_path / "d.toml"))
    lines = err.strip().splitlines()  # why, as plan says it without --config-out, and that nothing was written
    assert code == 2 and not out and len(lines) == 1 and lines[0].startswith("error: --tp: 3 does not divide")
    assert lines[0].endswith(f"; --config-out {tmp_path / 'd.toml'} not written")
    code, out, err = run(capsys, "plan", "--model", "llama3-70b", "--global-batch", "16", "--gpu", "h100-sxm",
                         "--num-gpus", "1", "--config-out", str(tmp_path / "e.toml"))
    assert code == 2 and "error: --num-gpus: no layout of this model fits on 1 × h100-sxm" in err
    assert not (tmp_path / "e.toml").exists()
    gpt = ["--arch", "gpt", *SMALL_LLAMA[2:]]
    code, out, err = run(capsys, "plan", *gpt, "--config-out", str(tmp_path / "b.toml"))
    assert code == 2 and not out and err.strip() == ("error: --config-out: threefold's engine trains Llama-style "
                                                     "blocks; this model is gpt")
    code, _, err = run(capsys, "plan", *SMALL_LLAMA, "--config-out", str(tmp_path / "c.txt"))
    assert code == 2 and "must end in .toml" in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("flags,note,fixed", [
    (["--tp", "1", "--sequence-parallel"], "--sequence-parallel has no effect at --tp 1", {"sequence_parallel": False}),
    (["--pp", "4", "--schedule", "1f1b", "--virtual-stages", "4"], "is Megatron's interleaved 1F1B",
     {"schedule": "interleaved"}),
    (["--pp", "4", "--schedule", "interleaved", "--virtual-stages", "1"], "interleaved with one model chunk a rank is 1F1B",
     {"schedule": "1f1b"}),
    (["--tp", "1", "--tp-comm-overlap"], "--tp-comm-overlap has no effect without tensor parallelism", {"tp": 1}),
])
def test_plan_reads_fixed_knobs_as_estimate_does(capsys, flags, note, fixed):
    """Knobs that mean something else together (as Megatron reads them) are a note in plan, as in
    estimate, where plan had found no layout for them."""
    args = ["plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "16", "--global-batch", "64", *flags]
    code, out, err = run(capsys, *args, "--json")
    assert code == 0 and note in err and json.loads(out)["fitting"] > 0
    assert fixed.items() <= json.loads(out)["fixed"].items()
    from threefold import config

    config.note_once.cache_clear()  # once per process
    code, out, err = run(capsys, "estimate", *args[1:])
    assert code == 0 and note in err
