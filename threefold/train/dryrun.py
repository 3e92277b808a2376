"""``threefold dryrun``: one real training step of one rank of a large job, on this machine.

The engine (threefold/train/engine.py) runs exactly as it would on the cluster — the model built
on the meta device and cut to this rank's share, forward and backward of every micro-batch
through this rank's schedule, the gradient synchronisation, the gradient norm, the optimizer
step — with two things swapped underneath it:

  * tensors are fake (``torch._subclasses.fake_tensor.FakeTensorMode``): every operation
    computes its output's shape, dtype and device, and allocates nothing;
  * the process group is PyTorch's fake backend (``torch.testing._internal.distributed.fake_pg``):
    a rank of a world of thousands joins it alone, and every collective returns at once.

Every collective still goes through ``Comm``, so the ledger counts the bytes this rank would
send on each mesh axis; the memory meters are the trainer's (``engine.memory_bytes``, the
``ActivationMeter``), and a third, ``LiveTensorMeter``, counts every tensor the step allocates,
temporaries too: its peak is what a device would need (before its allocator's rounding and
caching), and what ``threefold train``'s memory check (train/preflight.stage_memory) is held to.
Fake tensors still have sizes, so it counts them as a device would. What fake tensors cannot do is read a value (the loss, the gradient
norm): the engine's ``value_of``/``values_of`` return NaN/None for them, and nothing else in the
engine knows it is a dry run.

The step is one in the middle of a run where that differs from the first: under the
asynchronous schedules (2bw, pipedream) the first step fills the pipeline and the second is
measured, a steady step that starts the next step's forwards on the inputs the sampler would give
it, and whose stages hold every weight version they keep once the run is going (pipedream's stage
s, pp − s copies; the first step's stage 0 has made only two).

Routing is the one computation whose shapes depend on values: how many tokens each expert gets.
A dry run therefore routes every MoE layer round-robin (models/moe.py: assignment t·k + j to
expert (t·k + j) mod E), which loads every expert, and every ep rank's experts, equally: the
balanced load the planner assumes, so its expert-parallel bytes and memory are those of the
formulas. Learned routing's imbalance is a training-time quantity (the metrics file's tokens
per expert), not a dry-run one.

``device="meta"`` (``--device meta``) puts the model and the batches on the meta device instead
of this CPU: a tensor the engine creates on a fixed device then meets a meta tensor and fails
loudly, which is how a CPU-only assumption that would break CUDA shows up here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import re
import time
import warnings

import click
import torch

from threefold.config import AUTO, Config, ConfigError, notes_after_checks
from threefold.configure import load_config, resolve_world
from threefold.words import plural

MEMORY_KEYS = ("params", "grads", "optimizer", "activations")
# A dry run steps through every micro-batch of its rank one after another: beyond this many a step
# it would run for days. DeepSeek-V3's 15,360-sequence batch at dp 1 and micro-batch 1 stays under it.
MAX_MICROBATCHES = 100_000


def tokenizer_vocab_size(data) -> int:
    """The vocabulary the trainer would take from ``data.tokenizer``: a locally trained BPE has
    ``data.vocab_size`` tokens, GPT-2's 50,257, a tokenizer.json file what it lists."""
    if data.tokenizer == "bpe":
        return data.vocab_size
    if data.tokenizer == "gpt2":
        return 50257
    from tokenizers import Tokenizer

    return Tokenizer.from_file(data.tokenizer).get_vocab_size()


