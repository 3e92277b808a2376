"""Our tensor parallelism against PyTorch's DTensor tensor parallelism, at tp=2, in one run.

Two gloo processes (one thread each) build the same model from the same seed twice: once
transformed by ``threefold.parallel.tensor_parallel`` (our engine: f/g operators, vocab-parallel
embedding and loss), once by ``parallelize_module`` with PyTorch's styles (ColwiseParallel,
RowwiseParallel, SequenceParallel, PrepareModuleInput, ``loss_parallel``), with the plan
torchtitan uses for Llama. Steps alternate between the two on the same batches: forward,
backward, gradient clipping, AdamW. Both run with and without sequence parallelism.

With sequence parallelism a third side runs too: ours with ``parallel.tp_overlap`` (the
gathers and reduce-scatters as rings of sends pipelined with the products).

Reported: the losses of each side (they must agree), the median step time of each, the ratio
ours / PyTorch's (below 1: ours is faster), with SP the ratio overlapped / plain ours, and for
ours the seconds per step a rank was blocked on tp traffic (a collective's whole duration; with
the overlap, the waits for sends and receives that the products did not hide).
Embeddings are untied: DTensor cannot shard one parameter as both the embedding's rows and the
head's.

    .venv/bin/python bench/tp_vs_torch.py                 # writes bench/results/tp.json
"""
from __future__ import annotations

import copy
import statistics
from pathlib import Path

import click
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from threefold.config import Config
from threefold.models.llama import Llama

from common import (alternate_steps, fresh_model, join_gloo, preset_config, save_and_print, spawn_ranks,
                    summarise_pair, train_step)

RESULTS = Path(__file__).parent / "results" / "tp.json"
TP = 2


def bench_config(micro_batch: int, sequence_parallel: bool) -> Config:
    cfg = preset_config("small")
    cfg.model.tie_embeddings = False
    cfg.train.micro_batch = cfg.train.global_batch = micro_batch
    cfg.train.grad_clip = 1.0
    cfg.train.lr = 1e-3
    cfg.parallel.tp = TP
    cfg.parallel.sequence_parallel = sequence_parallel
    return cfg.validate()


def torch_tensor_parallel(model: Llama, mesh, sequence_parallel: bool) -> Llama:
    """PyTorch's DTensor TP with torchtitan's Llama plan (its module names mapped to ours)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sequence = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence),
        "head": ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.blocks:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=sequence),
                "mlp.w_gate": ColwiseParallel(), "mlp.w_up": ColwiseParallel(),
                "mlp.w_down": RowwiseParallel(output_layouts=sequence)}
        if sequence_parallel:
            plan.update({
                "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                           desired_input_layouts=(Replicate(), None, None, None, None), use_local_output=True),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
            })
        parallelize_module(block, mesh, plan)
    return model


class TorchStep:
    """One optimizer step of the DTensor model, as our engine does it: loss, backward, clip, AdamW."""

    def __init__(self, model: Llama, cfg: Config):
        from threefold.train.engine import build_adamw

        self.model, self.cfg = model, cfg
        self.optimizer = build_adamw(model.named_parameters(), cfg)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
            loss.backward()
        self.clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.full_tensor().item()

    def clip_grad_norm(self) -> None:
        """torch's clipping by the global norm; without SP the norm gains stay plain tensors,
        which clip_grad_norm_ refuses to mix with DTensors, so the two groups' norms are combined."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        groups = [group for group in ([p for p in params if isinstance(p, DTensor)],
                                      [p for p in params if not isinstance(p, DTensor)]) if group]
        norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
        total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, self.cfg.train.grad_clip, total)


