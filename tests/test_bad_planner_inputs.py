"""The planner's commands on inputs a CLI audit found mishandled: each bad one is one line and
exit 2, each ineffective one a note, and sizes too large to be real are refused before they
overflow numpy or hang."""
import json

import pytest

from threefold.cli import main

BASE = ["--model", "llama3-8b", "--num-gpus", "8", "--global-batch", "16", "--gpu", "h100-sxm"]


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, *words):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("command, flag", [
    (["estimate", *BASE, "--layers"], "--layers"), (["estimate", *BASE, "--seq-len"], "--seq-len"),
    (["estimate", *BASE, "--gpus-per-node"], "--gpus-per-node"), (["plan", *BASE, "--num-gpus"], "--num-gpus")])
def test_a_size_too_large_to_be_real_is_one_line(capsys, command, flag):
    one_line_error(*run(capsys, *command, str(10**30))[::2], flag, "too large")


def test_the_largest_sizes_allowed_answer_at_once_in_valid_json(capsys):
    """2**31 − 1 layers (a dense model's MoE count is no longer a loop over them), a prime GPU
    count that large for plan (its divisors found up to the square root)."""
    code, out, err = run(capsys, "estimate", *BASE, "--layers", str(2**31 - 1), "--json")
    result = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert code == 0 and result["step_time_s"] > 0 and 0 < result["mfu"] < 1
    code, out, err = run(capsys, "plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", str(2**31 - 1),
                         "--global-batch", str(2**31 - 1), "--json")
    assert code == 0 and json.loads(out)["evaluated"] > 0


def test_batch_lines_of_the_wrong_kind_are_error_lines(capsys, tmp_path):
    good = {"model": "llama3-8b", "global_batch": 16, "gpu": "h100-sxm", "num_gpus": 8}
    lines = [dict(good, num_gpus=8.5), dict(good, num_gpus=True), dict(good, num_gpus=[8]),
             dict(good, sequence_parallel=5), dict(good, cluster=12), dict(good, num_gpus=8.0),
             dict(good, recompute=True), dict(good, pp=2, stage_layers=[16, 16])]
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    code, out, err = run(capsys, "estimate", "--batch", str(path))
    results = [json.loads(text) for text in out.splitlines()]
    assert code == 0 and len(results) == len(lines)
    for result, key, value in zip(results[:5], ("num_gpus", "num_gpus", "num_gpus", "sequence_parallel", "cluster"),
                                  ("8.5", "true", "[8]", "5", "12")):
        assert result == {"error": result["error"]} and result["error"].startswith(f"{key}: {value} is not a valid")
    assert all("step_time_s" in result for result in results[5:])  # 8.0 GPUs; recompute true; a split as a list


def test_batch_mode_refuses_what_it_cannot_use_before_any_line(capsys, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"model": "llama3-8b", "global_batch": 16, "gpu": "h100-sxm", "num_gpus": 8}))
    one_line_error(*run(capsys, "estimate", "--batch", str(good), "--out", str(tmp_path / "x.png"))[::2], "--out")
    one_line_error(*run(capsys, "estimate", "--batch", str(good), "--tp", "0")[::2], "--tp")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00{}")
    one_line_error(*run(capsys, "estimate", "--batch", str(binary))[::2], "--batch", "not UTF-8")


