"""Every bad input gets one clear line naming the key, and exit code 2 from the CLI."""
import subprocess
import sys
import textwrap

import pytest

from threefold.cli import main
from threefold.config import ConfigError
from threefold.configure import load_config


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_and_preset_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, '[model]\npreset = "tiny"\n[train]\nsteps = 7\n'),
                      ["train.lr=0.01", "parallel.schedule=gpipe", "model.tie_embeddings=false"])
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.kv_heads) == (4, 256, 4)
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01
    assert cfg.parallel.schedule == "gpipe" and cfg.model.tie_embeddings is False


@pytest.mark.parametrize("overrides, needle", [
    (["train.no_such_key=1"], "train.no_such_key: unknown key"),
    (["nosection.key=1"], "nosection: unknown section"),
    (["train.steps=many"], "train.steps: expected an integer"),
    (["train.lr=fast"], "train.lr: expected a number"),
    (["model.tie_embeddings=maybe"], "model.tie_embeddings: expected true or false"),
    (["model.hidden=250"], "model.hidden: 250 is not divisible by model.heads=8"),
    (["model.kv_heads=3"], "model.kv_heads: model.heads=8 is not divisible by model.kv_heads=3"),
    (["train.micro_batch=5"], "train.micro_batch: 5 does not divide train.global_batch=16"),
    (["parallel.dp=4", "train.micro_batch=8"], "train.global_batch: 16 is not divisible by parallel.dp × train.micro_batch"),
    (["parallel.zero=5"], "parallel.zero: must be 0, 1, 2 or 3"),
    (["parallel.schedule=round-robin"], "parallel.schedule: must be one of"),
    (["data.corpus=/no/such/corpus"], "data.corpus: path '/no/such/corpus' does not exist"),
    (["data.corpus="], "data.corpus: empty; give 'shakespeare' or a path"),  # was every text file below "."
    (['data.tokenizer=""'], "data.tokenizer: empty"),
    (["data.cache_dir= "], "data.cache_dir: empty"),
    (["train.dtype=float16"], "train.dtype"),
    (["train.recompute=some"], "train.recompute"),
    (["train.resume=true"], "train.resume: needs train.checkpoint_dir"),
    (["model.preset=gpt-9"], "model.preset: unknown preset 'gpt-9'"),
    (["train.steps"], "expected section.key=value"),
])
def test_bad_config_names_the_key(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, '[model]\npreset = "tiny"\n'), overrides)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\n"))


def test_cli_exit_code_2_one_line_no_traceback(tmp_path, capsys):
    path = write(tmp_path, '[model]\npreset = "tiny"\n')
    assert main(["train", "--config", str(path), "--set", "train.no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("error: train.no_such_key: unknown key in --set; the keys of [train]: steps, ")
    assert len(err.strip().splitlines()) == 1


def test_cli_nproc_must_match_layout(tmp_path, capsys):
    path = write(tmp_path, '[model]\npreset = "tiny"\n[parallel]\ndp = 2\n')
    assert main(["train", "--config", str(path), "--nproc", "4"]) == 2
    assert "--nproc: 4 processes do not match the layout" in capsys.readouterr().err


def test_console_script_exit_code(tmp_path):
    path = write(tmp_path, '[model]\npreset = "tiny"\nhidden = 250\n')
    proc = subprocess.run([sys.executable, "-m", "threefold.cli", "train", "--config", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("given, dtype", [("bf16", "bfloat16"), ("BF16", "bfloat16"), ("fp32", "float32"),
                                          ("bfloat16", "bfloat16"), ("BFLOAT16", "bfloat16")])
def test_train_dtype_takes_the_planners_names(given, dtype):
    """`--set train.dtype=bf16` was refused while estimate and plan take bf16."""
    assert load_config(None, [f"train.dtype={given}"]).train.dtype == dtype


def test_a_list_key_takes_comma_separated_numbers_on_the_command_line():
    """`--set parallel.stage_layers=3,1` was refused ("expected a list"); estimate takes --stage-layers 3,1."""
    cfg = load_config(None, ["model.preset=tiny", "parallel.pp=2", "parallel.stage_layers=3,1"])
    assert cfg.parallel.stage_layers == [3, 1]
    with pytest.raises(ConfigError, match=r"^parallel.stage_layers: expected a list, got '3,x'$"):
        load_config(None, ["model.preset=tiny", "parallel.pp=2", "parallel.stage_layers=3,x"])
