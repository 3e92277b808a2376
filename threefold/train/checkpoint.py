"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a folder ``<checkpoint_dir>/step_000120/`` holding

    model.pt              the full model state dict (keys of the plain model), written by rank 0
    optimizer.rank{r}.pt  each rank's optimizer state (the layout must match to resume)
    rng.rank{r}.pt        each rank's torch RNG state
    tokenizer.json        the tokenizer, so ``threefold generate`` needs nothing else
    trainer.json          step, sampler state, config and layout; written last

It is written under a temporary name and renamed when complete, so a folder named
``step_*`` is always whole: a crash mid-save leaves the previous checkpoint as the latest.
The last ``keep`` checkpoints are kept.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from threefold.config import Config, ConfigError
from threefold.data.tokenizer import load_tokenizer, save_tokenizer

FORMAT = "threefold-checkpoint-1"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a checkpoint_dir whose latest checkpoint is meant."""
    path = Path(path)
    if (path / "trainer.json").is_file():
        return path
    if not path.exists():
        raise ConfigError(f"checkpoint: {str(path)!r} does not exist")
    latest = list_checkpoints(path)
    if not latest:
        raise ConfigError(f"checkpoint: {str(path)!r} holds no threefold checkpoint (no step_*/trainer.json)")
    return latest[-1]


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / "trainer.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"checkpoint: cannot read {path / 'trainer.json'} ({err.__class__.__name__})") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint: {str(path)!r} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    return meta


def load_tensor_file(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint: {path} is missing") from None
    except Exception as err:  # a truncated or foreign file: one line, not a traceback
        raise ConfigError(f"checkpoint: {path} is unreadable ({err.__class__.__name__}: {str(err)[:80]})") from None


def save(root: str | Path, step: int, engine, sampler_state: dict, cfg: Config, tokenizer, keep: int) -> Path | None:
    """Every rank calls this; rank 0 publishes the folder. Returns the folder on rank 0."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if engine.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.barrier()
    model_state = engine.model_state_dict()  # a collective under ZeRO-3: every rank takes part
    torch.save(engine.optimizer_state_dict(), tmp / f"optimizer.rank{engine.rank}.pt")
    torch.save(torch.get_rng_state(), tmp / f"rng.rank{engine.rank}.pt")
    if engine.is_main:
        torch.save(model_state, tmp / "model.pt")
        save_tokenizer(tokenizer, tmp / "tokenizer.json")
    engine.barrier()
    if not engine.is_main:
        return None
    meta = {"format": FORMAT, "step": step, "sampler": sampler_state, "world_size": engine.world_size,
            "config": cfg.to_dict()}
    (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
    _fsync_dir(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())


def check_compatible(meta: dict, cfg: Config, world_size: int, path: Path) -> None:
    """Refuse a checkpoint of another model shape or another layout, naming the difference."""
    saved = meta["config"]["model"]
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab_size", "tie_embeddings", "seq_len"):
        now = getattr(cfg.model, key)
        if key in ("vocab_size",) and now is None:
            continue
        if saved.get(key) != now:
            raise ConfigError(f"checkpoint: {str(path)!r} has model.{key}={saved.get(key)}, this run has {now}")
    if meta["world_size"] != world_size:
        raise ConfigError(f"checkpoint: {str(path)!r} was saved by {meta['world_size']} ranks, this run has "
                          f"{world_size} (resuming on another layout is not supported yet)")


def read_tokenizer(path: Path, meta: dict):
    try:
        return load_tokenizer(path / "tokenizer.json", meta["config"]["data"]["tokenizer"])
    except Exception:
        raise ConfigError(f"checkpoint: {path / 'tokenizer.json'} is missing or unreadable") from None


def load(path: Path, engine, cfg: Config) -> dict:
    """Restore model, optimizer and RNG into ``engine``; return the checkpoint's metadata."""
    meta = read_meta(path)
    check_compatible(meta, cfg, engine.world_size, path)
    engine.load_model_state_dict(load_tensor_file(path / "model.pt"))
    engine.load_optimizer_state_dict(load_tensor_file(path / f"optimizer.rank{engine.rank}.pt"))
    torch.set_rng_state(load_tensor_file(path / f"rng.rank{engine.rank}.pt"))
    return meta