def test_a_cluster_section_that_is_not_a_table_says_so(capsys, tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text("gpu = 5\n")
    one_line_error(*run(capsys, "estimate", "--model", "llama3-8b", "--num-gpus", "8", "--global-batch", "16",
                        "--cluster", str(path))[::2], "[gpu] must be a table")


@pytest.mark.parametrize("extra, note", [
    (["--power-limit-w", "1000"], "above h100-sxm's rated 700 W"),
    (["--cp-method", "ulysses"], "--cp-method ulysses has no effect at --cp 1"),
    (["--schedule", "zb-h1"], "--schedule zb-h1 has no effect at --pp 1")])
def test_a_flag_without_effect_gets_a_note(capsys, extra, note):
    from threefold import config

    config.note_once.cache_clear()
    code, out, err = run(capsys, "estimate", *BASE, *extra, "--json")
    assert code == 0 and note in err and json.loads(out)["step_time_s"] > 0


@pytest.mark.parametrize("fixed, words", [
    (["--tp", "3"], ["--tp: 3 does not divide the 32 heads"]),
    (["--ep", "2"], ["--ep: 2 needs an MoE model"]),
    (["--schedule", "interleaved", "--pp", "1"], ["--pp 1, --schedule interleaved", "together"]),
    # (sequence parallelism at tp 1 is a note, as in estimate: test_plan_cli.py)
    (["--tp", "8", "--pp", "2"], ["--tp 8, --pp 2: each is possible alone, but together", "on 8 GPUs"])])
def test_plan_names_the_fixed_knob_that_leaves_no_layout(capsys, fixed, words):
    one_line_error(*run(capsys, "plan", *BASE, *fixed)[::2], *words)


def test_plan_with_a_pipeline_schedule_searches_pipelines_only(capsys):
    code, out, _ = run(capsys, "plan", *BASE, "--schedule", "zb-h1", "--json")
    assert code == 0 and all(layout["layout"]["pp"] > 1 for layout in json.loads(out)["layouts"])


def test_a_command_without_its_subcommand_prints_its_help(capsys):
    code, out, err = run(capsys)
    assert code == 0 and "Commands:" in out and "estimate" in out and not err
    code, out, err = run(capsys, "data", "prepare", "--seq-len", "0")
    one_line_error(code, err, "(see `threefold data prepare --help`)")


def test_a_refused_layout_gets_its_error_without_the_notes_it_earned(capsys):
    """--cp-method at --cp 1 earns a note; the batch that no layout divides is then refused. The
    note used to come first, two lines for one bad input. A layout that runs keeps its note."""
    from threefold import config

    config.note_once.cache_clear()
    code, _, err = run(capsys, "estimate", "--model", "llama3-8b", "--num-gpus", "8", "--global-batch", "7",
                       "--gpu", "h100-sxm", "--cp-method", "ulysses")
    one_line_error(code, err, "--global-batch: 7 is not divisible")
    config.note_once.cache_clear()
    code, _, err = run(capsys, "estimate", *BASE, "--cp-method", "ulysses", "--json")
    assert code == 0 and err.strip() == "note: --cp-method ulysses has no effect at --cp 1"


@pytest.mark.parametrize("flag, name", [("--config-out", "x.toml"), ("--out", "x.png")])
def test_an_output_below_a_file_or_unwritable_is_one_line(capsys, tmp_path, flag, name):
    """Both were tracebacks (FileExistsError from mkdir, FileNotFoundError from the write)."""
    (tmp_path / "a-file").write_text("x")
    small = ["--arch", "llama", "--layers", "4", "--hidden", "256", "--heads", "8", "--vocab", "512", "--seq-len",
             "128", "--global-batch", "16", "--gpu", "h100-sxm", "--num-gpus", "8", "--top", "1"]
    below = tmp_path / "a-file" / name
    code, out, err = run(capsys, "plan", *small, flag, str(below))
    one_line_error(code, err, f"{flag}: {tmp_path / 'a-file'} is a file, so no file {below} can be made below it")
    assert not out  # refused before the search
    code, out, err = run(capsys, "plan", *small, flag, f"/proc/{name}")
    one_line_error(code, err, f"{flag}: cannot write in /proc (", f"so no file /proc/{name} can be made there")
    assert not out  # refused before the search, as the file below a file is


def test_plan_exits_2_when_nothing_fits_in_json_too(capsys):
    """With --json it printed {"fitting": 0, "layouts": []} and exited 0; without, 2."""
    args = ["--model", "llama3-405b", "--gpu", "a100-40gb", "--num-gpus", "1", "--global-batch", "1"]
    code, out, err = run(capsys, "plan", *args)
    one_line_error(code, err, "no layout of this model fits on 1 × a100-40gb")
    code, out, err = run(capsys, "plan", *args, "--json")
    one_line_error(code, err, "no layout of this model fits on 1 × a100-40gb")
    assert json.loads(out)["fitting"] == 0 and json.loads(out)["layouts"] == []


def test_moe_experts_0_makes_an_moe_preset_dense(capsys):
    """It was refused for --moe-top-k, a flag the user had not given (the preset's)."""
    args = ["--gpu", "h100-sxm", "--num-gpus", "64", "--global-batch", "512", "--tp", "8", "--json"]
    code, out, err = run(capsys, "estimate", "--model", "mixtral-8x7b", "--moe-experts", "0", *args)
    assert code == 0, err
    dense = json.loads(out)
    code, out, _ = run(capsys, "estimate", "--model", "mixtral-8x7b", *args)
    moe = json.loads(out)["parameters"]
    assert code == 0 and dense["parameters"]["total"] == dense["parameters"]["active"] < moe["active"] < moe["total"]


@pytest.mark.parametrize("command", ["plan", "estimate"])
@pytest.mark.parametrize("name, closest", [("MI300", "mi300x"), ("Local", "local"), ("h20", "h200"), ("B 100", "b200"),
                                           ("v100", None), ("H100 PCIe", None)])  # a PCIe board: the --cluster hint
def test_an_unknown_gpu_is_told_the_closest_known_name(capsys, command, name, closest):
    args = ["--model", "llama3-8b", "--num-gpus", "8", "--global-batch", "16", "--gpu", name]
    code, _, err = run(capsys, command, *args)
    one_line_error(code, err, f"--gpu: unknown GPU {name!r} (known: a100-40gb, ")
    assert err.rstrip().endswith(f"; did you mean {closest}?") == (closest is not None), err


@pytest.mark.parametrize("name", ["A100X", "RTX A1000", "H1000", "h100x", "mi300xx"])
def test_a_gpu_name_that_only_starts_like_a_catalog_part_is_unknown(capsys, name):
    """A100X and RTX A1000 were read as a100-80gb, H1000 as h100-sxm: the part had no end."""
    from threefold.plan.hardware import CATALOG, did_you_mean

    code, _, err = run(capsys, "estimate", *BASE[:-1], name)
    one_line_error(code, err, f"--gpu: unknown GPU {name!r} (known: a100-40gb, ")
    assert err.rstrip().endswith(f"local){did_you_mean(name, [*CATALOG, 'local'])}"), err


@pytest.mark.parametrize("name, sizes", [("a100-60", "40 or 80 GB, not 60"), ("A100 24GB", "40 or 80 GB, not 24"),
                                         ("h100 96", "80 GB, not 96"), ("H200-80GB", "141 or 144 GB, not 80")])
def test_a_catalog_part_in_a_size_the_catalog_lacks_is_told_its_sizes(capsys, name, sizes):
    """a100-60 was read as a100-80gb (a size without GB was not read); A100 24GB got "did you mean a100-40gb?"."""
    code, _, err = run(capsys, "plan", *BASE[:-1], name)
    one_line_error(code, err, f"--gpu: unknown GPU {name!r} (known: a100-40gb, ")
    assert err.rstrip().endswith(f"; the catalog has the {name.split()[0].split('-')[0].upper()} in {sizes}"), err


def test_an_unknown_stage_costs_gpu_is_told_the_closest_catalog_name():
    from threefold.config import Config, ConfigError
    from threefold.plan.stage_costs import planned_gpu

    cfg = Config()
    cfg.parallel.stage_costs_gpu = "H-200"
    with pytest.raises(ConfigError, match=r"unknown GPU 'H-200' \(known: .*\); did you mean h200\?$"):
        planned_gpu(cfg)


def test_a_stage_costs_gpu_in_a_size_the_catalog_lacks_is_told_its_sizes():
    """parallel.stage_costs_gpu = "a100-60" was planned on a100-80gb."""
    from threefold.config import Config, ConfigError
    from threefold.plan.stage_costs import planned_gpu

    cfg = Config()
    cfg.parallel.stage_costs_gpu = "a100-60"
    with pytest.raises(ConfigError, match=r"unknown GPU 'a100-60' \(known: .*\); the catalog has the A100 in 40 or 80 GB, "
                                          r"not 60$"):
        planned_gpu(cfg)
