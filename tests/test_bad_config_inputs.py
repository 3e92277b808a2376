"""Bad config inputs that crashed, hung or passed silently (an audit's findings): a section that is
not a table, a file that is not UTF-8, sizes too large for torch, layouts that contradict
themselves. Each gets one ``error:`` line on stderr and exit code 2 from the CLI (a setting the
engine merely ignores: one ``note:`` line), run in this process through ``threefold.cli.main``."""
from __future__ import annotations

import pytest

from threefold import config, configure
from threefold.cli import main

TINY = ["--set", "model.preset=tiny", "--set", "model.vocab_size=256", "--set", "model.seq_len=32"]


def refused(capsys, argv: list[str], needle: str) -> str:
    code = main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert "Traceback" not in lines[0]
    return lines[0]


# the commands that read a config file (load_config); each refuses it before anything else runs
COMMANDS = [["dryrun", "--world-size", "1"], ["train", "--no-progress"], ["compare", "--metrics-file", "{tmp}/m.jsonl"]]


def command_in(tmp_path, command: list[str]) -> list[str]:
    (tmp_path / "m.jsonl").write_text("")  # compare's metrics (it reads the config first)
    return [arg.format(tmp=tmp_path) for arg in command]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("text, section, got", [
    ('model = "tiny"\n', "model", "got 'tiny'"),
    ("[[model]]\nlayers = 2\n", "model", "got an array of tables [[model]]"),
    ("train = 3\n[model]\nlayers = 2\n", "train", "got 3"),
])
def test_a_section_that_is_not_a_table(tmp_path, capsys, command, text, section, got):
    path = tmp_path / "run.toml"
    path.write_text(text)
    line = refused(capsys, [*command_in(tmp_path, command), "--config", str(path)],
                   f"{section}: expected a table of keys")
    assert got in line and str(path) in line


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_config_that_is_not_utf8(tmp_path, capsys, command):
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xff\xfe\x00")
    line = refused(capsys, [*command_in(tmp_path, command), "--config", str(path)], f"--config {path}: not UTF-8 text")
    assert "0xff" in line


@pytest.mark.parametrize("key, value, limit", [
    ("model.layers", 10**30, 10_000),  # hung: 10**30 blocks built one by one
    ("model.layers", 10_001, 10_000),
    ("model.hidden", 10**30, 2**31 - 1),  # a 50-line torch traceback
    ("model.heads", 2**31, 2**31 - 1),
    ("model.vocab_size", 10**30, 2**31 - 1),
    ("model.seq_len", 10**30, 2**31 - 1),
    ("model.moe_experts", 10**30, 2**31 - 1),
    ("parallel.tp", 10**30, 2**31 - 1),
    ("parallel.microbatches", 10**30, 2**31 - 1),
    ("train.global_batch", 10**30, 2**31 - 1),
    ("train.steps", 10**30, 2**31 - 1),
    ("train.seed", 2**64, 2**63 - 1),
])
def test_a_huge_integer_is_refused_with_its_bound(capsys, key, value, limit):
    refused(capsys, ["dryrun", "--world-size", "1", "--set", f"{key}={value}"],
            f"{key}: {value} is too large (at most {limit})")


@pytest.mark.parametrize("command", [["dryrun", "--world-size", "1"], ["train", "--no-progress"]], ids=lambda c: c[0])
def test_a_vocabulary_the_bpe_trainer_cannot_build_is_refused_before_training(capsys, command):
    """``data prepare --vocab-size`` had this bound; a train config's ``data.vocab_size`` reached
    the tokenizer trainer, which panics on it."""
    refused(capsys, [*command, "--set", "data.vocab_size=2000000"],
            "data.vocab_size: at most 1,000,000 tokens (the largest vocabularies in use have about 256,000), "
            "got 2,000,000")


def test_a_refused_config_gets_its_error_line_without_the_notes_it_earned(capsys):
    """Sequence parallelism at tp 1 earns a note; the unknown GPU is then refused. The note came first."""
    config.note_once.cache_clear()
    refused(capsys, ["dryrun", "--world-size", "1", *TINY, "--set", "parallel.sequence_parallel=true",
                     "--set", 'parallel.stage_costs="planner"', "--set", 'parallel.stage_costs_gpu="nope"'],
            "parallel.stage_costs_gpu: unknown GPU 'nope'")


@pytest.mark.parametrize("command, needle", [
    (["train", "--no-progress", "--nproc", "3"], "--nproc: 3 processes do not match"),
    (["dryrun", "--world-size", "3"], "--world-size: the layout dp×tp×pp×cp = 1×1×1×1 = 1 rank, not 3"),
])
def test_a_run_refused_after_loading_gets_no_notes_either(capsys, command, needle):
    """The config loads (with a note: SP at tp 1), then the command's own check refuses it."""
    config.note_once.cache_clear()
    refused(capsys, [*command, *TINY, "--set", "parallel.sequence_parallel=true"], needle)