def run_mode(cfg: Config, device_mesh, warmup: int, steps: int) -> dict:
    from threefold.train.engine import build_engine

    plain = fresh_model(cfg)
    theirs = TorchStep(torch_tensor_parallel(copy.deepcopy(plain), device_mesh, cfg.parallel.sequence_parallel), cfg)
    engines = {"ours": build_engine(copy.deepcopy(plain), cfg)}
    if cfg.parallel.sequence_parallel:
        overlapped = copy.deepcopy(cfg)
        overlapped.parallel.tp_overlap = True
        engines["ours_overlap"] = build_engine(plain, overlapped.validate())
    blocked = {name: [] for name in engines}  # per step: seconds this rank waited on tp traffic

    def step(name: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        ledger = engines[name].comm.ledger
        ledger.take()
        # one micro-batch a step (micro_batch = global_batch): the whole batch goes to forward_backward at once
        loss = train_step(engines[name], [(inputs, targets)], cfg)
        blocked[name].append(sum(r.waited for r in ledger.records if r.axis == "tp"))
        return loss

    sides = {name: (lambda inputs, targets, name=name: step(name, inputs, targets)) for name in engines}
    out = alternate_steps(cfg, {**sides, "torch": theirs}, warmup, steps)
    for engine in engines.values():
        engine.shutdown()
    out = summarise_pair(out)
    for name in engines:
        out[name]["tp_blocked_s"] = statistics.median(blocked[name][warmup:])
    if "ours_overlap" in out:
        run = out["ours_overlap"]
        run["step_time_s"] = statistics.median(run["times"])
        out["overlap_ratio"] = run["step_time_s"] / out["ours"]["step_time_s"]
        out["overlap_max_loss_difference"] = max(abs(a - b) for a, b in zip(run["losses"], out["ours"]["losses"]))
    return out


def worker(rank: int, world: int, port: int, micro_batch: int, warmup: int, steps: int, modes: list[bool],
           queue) -> None:
    """One tensor-parallel rank (spawn_ranks starts it): every mode; rank 0 sends the results."""
    join_gloo(rank, world, port, threads=1, timeout_s=300)
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,))
    results = {("sp" if sp else "no_sp"): run_mode(bench_config(micro_batch, sp), device_mesh, warmup, steps)
               for sp in modes}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def results_table(results: dict) -> Table:
    table = Table(title=f"tp={TP}, small preset (untied), {results['tokens_per_step']} tokens per step, "
                        "1 thread per rank")
    for column in ("mode", "ours (s)", "PyTorch DTensor (s)", "ours / PyTorch", "max |Δloss|", "final loss",
                   "ours, tp_overlap (s)", "overlap / ours", "tp waits: ours / overlap (s)"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, run in results["modes"].items():
        overlap = ((f"{run['ours_overlap']['step_time_s']:.3f}", f"{run['overlap_ratio']:.3f}",
                    f"{run['ours']['tp_blocked_s']:.3f} / {run['ours_overlap']['tp_blocked_s']:.3f}")
                   if "ours_overlap" in run else ("–", "–", f"{run['ours']['tp_blocked_s']:.3f}"))
        table.add_row(mode, f"{run['ours']['step_time_s']:.3f}", f"{run['torch']['step_time_s']:.3f}",
                      f"{run['ratio']:.3f}", f"{run['max_loss_difference']:.1e}", f"{run['ours']['losses'][-1]:.4f}",
                      *overlap)
    return table


@click.command()
@click.option("--micro-batch", default=4, show_default=True, help="Sequences per step (one micro-batch).")
@click.option("--warmup", default=2, show_default=True, help="Untimed steps of each first.")
@click.option("--steps", default=8, show_default=True, help="Timed steps of each.")
@click.option("--mode", "modes", type=click.Choice(["sp", "no_sp"]), multiple=True,
              help="With or without sequence parallelism (repeatable; default: both).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(micro_batch, warmup, steps, modes, out) -> None:
    """Step time and losses of our tensor parallelism vs PyTorch's DTensor TP at tp=2."""
    console = Console()
    sp_modes = [mode == "sp" for mode in (modes or ("sp", "no_sp"))]
    with console.status(f"tp={TP}: {warmup} + {steps} alternating steps per mode"):
        runs = spawn_ranks(TP, worker, micro_batch, warmup, steps, sp_modes)
    cfg = bench_config(micro_batch, True)
    results = {"tp": TP, "preset": "small", "vocab_size": cfg.model.vocab_size, "seq_len": cfg.model.seq_len,
               "micro_batch": micro_batch, "tokens_per_step": micro_batch * cfg.model.seq_len, "threads_per_rank": 1,
               "warmup_steps": warmup, "timed_steps": steps, "torch_version": torch.__version__, "modes": runs}
    save_and_print(results, out, results_table(results), console)


if __name__ == "__main__":
    main()