def dry_run_config(cfg: Config, world_size: int) -> Config:
    """``cfg`` as a job of ``world_size`` ranks would run it; ConfigError, one line, for what a
    dry run cannot do or a world the layout does not multiply to."""
    if world_size < 1:
        raise ConfigError(f"--world-size: must be a positive integer, got {world_size}")
    p = cfg.parallel
    if p.dp != AUTO and p.world_size != world_size:
        hint = (f'; parallel.dp = "auto" takes dp = {world_size // p.ranks_per_replica} from the world size'
                if world_size % p.ranks_per_replica == 0 else "")
        raise ConfigError(f"--world-size: the layout dp×tp×pp×cp = {p.dp}×{p.tp}×{p.pp}×{p.cp} = "
                          f"{plural(p.world_size, 'rank')}, not {world_size}{hint}")
    cfg = resolve_world(cfg, world_size)
    m = cfg.model
    if m.arch != "llama":
        raise ConfigError(f"model.arch: {m.arch!r} is planner-only; the engine, and so the dry run, trains "
                          "'llama' blocks")
    if m.vocab_size is None:  # the tokenizer's, as the trainer takes it, without training one
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=tokenizer_vocab_size(cfg.data)))
        m = cfg.model
    if m.init_from:
        raise ConfigError("model.init_from: a dry run starts from the seed; it reads no weights")
    if 0 < m.moe_capacity_factor < 1:  # which rows drop is a value, and fake tensors have none (nonzero's shape)
        raise ConfigError(f"model.moe_capacity_factor: {m.moe_capacity_factor} drops tokens even of the dry run's "
                          "round-robin routing, and fake tensors cannot say which; dry-run it at 1, which keeps every "
                          "token: an upper bound of the memory and bytes")
    if cfg.microbatches > MAX_MICROBATCHES:
        t = cfg.train
        raise ConfigError(f"train.global_batch: {t.global_batch} sequences are {cfg.microbatches} micro-batches a step "
                          f"for each data-parallel rank (global_batch / (dp × micro_batch) = {t.global_batch} / "
                          f"({cfg.parallel.dp} × {t.micro_batch})); a dry run steps through each, at most "
                          f"{MAX_MICROBATCHES}")
    return cfg


def too_large(err: RuntimeError) -> ConfigError | None:
    """The one line for a tensor whose size overflows torch's shape arithmetic (every key within
    its bound, their product beyond 2**63 bytes: model.hidden × the FFN width, a micro-batch of
    long sequences, …), or None for any other error."""
    text = str(err)
    if "overflow" not in text.lower():
        return None
    sizes = re.search(r"sizes=\[[^\]]*\]", text)
    return ConfigError(f"model: a tensor of this run{' (' + sizes.group(0) + ')' if sizes else ''} has more bytes than "
                       "torch can address (2**63); make model.hidden, model.ffn, model.vocab_size, model.seq_len or "
                       "train.micro_batch smaller")