def test_a_huge_value_as_a_string_is_refused_too(capsys):
    refused(capsys, ["dryrun", "--world-size", "1", "--set", 'model.hidden="1000000000000000000000000000000"'],
            "model.hidden: 1000000000000000000000000000000 is too large")


def test_real_sizes_stay_valid():
    """Llama 3 405B at 128k tokens on 16,384 GPUs, DeepSeek-V3's experts and batch."""
    cfg = configure.load_config(None, ["model.layers=126", "model.hidden=16384", "model.heads=128", "model.kv_heads=8",
                                       "model.ffn=53248", "model.vocab_size=128256", "model.seq_len=131072",
                                       "parallel.tp=8", "parallel.pp=16", "parallel.dp=128", "parallel.cp=16",
                                       "train.global_batch=2048", "train.micro_batch=1", "train.seed=18446744073",
                                       "train.steps=1200000"])
    assert cfg.parallel.world_size == 128 * 8 * 16 * 16
    cfg = configure.load_config(None, ["model.layers=61", "model.hidden=7168", "model.heads=128",
                                       "model.moe_experts=256", "model.moe_top_k=8", "model.moe_ffn=2048",
                                       "model.moe_first_dense=3", "train.global_batch=15360", "train.micro_batch=1"])
    assert cfg.model.moe_experts == 256


def test_sizes_whose_product_overflows_torch_are_one_line(capsys):
    """Each key within its bound, hidden × the FFN width beyond the bytes torch can address."""
    refused(capsys, ["dryrun", "--world-size", "1", "--json", *TINY, "--set", "model.hidden=1073741824"],
            "model: a tensor of this run (sizes=[")


def test_a_dry_run_of_endless_micro_batches_is_refused(capsys):
    refused(capsys, ["dryrun", "--world-size", "1", *TINY, "--set", "train.global_batch=2147483647",
                     "--set", "train.micro_batch=1"], "train.global_batch: 2147483647 sequences are 2147483647 "
                                                      "micro-batches a step")


@pytest.mark.parametrize("command", COMMANDS[:2], ids=lambda c: c[0])
@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
def test_a_pipeline_schedule_without_a_pipeline_is_refused(capsys, command, schedule):
    refused(capsys, [*command, *TINY, "--set", f"parallel.schedule={schedule}", "--set", "parallel.pp=1"],
            f"parallel.schedule: {schedule} needs a pipeline of at least 2 ranks (parallel.pp > 1), got pp=1")


@pytest.mark.parametrize("sets, note", [
    (["parallel.sequence_parallel=true", "parallel.tp=1"],
     "note: parallel.sequence_parallel has no effect at parallel.tp = 1"),
    (["parallel.schedule=gpipe", "parallel.pp=1"],
     'note: parallel.schedule = "gpipe" has no effect at parallel.pp = 1'),
    (["parallel.schedule=zb-h1"], 'note: parallel.schedule = "zb-h1" has no effect at parallel.pp = 1'),
    (["parallel.cp_method=ulysses"], 'note: parallel.cp_method = "ulysses" has no effect at parallel.cp = 1'),
])
def test_a_setting_the_engine_ignores_is_noted_once(capsys, sets, note):
    config.note_once.cache_clear()
    argv = ["dryrun", "--world-size", "1", "--json", *TINY, *sum((["--set", s] for s in sets), [])]
    assert main(argv) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith(note), lines
    configure.load_config(None, ["model.preset=tiny", *sets])  # a second read in the process: no second note
    assert capsys.readouterr().err == ""


BATCH = ["--set", "train.global_batch=48", "--set", "train.micro_batch=2"]  # whole micro-batches on 4 or 6 ranks


