"""Our pipeline parallelism against ``torch.distributed.pipelining``, at pp=4, in one run.

Four gloo processes (one thread each) build the same model from the same seed twice: once as
our engine (schedule.py's actions run by runtime.py), once as PyTorch's
``PipelineStage``s, cut into the same stages (our ``partition``), driven by PyTorch's schedule.
Three pairs, each on the same micro-batches:

  1f1b         ours  vs  Schedule1F1B
  interleaved  ours (v=2)  vs  ScheduleInterleaved1F1B (v=2)
  zero bubble  ours zb-h1 (v=1)  vs  ScheduleInterleavedZeroBubble (v=2, its only single-
               pipeline zero-bubble schedule with the split backward on a ring of ranks)
  dualpipev    ours  vs  ScheduleDualPipeV (both: two stages a rank, placed as a V)

A step is the same on both sides: the schedule over all micro-batches, the global gradient
norm (summed over stages) and clipping, AdamW. The steps alternate between the two sides;
a step lasts until its slowest rank is done. Reported: both sides' losses (they must agree),
the median step time of each, and ours / PyTorch's (below 1: ours is faster). Embeddings are
untied: PyTorch's stages would not keep the two copies of a tied weight in step.

    .venv/bin/python bench/pp_vs_torch.py                 # writes bench/results/pp.json
"""
from __future__ import annotations

import copy
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

from threefold.config import Config
from threefold.models.llama import Llama, cross_entropy
from threefold.parallel.pipeline.partition import partition
from threefold.train.engine import build_adamw

from common import (alternate_steps, fresh_model, join_gloo, save_and_print, spawn_ranks, summarise_pair,
                    train_step)

RESULTS = Path(__file__).parent / "results" / "pp.json"
PP = 4
PAIRS = {  # ours (schedule, virtual stages) → PyTorch's schedule class and virtual stages
    "1f1b": (("1f1b", 1), ("Schedule1F1B", 1)),
    "interleaved": (("interleaved", 2), ("ScheduleInterleaved1F1B", 2)),
    "zero-bubble": (("zb-h1", 1), ("ScheduleInterleavedZeroBubble", 2)),
    "dualpipev": (("dualpipev", 2), ("ScheduleDualPipeV", 2)),
}
V_SHAPED = {"ScheduleDualPipeV"}  # rank r holds stages r and 2·pp − 1 − r, not r and pp + r


def bench_config(schedule: str, virtual_stages: int, layers: int, hidden: int, micro_batch: int,
                 microbatches: int) -> Config:
    cfg = Config()
    cfg.model.layers, cfg.model.hidden, cfg.model.heads = layers, hidden, 8
    cfg.model.vocab_size, cfg.model.seq_len, cfg.model.tie_embeddings = 4096, 128, False
    cfg.train.micro_batch, cfg.train.global_batch = micro_batch, micro_batch * microbatches
    cfg.train.grad_clip, cfg.train.lr = 1.0, 1e-3
    cfg.parallel.pp, cfg.parallel.schedule, cfg.parallel.virtual_stages = PP, schedule, virtual_stages
    return cfg.validate()


