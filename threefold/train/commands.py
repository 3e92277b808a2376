"""``threefold train`` and ``threefold generate``."""
from __future__ import annotations

import math
import os
import sys

import click

from threefold.config import AUTO, ConfigError, check_output_path, notes_after_checks
from threefold.configure import load_config, resolve_world
from threefold.words import plural


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="TOML file with [model] [parallel] [train] [data] (optional: without it, the defaults, "
                   "changed by any --set).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override one config key (repeatable).")
@click.option("--metrics-file", type=click.Path(dir_okay=False), help="Write one JSON object per step here.")
@click.option("--nproc", type=int, default=None,
              help="Processes on this machine (default: the layout's dp×tp×pp×cp); runs under torchrun when > 1.")
@click.option("--max-restarts", type=click.IntRange(0), default=0,
              help="After a rank fails, restart all ranks (torchrun) up to N times; they resume from the "
                   "last complete checkpoint (needs train.checkpoint_dir).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show the progress bar.")
def train(config_path, overrides, metrics_file, nproc, max_restarts, progress):
    """Train a model from a TOML config."""
    if metrics_file is not None:
        _check_metrics_file(metrics_file)
    launching = "LOCAL_RANK" not in os.environ  # not yet under torchrun (a rank resolves dp = "auto" from WORLD_SIZE)
    with notes_after_checks():
        cfg = load_config(config_path, overrides)
        if nproc is not None and nproc < 1:
            raise ConfigError(f"--nproc: must be positive, got {nproc}")
        if max_restarts and not cfg.train.checkpoint_dir:
            raise ConfigError("--max-restarts: restarted ranks resume from a checkpoint; set train.checkpoint_dir")
        if launching:
            if cfg.parallel.dp == AUTO and nproc is None:
                raise ConfigError('parallel.dp: "auto" takes the data-parallel degree from the number of processes; '
                                  "give --nproc N (or start the ranks with torchrun)")
            resolved = resolve_world(cfg, nproc) if cfg.parallel.dp == AUTO else cfg
            p = resolved.parallel
            if nproc is not None and nproc != p.world_size:
                raise ConfigError(f"--nproc: {plural(nproc, 'process')} {'does' if nproc == 1 else 'do'} not match "
                                  "the layout dp×tp×pp×cp = "
                                  f"{p.dp}×{p.tp}×{p.pp}×{p.cp} = {p.world_size}")
            from threefold.train.preflight import check_run  # refuse what would fail later, before any rank starts

            check_run(resolved, warn=lambda line: click.echo(line, err=True))
    if launching:
        if config_path is None and not overrides:  # nothing chose the run: say what it is before it starts
            click.echo(f"note: no --config given: training the default config, {_default_run(cfg)}; "
                       "see `threefold train --help`", err=True)
        if p.world_size > 1 or max_restarts:  # start the ranks
            from threefold.distributed.launch import relaunch

            sys.exit(relaunch(p.world_size, sys.argv[1:], max_restarts))
    from threefold.distributed.comm import CommError
    from threefold.train.checkpoint import CheckpointError
    from threefold.train.trainer import TrainingError, train as run_training

    try:
        run_training(cfg, metrics_file=metrics_file, progress=progress)
    except (TrainingError, CheckpointError) as err:  # raised on every rank alike: one of them says it
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(f"error: {err}", err=True)
        sys.exit(1)
    except CommError as err:
        # The group is broken: tearing it down would wait out every collective still in flight with
        # a rank that is gone or stuck (parallel.timeout_s each). Say why and leave at once.
        from threefold.distributed.launch import interrupted

        if interrupted():  # Ctrl-C reached every rank, and another stopped first: rank 0 says "aborted"
            if int(os.environ.get("RANK", "0")) == 0:  # it may be the one whose partner stopped first
                click.echo("aborted", err=True)
                sys.stderr.flush()
            os._exit(130)
        click.echo(f"error: {err}", err=True)
        sys.stderr.flush()
        os._exit(1)


# What ``threefold generate`` accepts: the window slides past the model's context, so --tokens is
# bounded by time only (100,000 tokens take minutes on a CPU); a temperature of 100 already
# samples the top-k tokens about uniformly; a seed is bounded as train.seed is (63 bits).
MAX_NEW_TOKENS = 100_000
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1


def _check_metrics_file(metrics_file: str) -> None:
    """Refuse, before anything is built, a --metrics-file that cannot be written: an empty path, or
    one below a file (a folder path is refused by click)."""
    if not metrics_file.strip():
        raise ConfigError("--metrics-file: the path is empty; name a file (or leave the option out)")
    check_output_path("--metrics-file", metrics_file)