@pytest.mark.parametrize("sets, message", [
    (["parallel.dp=4", "parallel.zero=0", "parallel.dp_shard=2"],
     "parallel.dp_shard: hybrid sharding splits ZeRO's states over groups of 2 dp ranks; it needs parallel.zero 1, "
     "2 or 3, got zero=0 (DDP keeps every state whole)"),
    (["parallel.dp=6", "parallel.zero=3", "parallel.dp_shard=4"],
     "parallel.dp_shard: must divide parallel.dp=6 and be at least 2 (a group of one rank shards nothing), got 4"),
    (["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=1"], "parallel.dp_shard: must divide parallel.dp=4 and "
                                                                  "be at least 2"),
    (["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=-2"], "parallel.dp_shard: must not be negative"),
    (["model.moe_experts=4", "parallel.dp=8", "parallel.ep=4", "parallel.zero=3", "parallel.dp_shard=2"],
     "parallel.dp_shard: a shard group holds whole expert-parallel groups, so it must be a multiple of "
     "parallel.ep=4, got 2"),
])
def test_a_hybrid_sharding_the_engine_cannot_run_is_refused(capsys, sets, message):
    world = ["--world-size", str(4 if "parallel.dp=4" in sets else 6)]
    refused(capsys, ["dryrun", *world, *TINY, *BATCH, *sum((["--set", s] for s in sets), [])], message)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_keeping_units_gathered_needs_zero3(capsys, zero):
    refused(capsys, ["dryrun", "--world-size", "2", *TINY, *BATCH, "--set", "parallel.dp=2", "--set", f"parallel.zero={zero}",
                     "--set", "parallel.reshard_after_forward=false"],
            f"parallel.reshard_after_forward: false keeps ZeRO-3's gathered weights through the step; it needs "
            f"parallel.zero = 3, got zero={zero}")


def test_hybrid_sharding_of_an_automatic_dp_is_checked_once_the_world_is_known(capsys):
    refused(capsys, ["dryrun", "--world-size", "6", *TINY, *BATCH, "--set", "parallel.dp=auto", "--set", "parallel.zero=3",
                     "--set", "parallel.dp_shard=4"], "parallel.dp_shard: must divide parallel.dp=6")


# ---------------------------------------------------------------- unknown keys: the closest known ones

@pytest.mark.parametrize("sets, message", [
    (["train.stepz=3"], "error: train.stepz: unknown key in --set; did you mean train.steps?"),
    (["train.tp=2"], "error: train.tp: unknown key in --set; did you mean parallel.tp?"),
    (["trian.steps=3"], "error: trian: unknown section in --set (known: model, parallel, train, data); did you mean train?"),
])
def test_an_unknown_key_names_the_closest_known_one(capsys, sets, message):
    assert refused(capsys, ["train", "--no-progress", *sum((["--set", s] for s in sets), [])], message) == message


def test_an_unknown_key_with_nothing_close_lists_the_sections_keys(capsys):
    line = refused(capsys, ["train", "--no-progress", "--set", "data.qqqq=1"], "data.qqqq: unknown key in --set; ")
    assert line.endswith("the keys of [data]: corpus, tokenizer, vocab_size, val_fraction, cache_dir, allow_binary")


@pytest.mark.parametrize("text, message", [
    ("steps = 3\n", "steps: not a section in {path}; keys go under one: [train] steps"),
    ("stepz = 3\n", "stepz: not a section in {path}; keys go under one of [model] [parallel] [train] [data]; "
                    "did you mean [train] steps?"),
])
def test_a_key_above_every_section_names_its_section(tmp_path, capsys, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    message = "error: " + message.format(path=path)
    assert refused(capsys, ["train", "--no-progress", "--config", str(path)], message) == message


# ---------------------------------------------------------------- data prepare: its own flags, not config keys

@pytest.mark.parametrize("flags, message", [
    (["--val-fraction", "0.7"], "error: --val-fraction: must be in (0, 0.5), got 0.7"),
    (["--seq-len", "100000"], "fewer than one sequence of --seq-len + 1 = 100001; use a larger corpus or a smaller "
                              "--seq-len"),
    (["--tokenizer", "nothere.json"], "error: --tokenizer: file 'nothere.json' does not exist"),
    (["--corpus", "{tmp}/binary.txt"], "--allow-binary trains on it anyway"),
])
def test_data_prepare_names_its_own_flags(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "play.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    (tmp_path / "binary.txt").write_bytes(bytes(range(32)) * 200)
    line = refused(capsys, ["data", "prepare", "--corpus", str(tmp_path / "play.txt"), "--vocab-size", "300",
                            "--cache-dir", str(tmp_path / "cache"), *[f.format(tmp=tmp_path) for f in flags]], message)
    assert "data." not in line and "model." not in line, line


def test_data_prepare_takes_a_tokenizer_json(tmp_path, capsys):
    (tmp_path / "play.txt").write_text("To be, or not to be, that is the question.\n" * 200)
    cache = ["--corpus", str(tmp_path / "play.txt"), "--seq-len", "16", "--cache-dir", str(tmp_path / "cache")]
    assert main(["data", "prepare", "--vocab-size", "300", *cache]) == 0
    trained = next((tmp_path / "cache").rglob("tokenizer-bpe300.json"))
    assert main(["data", "prepare", "--tokenizer", str(trained), *cache]) == 0
    assert "vocabulary" in capsys.readouterr().out