def check_ranks(ranks: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    for rank in ranks:
        if not 0 <= rank < world_size:
            raise ConfigError(f"--rank: {rank} is outside a world of {plural(world_size, 'rank')} "
                              f"(0 to {world_size - 1})")
    return ranks or (0,)


_GROUPED_MM_META = None  # the Library that holds the kernel below (it is unregistered when collected)


def fake_grouped_mm_in_fp32() -> None:
    """Let fake tensors run ``torch._grouped_mm`` in fp32, as the CPU kernel does. The meta kernel
    that computes its output shape for fake tensors applies the CUDA kernel's rule (bf16 only);
    the engine's experts run it in fp32 on CPU. The replacement gives the output the CPU kernel
    would (``torch._meta_registrations``' own shape rule, without the dtype check); nothing
    else changes, and real tensors never reach a meta kernel."""
    global _GROUPED_MM_META
    if _GROUPED_MM_META is not None:
        return
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    _GROUPED_MM_META = torch.library.Library("aten", "IMPL", "Meta")
    _GROUPED_MM_META.impl("_grouped_mm", lambda a, b, offs=None, bias=None, out_dtype=None:
                          _create_grouped_mm_output_tensor(a, b, offs, out_dtype))


def tensors_of(device: str, collect: bool = True) -> list[torch.Tensor]:
    """Every tensor of the dry run's kind alive in this process: fake, or meta on ``device`` "meta";
    ``collect=False``: garbage not yet collected too (a full collection of a large process,
    pytest's after thousands of tests, takes a good part of a tiny model's dry run)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if collect:
        gc.collect()
    kind = (lambda o: o.is_meta) if device == "meta" else (lambda o: isinstance(o, FakeTensor))
    with warnings.catch_warnings():  # isinstance on torch.distributed.reduce_op warns it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and kind(o)]


def rank_tensors(device: str, earlier, model: torch.nn.Module, parts) -> list[torch.Tensor]:
    """The tensors of this rank's state as its engine built it: those of the dry run's kind alive
    now, but the ``earlier`` ones (an earlier rank's engine, which its hooks' reference cycles
    through autograd keep alive) and the full ``model``'s that none of the rank's ``parts`` holds
    (other stages' weights, never materialised)."""
    def ids(module):
        return {id(q) for q in itertools.chain(module.parameters(), module.buffers())}

    elsewhere = ids(model).difference(*(ids(part) for part in parts))
    return [o for o in tensors_of(device) if o not in earlier and id(o) not in elsewhere]


def no_progress(description: str, done: int = 0, total: int | None = None) -> None:
    pass


def dry_run_rank(cfg: Config, rank: int, device: str = "cpu", on_step=no_progress, trace: bool = False) -> dict:
    """One training step of global ``rank`` on fake tensors and a fake process group: its memory
    (bytes of parameters, gradients, optimizer states, peak activations), its bytes per ledger
    key, and the pipeline actions it executed (``[start_s, end_s, kind, micro-batch, stage]``).

    ``on_step(description, done, total)`` is told each phase, for a progress display: building
    the rank's share, then forward and backward (``done`` of ``total`` block forwards, where a
    large model's step spends its minutes), then the gradient norm and the optimizer step.
    ``trace``: also the measured step's live bytes after each operator, and where its phases
    begin (``live_trace``: ``{"bytes": [...], "phases": [[operator index, phase], ...]}``)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.weak import WeakIdKeyDictionary

    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh, mesh_sizes
    from threefold.models.llama import Block, Llama
    from threefold.train.engine import Engine, lr_at
    from threefold.train.metrics import ActivationMeter, LiveTensorMeter
    from threefold.train.trainer import split_micro_batches

    p, t = cfg.parallel, cfg.train
    if cfg.model.moe_experts:
        fake_grouped_mm_in_fp32()
    began = time.perf_counter()
    on_step("building its share of the model")
    # garbage too: a tensor here, alive or not, is no tensor of this rank's
    earlier = WeakIdKeyDictionary(dict.fromkeys(tensors_of(device, collect=False)))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.world_size)
    mesh = None
    try:
        mesh = ParallelMesh(mesh_sizes(p), rank, p.timeout_s, device=torch.device(device), expert_tp=p.expert_tp)
        # meta tensors have no values either; under a FakeTensorMode they would be fake cpu ones
        with FakeTensorMode() if device != "meta" else contextlib.nullcontext():
            with torch.device("meta"):
                model = Llama(cfg.model)
            model.set_recompute(t.recompute)
            for layer in model.moe_layers():  # fake tensors have no values to route by: the named rule
                layer.routing = "round_robin"
            engine = Engine(model, cfg, mesh, Comm(mesh))
            if engine.lookahead:  # every weight version the schedule keeps exists by the run's middle
                engine.set_adam_step(float(p.pp))
            meter = engine.activation_meter = ActivationMeter(engine.parameter_storages)
            engine.moment_shards()  # Adam's moments, as a steady step starts with them (zeros until the step)
            live = LiveTensorMeter(rank_tensors(device, earlier, model, engine.parts.values()), engine.gathered_buffers())

            def batch():
                """The rank's inputs and targets of a step, two tensors as the sampler makes them
                (data/sampler.py: their storages are what the embedding and the loss save)."""
                return split_micro_batches(*(torch.zeros((t.global_batch // engine.dp_size, cfg.model.seq_len),
                                                         dtype=torch.long, device=engine.device) for _ in range(2)),
                                           t.micro_batch)

            # 2bw, pipedream: the first step of a run fills the pipeline; the second is one of its
            # steady steps (what it carries in, sends and holds), which is the one measured
            steps_run = 2 if engine.lookahead else 1
            # Progress: each block of the rank runs forward once per micro-batch (its recomputation
            # calls the block's inner function, not the block). A pipeline that never flushes also
            # starts the next step's first forwards: hence min().
            blocks = [m for part in engine.parts.values() for m in part.modules() if isinstance(m, Block)]
            total = len(blocks) * cfg.microbatches * steps_run
            forwards = 0

            def forwarded(*_):
                nonlocal forwards
                forwards += 1
                on_step("forward and backward", min(forwards, total), total)

            for block in blocks:
                block.register_forward_pre_hook(forwarded)  # saves nothing: the meters are unchanged
            phases = []

            def phase(description):
                if live.trace is not None:
                    phases.append([len(live.trace), description])

            with live:
                for step in range(steps_run):
                    if trace and step == steps_run - 1:
                        live.trace = [live.live]
                    phase("forward and backward")
                    on_step("forward and backward", min(forwards, total), total)
                    engine.comm_bytes()  # construction's or the first step's traffic is not the step's
                    meter.peak, live.peak = meter.live, live.live
                    upcoming = [batch() for _ in range(engine.lookahead)]
                    engine.forward_backward(batch(), upcoming) if upcoming else engine.forward_backward(batch())
                    phase("gradient norm and optimizer step")
                    on_step("gradient norm and optimizer step")
                    engine.clip_grad_norm(t.grad_clip)
                    engine.optimizer_step(lr_at(0, cfg))
            memory = dict(engine.memory_bytes(), activations=meter.peak)
            comm_bytes = engine.comm_bytes()
            timeline = engine.step_timeline()
            stage_split = engine.stage_split()
    finally:
        if mesh is not None:
            mesh.shutdown()
        dist.destroy_process_group()
    hybrid = mesh.sizes["dpr"] > 1  # dpr and dps are hybrid sharding's split of dp: shown only under it
    return {"rank": rank, "coords": {a: c for a, c in mesh.coords.items()
                                     if mesh.sizes[a] > 1 and (hybrid or a not in ("dpr", "dps"))},
            "memory": memory, "live_peak": live.peak, "comm_bytes": comm_bytes,
            **({"live_trace": {"bytes": live.trace, "phases": phases}} if trace else {}),
            "actions": timeline["ranks"][mesh.coords["pp"]] if timeline else [],
            "stage_split": stage_split, "steps_run": steps_run,
            "seconds": time.perf_counter() - began}


def rank_progress(bar, name: str):
    """``on_step`` for dry_run_rank: the rank's line of the Progress ``bar``, redrawn at once
    when its phase changes (a block forward only moves the bar, at the next refresh)."""
    task, shown = bar.add_task(name, total=None), name

    def on_step(description: str, done: int = 0, total: int | None = None) -> None:
        nonlocal shown
        text = f"{name}: {description}"
        bar.update(task, description=text, completed=done, total=total or None, refresh=text != shown)
        shown = text

    return on_step


def dry_run(cfg: Config, ranks: tuple[int, ...], compare: bool = False, device: str = "cpu",
            progress: bool = True, console=None, trace: bool = False) -> list[dict]:
    """``dry_run_rank`` of each of ``ranks`` (one after another, in this process), with the
    planner's figures for it under ``predicted`` when ``compare`` (and its live bytes per operator
    when ``trace``). ``progress``: a line per rank
    on ``console`` (default: stderr) while they run, its phase and its block forwards, gone at
    the end; only on a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

    results = []
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
               TimeElapsedColumn()]
    console = console or Console(stderr=True)  # off a terminal rich draws no bar, only a stray empty line: none then
    with Progress(*columns, console=console, disable=not progress or not console.is_terminal, transient=True) as bar:
        for i, rank in enumerate(ranks):
            on_step = rank_progress(bar, f"rank {rank} of {cfg.parallel.world_size:,}"
                                    + (f" ({i + 1} of {len(ranks)})" if len(ranks) > 1 else ""))
            try:
                result = dry_run_rank(cfg, rank, device, on_step, trace)
            except RuntimeError as err:
                error = too_large(err)
                if error is None:
                    raise
                raise error from None
            if compare:
                from threefold.plan.dryrun_predict import predict_rank
                from threefold.train.preflight import stage_memory

                on_step("the planner's figures")
                result["predicted"] = predict_rank(cfg, rank)
                result["predicted"]["live_peak"] = sum(stage_memory(cfg, result["coords"].get("pp", 0)).values())
            on_step("done", 1, 1)  # its line stays while the next ranks run, its time stopped
            results.append(result)
    return results