def _default_run(cfg) -> str:
    """The defaults' run in a few words: model, corpus and steps."""
    m = cfg.model
    return (f"a model of {plural(m.layers, 'layer')} and hidden {m.hidden} on the corpus {cfg.data.corpus!r} for "
            f"{plural(cfg.train.steps, 'step')}")


@click.command()
@click.option("--checkpoint", "checkpoint_path", required=True, type=click.Path(),
              help="A checkpoint folder, or a checkpoint_dir (its latest checkpoint is used).")
@click.option("--prompt", default="ROMEO:", show_default=True,
              help="Text the sample continues (with --chat, the user's message).")
@click.option("--tokens", "new_tokens", default=200, show_default=True, type=click.IntRange(1, MAX_NEW_TOKENS),
              help=f"Tokens to sample after the prompt (at most {MAX_NEW_TOKENS:,}).")
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(0.0, MAX_TEMPERATURE),
              help=f"0 to {MAX_TEMPERATURE:g}; 0 is greedy decoding (hotter than {MAX_TEMPERATURE:g} is already "
                   "uniform over the top-k tokens).")
@click.option("--greedy", is_flag=True,
              help="Take the most likely token at each step, the same as --temperature 0 (--top-k, --top-p and "
                   "--seed then play no part).")
@click.option("--top-k", default=50, show_default=True, type=click.IntRange(0), metavar="K",
              help="Sample among the K most likely tokens only; 0: all of them.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0.0, 1.0, min_open=True), metavar="P",
              help="Then among the fewest most likely tokens whose probability reaches P (nucleus sampling); "
                   "1: all of them.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED),
              help="Of the sampler: 0 to 2**63 - 1, as train.seed.")
@click.option("--chat", is_flag=True, help="Put the prompt in the model's chat template (a chat model's checkpoint "
                                           "carries one) and print only the reply.")
@click.option("--threads", type=int, metavar="N",
              help="Intra-op threads to sample with (default: OMP_NUM_THREADS where it is set, else every core; "
                   "a tiny model on a busy machine runs faster on fewer).")
def generate(checkpoint_path, prompt, new_tokens, temperature, greedy, top_k, top_p, seed, chat, threads):
    """Generate text from a checkpoint, sampled (temperature, top-k, top-p) or greedy; stops at the
    tokenizer's end-of-text token."""
    for name, value in (("--temperature", temperature), ("--top-p", top_p)):
        if not math.isfinite(value):  # click's range lets NaN through: no comparison holds for it
            raise ConfigError(f"{name}: must be a finite number, got {value}")
    if greedy:
        given = click.get_current_context().get_parameter_source("temperature") != click.core.ParameterSource.DEFAULT
        if given and temperature != 0:
            raise ConfigError(f"--greedy: is --temperature 0; --temperature {temperature:g} samples instead "
                              "(give one of the two)")
        temperature = 0.0
    threads = sampling_threads(threads)
    import torch
    from threefold.models.llama import Llama
    from threefold.train import checkpoint
    from threefold.train.trainer import sample_text

    path = checkpoint.resolve(checkpoint_path)
    meta = checkpoint.read_meta(path)
    tokenizer = checkpoint.read_tokenizer(path, meta)
    if chat and not tokenizer.chat_template:
        tokenizer.chat(prompt)  # says, in one line, that there is none
    model_cfg, state = checkpoint.read_model(path)
    model = Llama.from_state_dict(model_cfg, state)  # no random draw for the state to replace
    click.echo(f"loaded {checkpoint.describe(path, meta)}", err=True)
    torch.set_num_threads(threads)
    click.echo(sample_text(model.eval(), tokenizer, prompt, new_tokens, seed, temperature, chat, top_k, top_p))


def sampling_threads(threads: int | None) -> int:
    """``generate``'s intra-op threads: ``--threads``, else ``OMP_NUM_THREADS`` (its first level where
    it lists several, as OpenMP reads it), else every core."""
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads: must be positive, got {threads}")
        return threads
    variable = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not variable:
        return os.cpu_count() or 1
    first = variable.split(",")[0].strip()
    if not first.isdecimal() or int(first) < 1:
        raise ConfigError(f"OMP_NUM_THREADS: expected a positive number of threads, got {variable!r} "
                          "(unset it, or give --threads N)")
    return int(first)


