"""``threefold train`` and ``threefold generate``."""
from __future__ import annotations

import os
import sys

import click

from threefold.config import ConfigError, load_config


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="TOML file with [model] [parallel] [train] [data].")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override one config key (repeatable).")
@click.option("--metrics-file", type=click.Path(dir_okay=False), help="Write one JSON object per step here.")
@click.option("--nproc", type=int, default=None,
              help="Processes on this machine (default: the layout's dp×tp×pp×cp×ep); runs under torchrun when > 1.")
@click.option("--max-restarts", type=click.IntRange(0), default=0,
              help="After a rank fails, restart all ranks (torchrun) up to N times; they resume from the "
                   "last complete checkpoint (needs train.checkpoint_dir).")
@click.option("--progress/--no-progress", default=True, help="Show the progress bar.")
def train(config_path, overrides, metrics_file, nproc, max_restarts, progress):
    """Train a model from a TOML config."""
    cfg = load_config(config_path, overrides)
    world = cfg.parallel.world_size
    if nproc is not None:
        if nproc < 1:
            raise ConfigError(f"--nproc: must be positive, got {nproc}")
        if nproc != world:
            p = cfg.parallel
            raise ConfigError(f"--nproc: {nproc} processes do not match the layout dp×tp×pp×cp×ep = "
                              f"{p.dp}×{p.tp}×{p.pp}×{p.cp}×{p.ep} = {world}")
    if max_restarts and not cfg.train.checkpoint_dir:
        raise ConfigError("--max-restarts: restarted ranks resume from a checkpoint; set train.checkpoint_dir")
    if (world > 1 or max_restarts) and "LOCAL_RANK" not in os.environ:  # not yet under torchrun: start the ranks
        from threefold.distributed.launch import relaunch

        sys.exit(relaunch(world, sys.argv[1:], max_restarts))

    from threefold.train.trainer import TrainingError, train as run_training

    try:
        run_training(cfg, metrics_file=metrics_file, progress=progress)
    except TrainingError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)


@click.command()
@click.option("--checkpoint", "checkpoint_path", required=True, type=click.Path(),
              help="A checkpoint folder, or a checkpoint_dir (its latest checkpoint is used).")
@click.option("--prompt", default="ROMEO:", show_default=True)
@click.option("--tokens", "new_tokens", default=200, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(0.0, min_open=True))
@click.option("--seed", default=0, show_default=True, type=int)
def generate(checkpoint_path, prompt, new_tokens, temperature, seed):
    """Generate text from a checkpoint."""
    import torch
    from threefold.models.llama import Llama
    from threefold.train import checkpoint
    from threefold.train.trainer import sample_text

    path = checkpoint.resolve(checkpoint_path)
    model_cfg, state = checkpoint.read_model(path)
    model = Llama(model_cfg)
    model.load_state_dict(state)
    tokenizer = checkpoint.read_tokenizer(path, checkpoint.read_meta(path))
    torch.set_num_threads(os.cpu_count() or 1)
    click.echo(sample_text(model, tokenizer, prompt, new_tokens, seed, temperature))