def stage_split_note(cfg: Config) -> str | None:
    """Why a dry run's pipeline is split as it is, when the config asked for what it cannot do:
    fake tensors cannot be timed, so ``measured`` stage costs fall back to the FLOP model."""
    p = cfg.parallel
    if p.pp > 1 and p.stage_costs == "measured" and p.stage_layers is None and p.virtual_stages == 1:
        return ("parallel.stage_costs = \"measured\": a dry run's fake tensors cannot be timed, so the FLOP model "
                "split the stages; parallel.stage_costs = \"planner\" with parallel.stage_costs_gpu = NAME splits "
                "them on the planner's seconds for that GPU")
    return None


SHOWN_ACTIONS = 48  # of a long step: the warm-up, the start of the steady state and the drain's end


def actions_line(actions: list[list]) -> str:
    """``F0 F1 B0 …`` (micro-batch; ``F0.2``: of stage 2 when the rank runs several). A step of
    hundreds of micro-batches shows its first and last actions (--json keeps them all)."""
    several = len({a[4] for a in actions}) > 1
    names = [f"{kind}{mb}" + (f".{stage}" if several else "") for _, _, kind, mb, stage in actions]
    if len(names) > SHOWN_ACTIONS:
        names = [*names[:SHOWN_ACTIONS * 3 // 4], f"… {len(names) - SHOWN_ACTIONS:,} more …",
                 *names[-(SHOWN_ACTIONS // 4):]]
    return " ".join(names)


def result_table(cfg: Config, result: dict):
    from rich.table import Table

    p = cfg.parallel
    where = " ".join(f"{a}={c}" for a, c in result["coords"].items())
    title = (f"rank {result['rank']} of {p.world_size} ({p.sizes_text()}; {where or 'one rank'}), "
             + (f"one step in {result['seconds']:.1f} s" if result["steps_run"] == 1 else
                f"{result['steps_run']} steps in {result['seconds']:.1f} s, the last (a steady one) shown"))
    predicted = result.get("predicted")
    table = Table(title=title)
    for name in ("quantity", "dry run", *(("planner", "dry run/planner") if predicted else ())):
        table.add_column(name, justify="left" if name == "quantity" else "right")

    def row(quantity, measured, want):
        cells = [quantity, f"{measured:,.0f}"]
        if predicted:
            ratio = "—" if want is None else ("exact" if want == measured else
                                              f"{measured / want:.4f}" if want else "—")
            cells += ["—" if want is None else f"{want:,.0f}", ratio]
        table.add_row(*cells)

    for key in (*MEMORY_KEYS, *(["weight_versions"] if "weight_versions" in result["memory"] else [])):
        row(f"memory: {key} (B)", result["memory"][key], predicted and predicted["memory"].get(key))
    # every tensor alive at once, temporaries too; beside it what `threefold train` checks memory by
    row("memory: live peak (B)", result["live_peak"], predicted and predicted["live_peak"])
    keys = sorted(set(result["comm_bytes"]) | set(predicted["comm_bytes"] if predicted else ()))
    for key in keys:
        row(f"bytes/step: {key}", result["comm_bytes"].get(key, 0), predicted and predicted["comm_bytes"].get(key))
    return table


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The run's TOML config (without one: the defaults and --set).")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--world-size", required=True, type=int, help="Ranks of the job (dp×tp×pp×cp; ep splits dp).")
@click.option("--rank", "ranks", multiple=True, type=int, help="A global rank to run (repeatable; default 0).")
@click.option("--compare", is_flag=True, help="Put the planner's figures for the same rank beside each.")
@click.option("--device", type=click.Choice(["cpu", "meta"]), default="cpu", show_default=True,
              help="Where the fake tensors live; meta catches tensors created on a fixed device.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per rank.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show each rank's progress on stderr while it runs (on a terminal; never with --json).")
@click.option("--memory-out", type=click.Path(dir_okay=False),
              help="Draw each rank's live memory through its step to this picture (.png, .svg or .pdf).")
def dryrun(config_path, overrides, world_size, ranks, compare, device, as_json, progress, memory_out):
    """One training step of the real engine as rank R of a world of N, on fake tensors.

    Prints each rank's memory (parameters, gradients, optimizer states, peak activations, and the
    live peak of every tensor, temporaries too) and the bytes it sends per mesh axis in the step; a large model's rank can take a minute or more on a CPU."""
    from threefold.plan.pictures import check_picture_path, draw_live_memory

    ranks = check_ranks(ranks, world_size)
    check_picture_path("--memory-out", memory_out)
    with notes_after_checks():
        cfg = dry_run_config(load_config(config_path, overrides), world_size)
    results = dry_run(cfg, ranks, compare, device, progress=progress and not as_json, trace=memory_out is not None)
    if memory_out:
        traces = [result.pop("live_trace") for result in results]  # long: drawn, not printed
        labels = [f"rank {r['rank']}" + (f" ({' '.join(f'{a}={c}' for a, c in r['coords'].items())})" if r["coords"] else "")
                  for r in results]
        states = [sum(r["memory"][k] for k in ("params", "grads", "optimizer")) for r in results]
        models = [r["predicted"]["live_peak"] if compare else None for r in results]
        drawn = draw_live_memory(traces, labels, states, models, memory_out,
                                 f"live memory through one step, world {world_size:,} ({cfg.parallel.sizes_text()})")
        if not as_json:
            click.echo(f"drew {drawn}")
    if as_json:
        # the [parallel] section the ranks ran, dp and reshard_after_forward resolved (only ZeRO-3
        # keeps units gathered: true below it, as estimate's JSON says)
        p = cfg.parallel
        ran = dict(dataclasses.asdict(p), reshard_after_forward=p.resharding or p.zero != 3)
        for result in results:
            click.echo(json.dumps({**result, "parallel": ran}))
        return
    from rich.console import Console

    console = Console()
    for line in (f"pipeline stages: {results[0]['stage_split']}" if results[0]["stage_split"] else None,
                 stage_split_note(cfg)):
        if line:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    for result in results:
        console.print(result_table(cfg, result))
        if result["actions"]:
            console.print(f"pipeline actions ({cfg.parallel.schedule}, {plural(cfg.microbatches, 'micro-batch')}): "
                          + actions_line(result["actions"]), soft_wrap=True)
    if device == "meta":
        console.print("on the meta device attention runs PyTorch's math kernel, which materialises the scores: "
                      "the live peak is above what a GPU's flash attention needs (fake CPU tensors, the default, "
                      "run a flash kernel)", markup=False, highlight=False, soft_wrap=True)