@click.command()
@click.argument("checkpoint_path", metavar="CHECKPOINT", type=click.Path())
@click.option("--tensor", "key", help="A plain-model key (e.g. blocks.0.attn.wq.weight): list its pieces and "
                                      "its moments', with the rank that wrote each.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def inspect(checkpoint_path, key, as_json):
    """Show what a checkpoint holds and which rank wrote which piece."""
    import json
    from collections import Counter
    from math import prod

    from rich.console import Console
    from rich.table import Table

    from threefold.train import checkpoint

    path = checkpoint.resolve(checkpoint_path)
    meta = checkpoint.read_meta(path)
    stored = checkpoint.pieces(path)
    if key is not None:
        import difflib

        kinds = ("model", "exp_avg", "exp_avg_sq")
        prefix, slash, rest = key.partition("/")
        plain = rest if slash and prefix in kinds else key  # the tables' name, model/blocks.0…, is the key too
        names = [n for n in (f"{kind}/{plain}" for kind in kinds) if n in stored]
        if not names:
            keys = sorted(n.partition("/")[2] for n in stored if n.startswith("model/"))
            close = difflib.get_close_matches(plain, keys, n=1)
            hint = (f"did you mean {close[0]!r}?" if close
                    else f"keys look like {keys[0]!r}") if keys else "it holds no model tensors"
            raise ConfigError(f"--tensor: {str(path)!r} holds no tensor {key!r} ({hint})")
        stored = {n: stored[n] for n in names}
    parallel = meta["config"]["parallel"]
    trained_at, context = meta["config"]["model"]["seq_len"], checkpoint.model_config(meta).seq_len
    files = Counter(piece["file"] for info in stored.values() for piece in info["pieces"])
    summary = {"checkpoint": str(path), "step": meta["step"], "adam_step": meta.get("adam_step"),
               "weights_only": bool(meta.get("weights_only")), "world_size": meta["world_size"],
               "seq_len": trained_at, "context": context,  # a fine-tune's seq_len, and the longer context it kept
               "layout": {k: parallel.get(k, 0) for k in ("dp", "tp", "pp", "zero", "sequence_parallel", "dp_shard")},
               "parameters": sum(prod(i["shape"]) for n, i in stored.items() if n.startswith("model/")),
               "files": {f: {"bytes": _size(path / f), "pieces": n} for f, n in sorted(files.items())},
               "damage": checkpoint.damage(path)}
    if as_json:
        click.echo(json.dumps({**summary, "tensors": stored} if key else summary, indent=1))
        if summary["damage"]:
            sys.exit(1)
        return
    console = Console()
    layout = summary["layout"]
    console.print(f"[bold]{path}[/bold]: step {summary['step']}"
                  + (" (weights only)" if summary["weights_only"] else
                     f", Adam step {summary['adam_step']:.0f}" if summary["adam_step"] is not None else "")
                  + f", seq_len {trained_at}" + (f" (context {context})" if context != trained_at else "")
                  + f"; saved by {plural(summary['world_size'], 'rank')}, "
                  f"dp={layout['dp']} tp={layout['tp']} pp={layout['pp']} zero={layout['zero']}"
                  + (" SP" if layout["sequence_parallel"] else "")
                  + (f" dp_shard={layout['dp_shard']}" if layout["dp_shard"] else ""), soft_wrap=True)  # a log's too
    table = Table("file", "rank", "MB", "pieces" + (f" of {key}" if key else ""))
    for file, info in summary["files"].items():
        size = "missing" if info["bytes"] is None else f"{info['bytes'] / 1e6:.2f}"  # decimal, as the docs count
        table.add_row(file, file.split("_")[2], size, str(info["pieces"]))
    console.print(table)
    if key:
        for name, info in stored.items():
            console.print(f"[bold]{name}[/bold] {tuple(info['shape'])} {info['dtype']}")
            table = Table("rank", "offsets", "sizes")
            for piece in sorted(info["pieces"], key=lambda p: (p["rank"], p["offsets"])):
                table.add_row(str(piece["rank"]), str(tuple(piece["offsets"])), str(tuple(piece["sizes"])))
            console.print(table)
    else:
        tensors = plural(sum(n.startswith("model/") for n in stored), "tensor")
        console.print(f"{summary['parameters']:,} parameters in {tensors}; --tensor KEY lists one tensor's pieces",
                      soft_wrap=True)
    if summary["damage"]:
        problem = summary["damage"].removeprefix("checkpoint: ")
        console.print(f"[bold red]damaged[/bold red]: {problem}", highlight=False, soft_wrap=True)
        sys.exit(1)


def _size(file) -> int | None:
    """A file's bytes, or None when it is missing (``inspect`` then says so)."""
    return file.stat().st_size if file.is_file() else None