class TorchStage(nn.Module):
    """One stage for PyTorch's runtime: the plain model's modules it runs, as a forward of one tensor."""

    def __init__(self, model: Llama, blocks: range, first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.layers = nn.ModuleList(model.blocks[i] for i in blocks)
        self.norm, self.head = (model.norm, model.head) if last else (None, None)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        positions = range(x.shape[1])
        cos, sin = self.rope_cos[:x.shape[1]], self.rope_sin[:x.shape[1]]
        for block in self.layers:
            x = block(x, cos, sin, positions)
        return self.head(self.norm(x)) if self.head is not None else x


class TorchPipeline:
    """PyTorch's stages and schedule, and an optimizer step like our engine's."""

    def __init__(self, plain: Llama, cfg: Config, schedule_name: str, virtual_stages: int):
        import torch.distributed.pipelining as pipelining

        rank = dist.get_rank()
        spans = partition(cfg.model, PP, virtual_stages)
        mine = [rank, 2 * PP - 1 - rank] if schedule_name in V_SHAPED else list(range(rank, PP * virtual_stages, PP))
        self.modules = [TorchStage(copy.deepcopy(plain), spans[s].blocks, spans[s].first, spans[s].last)
                        for s in mine]
        stages = [pipelining.PipelineStage(module, s, PP * virtual_stages, torch.device("cpu"))
                  for module, s in zip(self.modules, mine)]
        schedule_class = getattr(pipelining, schedule_name)
        self.schedule = schedule_class(stages[0] if virtual_stages == 1 else stages, cfg.microbatches,
                                       loss_fn=cross_entropy)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = build_adamw([(str(i), p) for i, p in enumerate(self.params)], cfg)
        self.cfg, self.holds_loss = cfg, any(spans[s].last for s in mine)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        losses = []
        if dist.get_rank() == 0:
            self.schedule.step(inputs, target=targets, losses=losses)
        else:
            self.schedule.step(target=targets, losses=losses)
        squares = torch.stack([p.grad.pow(2).sum() for p in self.params]).sum()
        dist.all_reduce(squares)
        coef = torch.clamp(self.cfg.train.grad_clip / (squares.sqrt() + 1e-6), max=1.0)
        for p in self.params:
            p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().reshape(1) if self.holds_loss else torch.zeros(1)
        dist.all_reduce(loss)
        return loss.item()


def our_pipeline(plain: Llama, cfg: Config):
    from threefold.train.engine import build_engine

    engine = build_engine(plain, cfg)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        micro_batches = list(zip(inputs.split(cfg.train.micro_batch), targets.split(cfg.train.micro_batch)))
        return train_step(engine, micro_batches, cfg)

    return engine, step


def run_pair(pair: str, layers: int, hidden: int, micro_batch: int, microbatches: int, warmup: int, steps: int) -> dict:
    (ours_schedule, ours_v), (torch_schedule, torch_v) = PAIRS[pair]
    cfg = bench_config(ours_schedule, ours_v, layers, hidden, micro_batch, microbatches)
    plain = fresh_model(cfg)
    theirs = TorchPipeline(plain, cfg, torch_schedule, torch_v)
    engine, ours = our_pipeline(plain, cfg)
    out = {"ours": {"schedule": ours_schedule, "virtual_stages": ours_v},
           "torch": {"schedule": torch_schedule, "virtual_stages": torch_v}}
    timed = alternate_steps(cfg, {"ours": ours, "torch": theirs}, warmup, steps)
    for side in out:
        out[side].update(timed[side])
    out["ours"]["measured_timeline"] = engine.step_timeline()
    engine.shutdown()
    return summarise_pair(out)


def worker(rank: int, world: int, port: int, options: dict, queue) -> None:
    """One pipeline rank (spawn_ranks starts it): every pair; rank 0 sends the results."""
    join_gloo(rank, world, port, threads=1, timeout_s=600)
    pairs = options.pop("pairs")
    results = {pair: run_pair(pair, **options) for pair in pairs}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def results_table(results: dict) -> Table:
    table = Table(title=f"pp={PP}, {results['layers']} layers, hidden {results['hidden']}, {results['microbatches']} "
                        f"micro-batches of {results['micro_batch']} × {results['seq_len']} tokens, 1 thread per rank")
    for column in ("ours", "PyTorch", "ours (s)", "PyTorch (s)", "ratio", "max |Δloss|"):
        table.add_column(column, justify="left" if column in ("ours", "PyTorch") else "right", no_wrap=True)
    for run in results["pairs"].values():
        ours, theirs = run["ours"], run["torch"]
        table.add_row(ours["schedule"] + (f" v={ours['virtual_stages']}" if ours["virtual_stages"] > 1 else ""),
                      theirs["schedule"].removeprefix("Schedule"), f"{ours['step_time_s']:.3f}",
                      f"{theirs['step_time_s']:.3f}", f"{run['ratio']:.3f}", f"{run['max_loss_difference']:.1e}")
    return table


@click.command()
@click.option("--layers", default=8, show_default=True, help="Blocks (interleaved needs a multiple of 8).")
@click.option("--hidden", default=256, show_default=True)
@click.option("--micro-batch", default=2, show_default=True, help="Sequences per micro-batch.")
@click.option("--microbatches", default=8, show_default=True, help="Micro-batches per step.")
@click.option("--warmup", default=2, show_default=True, help="Untimed steps of each first.")
@click.option("--steps", default=6, show_default=True, help="Timed steps of each.")
@click.option("--pair", "pairs", type=click.Choice(list(PAIRS)), multiple=True, help="Repeatable; default: all.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(layers, hidden, micro_batch, microbatches, warmup, steps, pairs, out) -> None:
    """Step time and losses of our pipeline schedules vs torch.distributed.pipelining at pp=4."""
    console = Console(width=100)  # the table's seven columns, unwrapped
    options = dict(layers=layers, hidden=hidden, micro_batch=micro_batch, microbatches=microbatches, warmup=warmup,
                   steps=steps, pairs=list(pairs or PAIRS))
    with console.status(f"pp={PP}: {warmup} + {steps} alternating steps per pair"):
        runs = spawn_ranks(PP, worker, options)
    results = {"pp": PP, "layers": layers, "hidden": hidden, "vocab_size": 4096, "seq_len": 128,
               "micro_batch": micro_batch, "microbatches": microbatches, "threads_per_rank": 1,
               "warmup_steps": warmup, "timed_steps": steps, "torch_version": torch.__version__, "pairs": runs}
    save_and_print(results, out, results_table(results), console)


if __name__ == "__main__":
    main()
