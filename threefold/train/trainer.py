"""The training loop. It is the same for every layout: the engine decides how a step is
computed (one process, data parallel, sharded, …); the loop feeds it the global batch of
this step, steps the learning rate, evaluates, logs and checkpoints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from threefold.config import AUTO, Config, ConfigError
from threefold.configure import resolve_world
from threefold.data import BatchSampler, prepare_dataset, val_batches
from threefold.distributed.launch import StopRequest, keep_large_blocks_in_the_heap, restart_count
from threefold.models.llama import Llama
from threefold.train import checkpoint
from threefold.train.engine import build_engine, lr_at
from threefold.train.metrics import ActivationMeter, MetricsWriter, least_exposed
from threefold.train.preflight import check_init_from_stays
from threefold.words import plural


class TrainingError(RuntimeError):
    """Training cannot continue (for instance a loss that is not finite)."""


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    sample: str | None = None
    checkpoint: str | None = None
    unigram_entropy: float | None = None
    seconds: float = 0.0
    stopped_at: int | None = None  # the step after which a SIGTERM stopped the run


def set_threads(cfg: Config) -> None:
    """Each rank takes its share of the cores, so N ranks do not oversubscribe the machine."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world))


def resolve_vocab(cfg: Config, tokenizer_vocab: int) -> Config:
    """The model's vocabulary defaults to the tokenizer's; a smaller one cannot embed every token."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer_vocab))
    if vocab < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size: {vocab} is smaller than the tokenizer's {tokenizer_vocab} tokens")
    return cfg


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int):
    return list(zip(inputs.split(micro_batch), targets.split(micro_batch)))


def flushes_after(step: int, cfg: Config) -> bool:
    """Whether a pipeline that never flushes must drain after ``step`` (from 1): the run ends, or
    it evaluates or saves there (both want the step's weights, and nothing in flight)."""
    t = cfg.train
    return (step >= t.steps or bool(t.eval_every and step % t.eval_every == 0)
            or bool(t.checkpoint_dir and t.checkpoint_every and step % t.checkpoint_every == 0))


def upcoming_batches(engine, sampler: BatchSampler, cfg: Config, step: int) -> list:
    """This rank's micro-batches of the steps after ``step`` (from 1) that a pipeline that never
    flushes starts during it: up to ``engine.lookahead`` of them, none past a flush."""
    upcoming = []
    for k in range(1, engine.lookahead + 1):
        if flushes_after(step + k - 1, cfg):
            break
        inputs, targets = (x.to(engine.device) for x in
                           sampler.local_batch_at(sampler.step + k - 1, engine.dp_rank, engine.dp_size))
        upcoming.append(split_micro_batches(inputs, targets, cfg.train.micro_batch))
    return upcoming


def _check_tokenizers(cfg: Config, tokenizer, resumed) -> None:
    """The checkpoint resumed, or else the one or the Hugging Face folder model.init_from names,
    reads token ids as this run's tokenizer does (refused on the main process, in one line; the
    others exit 2)."""
    from threefold.interop.hf import init_from_checkpoint

    with _said_by_rank_0():
        if resumed is not None:  # its weights replace init_from's
            checkpoint.check_tokenizer(resumed, tokenizer, "train.resume")
        elif cfg.model.init_from:
            path = init_from_checkpoint(cfg.model.init_from) or Path(cfg.model.init_from)
            checkpoint.check_tokenizer(path, tokenizer, "model.init_from")


def _started_from(cfg: Config, resumed) -> Path | None:
    """The checkpoint resumed, or else the one model.init_from names (None: none, or a Hugging Face folder)."""
    from threefold.interop.hf import init_from_checkpoint

    return resumed or (init_from_checkpoint(cfg.model.init_from) if cfg.model.init_from else None)


def _tokenizer_meta_to_keep(cfg: Config, resumed) -> dict:
    """What the checkpoint resumed, or else model.init_from, records of its tokenizer beyond
    tokenizer.json (checkpoint.tokenizer_meta; a Hugging Face folder's tokenizer_config.json):
    an imported chat model's turn-ending token and template, which this run's checkpoints keep."""
    from threefold.interop.hf import chat_settings

    source = _started_from(cfg, resumed)
    if source is not None:
        return checkpoint.tokenizer_meta(checkpoint.read_meta(source))
    if not cfg.model.init_from:
        return {}
    eos, template, bos = chat_settings(Path(cfg.model.init_from))
    return checkpoint.tokenizer_meta({"eos_token": eos, "bos_token": bos, "chat_template": template})


def _context_to_keep(cfg: Config, resumed) -> dict:
    """The context of the model the run resumed or started from (checkpoint.CONTEXT_KEY; a Hugging
    Face folder's max_position_embeddings) where it is longer than this run's model.seq_len: a
    fine-tune at sequence 64 of a model made for 8,192 saves 8,192 for generate and export."""
    from threefold.interop.hf import CONFIG, model_config_from_hf, read_json

    source = _started_from(cfg, resumed)
    if source is not None:
        context = checkpoint.model_config(checkpoint.read_meta(source)).seq_len
    elif cfg.model.init_from:
        folder = Path(cfg.model.init_from)
        context = model_config_from_hf(read_json(folder / CONFIG), str(folder)).seq_len
    else:
        return {}
    return {checkpoint.CONTEXT_KEY: context} if context > cfg.model.seq_len else {}


@contextlib.contextmanager
def _said_by_rank_0():
    """A refusal every rank reaches alike: rank 0 says it in one line, the others exit 2 quietly."""
    try:
        yield
    except ConfigError:
        if _is_main_process():
            raise
        raise SystemExit(2) from None


def train(cfg: Config, metrics_file: str | None = None, progress: bool = True,
          console: Console | None = None) -> TrainResult:
    stop = StopRequest(restart_count())  # from here on, SIGTERM means: finish the step, save, exit 0
    try:
        return _train(cfg, metrics_file, progress, console or Console(stderr=True), stop)
    finally:
        stop.close()


def _train(cfg: Config, metrics_file: str | None, progress: bool, console: Console, stop: StopRequest) -> TrainResult:
    auto_dp = cfg.parallel.dp == AUTO
    cfg = resolve_world(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # the engine gets a concrete layout
    t = cfg.train
    resuming = t.resume or (restart_count() and t.checkpoint_dir)  # or torchrun restarted us after a failure
    if t.checkpoint_dir:
        checkpoint.check_root(t.checkpoint_dir)
    found = checkpoint.list_checkpoints(t.checkpoint_dir) if t.checkpoint_dir else []
    if resuming and found:
        with _said_by_rank_0():  # under torchrun or SLURM no preflight ran
            saved_step = checkpoint.check_resumable(found[-1], cfg)["step"]
            problem = checkpoint.damage(found[-1])
            if problem:
                raise ConfigError(problem)
        if saved_step >= t.steps:  # a requeued job that has finished: say so, and leave everything as it is
            if _is_main_process():
                console.print(f"train.steps = {t.steps}: {found[-1]} is at step {saved_step}, so nothing is left to "
                              "train (raise train.steps to go on)", markup=False, highlight=False, soft_wrap=True)
            return TrainResult()
    if found and not resuming and cfg.model.init_from:
        with _said_by_rank_0():
            check_init_from_stays(cfg.model.init_from, found)  # the preflight's refusal, for torchrun's ranks
    unfinished = checkpoint.unfinished_saves(t.checkpoint_dir) if t.checkpoint_dir and not resuming else []
    if unfinished and _is_main_process():  # a crash mid-save left them: not checkpoints, nothing to keep
        console.print(f"train.checkpoint_dir held {checkpoint.remove_unfinished(unfinished)}", style="yellow",
                      markup=False, highlight=False, soft_wrap=True)
    if found and not resuming and _is_main_process():
        # Left there, an earlier run's higher steps would outrank this run's checkpoints: keep_checkpoints
        # would delete the new ones and a resume would pick the old. Moved aside, nothing is lost.
        aside = checkpoint.move_aside(found)
        console.print(f"train.checkpoint_dir held an earlier run's checkpoints (latest {found[-1].name}): "
                      f"{checkpoint.aside_note(found, aside)}; train.resume=true continues a run instead",
                      style="yellow", markup=False, highlight=False, soft_wrap=True)
    set_threads(cfg)
    keep_large_blocks_in_the_heap()
    torch.manual_seed(cfg.train.seed)
    dataset = prepare_dataset(cfg.data, cfg.model.seq_len, progress=progress and _is_main_process())
    resumed = found[-1] if resuming and found else None
    _check_tokenizers(cfg, dataset.tokenizer, resumed)
    cfg = resolve_vocab(cfg, dataset.tokenizer.vocab_size)
    t = cfg.train

    # Built on the meta device: the engine draws, or with [model] init_from reads, only the
    # tensors this rank keeps.
    with torch.device("meta"):
        model = Llama(cfg.model)
    model.set_recompute(t.recompute)
    n_params = sum(p.numel() for p in model.parameters())  # before a strategy keeps its part
    moe = bool(model.moe_layers())
    engine = build_engine(model, cfg)
    if cfg.model.init_from and engine.is_main:  # pretrained weights from a Hugging Face folder or a checkpoint
        from threefold.interop.hf import describe_init_from

        console.print(f"model.init_from: loaded {describe_init_from(cfg.model.init_from)}", markup=False,
                      highlight=False, soft_wrap=True)
    engine.activation_meter = ActivationMeter(engine.parameter_storages)
    main = engine.is_main
    sampler = BatchSampler(dataset.train_tokens, cfg.model.seq_len, t.global_batch, t.seed)
    # The same eval_batches × global_batch windows whatever the layout, in batches of micro_batch
    # (which divides global_batch): equal batches, so the mean of their means is the mean over all tokens.
    eval_data = val_batches(dataset.val_tokens, cfg.model.seq_len, t.micro_batch,
                            t.eval_batches * t.global_batch // t.micro_batch)

    start = 0
    if resuming:
        if found:
            meta = checkpoint.load(found[-1], engine, cfg)
            sampler.load_state_dict(meta["sampler"])
            start = meta["step"]
            if main and cfg.model.init_from:
                console.print("model.init_from: its weights are replaced by the checkpoint the run resumes from",
                              markup=False, highlight=False, soft_wrap=True)
            if main:
                saved, now = _layout(meta["config"]["parallel"]), _layout(dataclasses.asdict(cfg.parallel))
                derived = f"; parallel.dp = \"auto\" on {plural(engine.world_size, 'rank')}" if auto_dp else ""
                moved = f" (saved on {saved}, resharded to {now}{derived})" if saved != now else ""
                console.print(f"resumed from {found[-1]} at step {start}{moved}", markup=False, highlight=False,
                              soft_wrap=True)  # one line, whatever the terminal's width
        elif main:
            earlier = checkpoint.earlier_runs(t.checkpoint_dir)  # a fresh start moved the run meant here aside?
            hint = (f" ({earlier[-1]} holds an earlier run's checkpoints: move its step_* folders back to resume "
                    "them)" if earlier else "")
            console.print(f"no checkpoint in {t.checkpoint_dir} yet: starting at step 0{hint}", markup=False,
                          highlight=False, soft_wrap=True)

    say = (lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True)) if main else None
    kept_meta = {**_tokenizer_meta_to_keep(cfg, resumed), **_context_to_keep(cfg, resumed)}
    checkpointer = checkpoint.Checkpointer(engine, t.async_checkpoint, cfg.parallel.timeout_s, kept_meta, say)
    result = TrainResult(unigram_entropy=dataset.meta.get("unigram_entropy"))
    writer = MetricsWriter(metrics_file if main else None, resume_step=start)
    if main:  # a status line is one line, in a log too (rich wraps at 80 columns off a terminal)
        say(f"model: {n_params / 1e6:.2f}M parameters, {plural(cfg.model.layers, 'layer')}, hidden {cfg.model.hidden}; "
            f"data: {dataset.meta.get('train_tokens', len(dataset.train_tokens)):,} training tokens, "
            f"unigram entropy {result.unigram_entropy:.3f} nats/token")
        if engine.stage_split():
            console.print(f"pipeline stages: {engine.stage_split()}", markup=False, highlight=False, soft_wrap=True)
    tokens_per_step = t.global_batch * cfg.model.seq_len
    began = time.perf_counter()
    columns = [TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
               TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn()]
    with Progress(*columns, console=console, disable=not (progress and main), transient=False) as bar:
        task = bar.add_task("train", total=t.steps, completed=start, loss=float("nan"), tps=0.0)
        for step in range(start, t.steps):
            step_began = time.perf_counter()
            inputs, targets = (x.to(engine.device) for x in sampler.next_batch(engine.dp_rank, engine.dp_size))
            engine.activation_meter.peak = engine.activation_meter.live  # this step's peak
            micro_batches = split_micro_batches(inputs, targets, t.micro_batch)
            upcoming = upcoming_batches(engine, sampler, cfg, step + 1)  # 2bw, pipedream: the next steps
            loss = engine.forward_backward(micro_batches, upcoming) if upcoming else engine.forward_backward(micro_batches)
            grad_norm = engine.clip_grad_norm(t.grad_clip)
            lr = lr_at(step, cfg)
            # Loss and norm are global, so every rank takes the same decision.
            skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
            if skipped and t.nan_policy == "stop":
                raise TrainingError(f"step {step + 1}: the loss is {loss} and the gradient norm {grad_norm}; "
                                    "stopping before they corrupt the weights (train.nan_policy = \"skip\" skips "
                                    "such steps)")
            if not skipped:
                engine.optimizer_step(lr)
            # the routing bias steps with the weights, from the step's counts summed over the dp ranks
            moe_stats = engine.end_moe_step(update_bias=not skipped) if moe else None
            memory = dict(engine.memory_bytes(), activations=engine.activation_meter.peak)
            engine.zero_grad()
            step_time = time.perf_counter() - step_began
            result.losses.append(loss)
            comm_bytes, comm_exposed, comm_calls = engine.comm_step()
            # collectives on every rank, for the metrics file only: no step without one pays for them
            comm_exposed_least, comm_call_least = least_exposed(engine.comm, comm_calls) if metrics_file else ({}, {})
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time,
                      "tokens_per_s": tokens_per_step / step_time, "comm_bytes": comm_bytes,
                      "comm_exposed_s": comm_exposed, "comm_exposed_least_s": comm_exposed_least,
                      "comm_exposed_call_least_s": comm_call_least,
                      "memory": memory, **({"skipped": True} if skipped else {}),
                      **({"warmup": True} if step == start else {}),  # this launch's first: compare leaves it out
                      **({"moe": moe_stats} if moe else {})}
            timeline = engine.step_timeline()
            if timeline is not None:  # `threefold schedule --from-metrics` draws it beside its simulation
                record["timeline"] = timeline
            if t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                record["val_loss"] = engine.eval_loss(eval_data)
                result.val_losses.append((step + 1, record["val_loss"]))
                if main:
                    balance = f", max/mean tokens per expert {record['moe']['max_over_mean']:.2f}" if moe else ""
                    if moe and "ep_max_over_mean" in record["moe"]:  # what every ep rank waits for
                        balance += f" (busiest ep rank {record['moe']['ep_max_over_mean']:.2f}× the mean)"
                    bar.console.print(f"step {step + 1}: train loss {loss:.4f}, validation loss "
                                      f"{record['val_loss']:.4f}{balance}", markup=False, highlight=False,
                                      soft_wrap=True)
            writer.write(record)
            bar.update(task, completed=step + 1, loss=loss, tps=record["tokens_per_s"])
            if main and not progress and (step + 1) % t.log_every == 0:  # the bar's line, for logs (--no-progress)
                console.print(f"step {step + 1}/{t.steps}: loss {loss:.4f}, lr {lr:.3g}, grad norm {grad_norm:.3g}, "
                              f"{record['tokens_per_s']:,.0f} tok/s", markup=False, highlight=False, soft_wrap=True)
            stop.check_interrupt()
            stopping = step + 1 < t.steps and stop.stop_after(step + 1)  # every rank decides the same
            if stopping:
                engine.discard_pipeline_carry()  # 2bw, pipedream: the next step's forwards will not run
            if t.checkpoint_dir and (stopping or (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0)
                                     or step + 1 == t.steps):
                saved = checkpointer.save(t.checkpoint_dir, step + 1, cfg, sampler.state_dict(), dataset.tokenizer,
                                          t.keep_checkpoints)
                result.checkpoint = str(saved) if saved else None
            if stopping:
                result.stopped_at = step + 1
                break
    checkpointer.close()  # the last save is complete and published before the run ends
    if result.stopped_at is not None and main:
        kept = (f"saved {checkpoint.step_dir(t.checkpoint_dir, result.stopped_at)}; train.resume=true continues it"
                if t.checkpoint_dir else "nothing saved (no train.checkpoint_dir)")
        console.print(f"SIGTERM: stopped after step {result.stopped_at} of {t.steps}, {kept}", markup=False,
                      highlight=False, soft_wrap=True)
    writer.close()
    result.seconds = time.perf_counter() - began
    if t.sample_tokens and result.stopped_at is None:
        state = engine.model_state_dict()  # a collective under ZeRO-3: every rank takes part
        if main:
            # the model `threefold generate` reads from this run's checkpoint: a fine-tune's window is
            # the context it keeps, not its shorter seq_len, so the sample is the one generate prints
            plain = Llama.from_state_dict(checkpoint.model_config({"config": cfg.to_dict(), **kept_meta}),
                                          state).to(engine.device)
            result.sample = sample_text(plain.eval(), dataset.tokenizer, t.sample_prompt, t.sample_tokens, t.seed)
            console.rule("sample")
            console.print(result.sample, markup=False, highlight=False, soft_wrap=True)  # as generate prints it
    engine.shutdown()
    return result


def sample_text(model: Llama, tokenizer, prompt: str, new_tokens: int, seed: int, temperature: float = 0.8,
                chat: bool = False, top_k: int | None = 50, top_p: float = 1.0) -> str:
    """The prompt and up to ``new_tokens`` sampled after it (``Llama.generate``: temperature 0 is
    greedy), ending before the tokenizer's end of text. ``chat``: the prompt is put in the model's
    chat template, and only the reply returned."""
    text = tokenizer.chat(prompt) if chat else prompt
    ids = tokenizer.encode(text) or [tokenizer.eos_id]
    generator = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids]), new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         generator=generator, eos_id=tokenizer.eos_id)[0].tolist()
    if out[-1] == tokenizer.eos_id and len(out) > len(ids):
        out = out[:-1]
    return tokenizer.decode(out[len(ids):] if chat else out)


def _layout(parallel: dict) -> str:
    """dp=2 tp=2 pp=2 zero=1 (cp=2, dp_shard=2): the parts of a layout that decide how states are
    split (cp, which shards ZeRO's states over dp × cp, and hybrid sharding's groups, when used)."""
    cp, dp_shard = parallel.get("cp", 1), parallel.get("dp_shard", 0)
    return (" ".join(f"{key}={parallel[key]}" for key in ("dp", "tp", "pp", "zero")) + (f" cp={cp}" if cp > 1 else "")
            + (f" dp_shard={dp_shard}" if dp_shard else ""))


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
