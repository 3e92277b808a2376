"""Our ZeRO-3 under a zero-bubble pipeline against PyTorch's FSDP2 under its zero-bubble schedule,
dp=2 × pp=2, in one run.

Four gloo processes (one thread each) build the same model from the same seed three times: twice
as our engine with ZeRO-3 and ZB-H1, once resharding (each unit gathered for the forward and again
for B, W run on freed units; two gathers and a reduce-scatter a micro-batch) and once kept
gathered (``parallel.reshard_after_forward = false``: gathered at the unit's first forward of the
step, reduced once after its last backward), and once as PyTorch's ``PipelineStage``s under
``ScheduleInterleavedZeroBubble`` (two chunks a rank, its only zero-bubble schedule on a ring of
ranks), each block and each stage ``fully_shard``-ed over the dp pair. A step on every side: the
schedule, the global gradient norm and clipping, AdamW; the sides alternate step by step.
Reported: the losses, median step times, ours / PyTorch's for each of ours, and the dp bytes a
step of ours (the engine's ledger, the busiest rank).

PyTorch's side keeps each block gathered from its forward to its weight gradients
(``reshard_after_forward=False``, torchtitan's default under pipeline parallelism): ZeRO-3's
states, but ZeRO-2's gathered weights during the step; our kept-gathered side is the like-for-like
peer. Before the timed steps, one step's gradients of every side are compared with a single
process's (PyTorch's stage by stage). ``--reshard`` asks PyTorch's side to reshard after the
forward; in torch 2.13 its gradients then come out wrong, and the losses part from ours, which the
table shows.

    .venv/bin/python bench/zero3_pp_vs_torch.py          # writes bench/results/zero3_pp.json
"""
from __future__ import annotations

import copy
from pathlib import Path

import click
import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from threefold.config import Config
from threefold.models.llama import Llama, cross_entropy
from threefold.parallel.pipeline.partition import partition
from threefold.parallel.placements import full_tensors
from threefold.train.engine import build_adamw, build_engine

from common import alternate_steps, fresh_model, join_gloo, save_and_print, spawn_ranks, summarise_pair, train_step
from pp_vs_torch import TorchStage

RESULTS = Path(__file__).parent / "results" / "zero3_pp.json"
PP, DP = 2, 2
TORCH_CHUNKS = 2  # ScheduleInterleavedZeroBubble's chunks a rank


def bench_config(layers: int, hidden: int, micro_batch: int, microbatches: int,
                 reshard_after_forward: bool = True) -> Config:
    cfg = Config()
    cfg.model.layers, cfg.model.hidden, cfg.model.heads = layers, hidden, 8
    cfg.model.vocab_size, cfg.model.seq_len, cfg.model.tie_embeddings = 4096, 128, False
    cfg.train.micro_batch, cfg.train.global_batch = micro_batch, micro_batch * microbatches * DP
    cfg.train.grad_clip, cfg.train.lr = 1.0, 1e-3
    cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.zero, cfg.parallel.schedule = PP, DP, 3, "zb-h1"
    cfg.parallel.reshard_after_forward = reshard_after_forward
    return cfg.validate()


def reference_gradients(plain: Llama, inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """One process's gradients of the whole batch's mean loss, keyed like the plain model."""
    reference = copy.deepcopy(plain)
    cross_entropy(reference(inputs), targets).backward()
    return {key: q.grad for key, q in reference.named_parameters()}


def relative_error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """||got − want|| / ||want||; 1.0 where a gradient is missing."""
    return 1.0 if got is None else ((got - want).norm() / want.norm()).item()


def my_rows(tokens: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """This replica's share of the global batch, as the trainer splits it."""
    rows = tokens.shape[0] // DP
    return tokens[dp_rank * rows:(dp_rank + 1) * rows]


class TorchZeRO3Pipeline:
    """PyTorch's stages, each block and stage fully_shard-ed over dp, its zero-bubble schedule, and
    an optimizer step like our engine's."""

    def __init__(self, plain: Llama, cfg: Config, reshard: bool):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))  # rank = pp·DP + dp, as ours
        self.pp_rank, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        stages = PP * TORCH_CHUNKS
        spans = partition(cfg.model, PP, TORCH_CHUNKS)
        mine = list(range(self.pp_rank, stages, PP))
        self.modules = [TorchStage(copy.deepcopy(plain), spans[s].blocks, spans[s].first, spans[s].last) for s in mine]
        for module in self.modules:
            for block in module.layers:
                fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
            fully_shard(module, mesh=mesh["dp"])
        self.schedule = pipelining.ScheduleInterleavedZeroBubble(
            [pipelining.PipelineStage(m, s, stages, torch.device("cpu"), group=mesh["pp"].get_group())
             for m, s in zip(self.modules, mine)], cfg.microbatches, loss_fn=cross_entropy)
        self.params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = build_adamw([(str(i), p) for i, p in enumerate(self.params)], cfg)
        self.cfg, self.holds_loss = cfg, any(spans[s].last for s in mine)
        self.mine, self.spans = mine, spans

    def run_schedule(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """The schedule over this replica's share of the global batch; the last stage's losses."""
        inputs, targets = my_rows(inputs, self.dp_rank), my_rows(targets, self.dp_rank)
        losses = []
        if self.pp_rank == 0:
            self.schedule.step(inputs, target=targets, losses=losses)
        else:
            self.schedule.step(target=targets, losses=losses)
        return losses

    def gradient_errors(self, want: dict, inputs: torch.Tensor, targets: torch.Tensor) -> dict[int, float]:
        """Stage → the largest relative error of its weights' gradients after one schedule, against
        one process's (``want``) on the whole batch; gradients zeroed after."""
        self.run_schedule(inputs, targets)
        errors = {}
        for stage, module in zip(self.mine, self.modules):
            worst = 0.0
            for name, q in module.named_parameters():
                key = name
                if name.startswith("layers."):  # the stage's i-th block is the plain model's span.blocks[i]
                    index, rest = name.split(".", 2)[1:]
                    key = f"blocks.{self.spans[stage].blocks[int(index)]}.{rest}"
                worst = max(worst, relative_error(None if q.grad is None else q.grad.full_tensor(), want[key]))
            errors[stage] = worst
        self.optimizer.zero_grad(set_to_none=True)
        return errors

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        losses = self.run_schedule(inputs, targets)
        # every rank's shards of every stage's gradients are disjoint: their squares sum to the norm's
        grads = [p.grad for p in self.params if p.grad is not None]  # --reshard: some are never made
        self.missing = len(self.params) - len(grads)
        squares = torch.stack([g.to_local().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(squares)
        coef = torch.clamp(self.cfg.train.grad_clip / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().reshape(1) if self.holds_loss else torch.zeros(1)
        dist.all_reduce(loss)  # the dp pair's last stages hold their replica's mean
        return loss.item() / DP


def our_pipeline(plain: Llama, cfg: Config, want: dict, tokens: torch.Tensor):
    """Our engine on a copy of ``plain``, its largest relative gradient error against one process's
    (``want``) after one step on ``tokens``, and its step, which records the step's dp bytes."""
    engine = build_engine(copy.deepcopy(plain), cfg)

    def micro_batches(inputs, targets):
        inputs, targets = my_rows(inputs, engine.dp_rank), my_rows(targets, engine.dp_rank)
        return list(zip(inputs.split(cfg.train.micro_batch), targets.split(cfg.train.micro_batch)))

    engine.forward_backward(micro_batches(tokens[:, :-1], tokens[:, 1:]))
    got = full_tensors(engine.grad_shards(), {f"grad/{k}": s for k, s in engine.shapes.items()}, engine.mesh,
                       engine.comm)  # a collective: every rank gets every gradient
    error = max(relative_error(got[f"grad/{k}"], w) for k, w in want.items())
    engine.zero_grad()
    engine.comm_bytes()  # the check's bytes are not a step's

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = train_step(engine, micro_batches(inputs, targets), cfg)
        step.dp_bytes = sum(n for key, n in engine.comm_bytes().items() if key.split(".")[0] == "dp")
        return loss

    return engine, step, error


def worker(rank: int, world: int, port: int, options: dict, queue) -> None:
    """One rank of dp × pp (spawn_ranks starts it); rank 0 sends the results."""
    join_gloo(rank, world, port, threads=1, timeout_s=600)
    warmup, steps, reshard = options.pop("warmup"), options.pop("steps"), options.pop("reshard")
    cfg = bench_config(**options)
    plain = fresh_model(cfg)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(cfg.train.seed + 1))
    want = reference_gradients(plain, tokens[:, :-1], tokens[:, 1:])
    theirs = TorchZeRO3Pipeline(plain, cfg, reshard)
    errors = [None] * world
    dist.all_gather_object(errors, theirs.gradient_errors(want, tokens[:, :-1], tokens[:, 1:]))
    engine, ours, ours_error = our_pipeline(plain, cfg, want, tokens)
    kept_engine, kept, kept_error = our_pipeline(plain, bench_config(**options, reshard_after_forward=False),
                                                 want, tokens)
    # torch in the middle: each of ours runs first on half the steps, last on the others
    timed = alternate_steps(cfg, {"ours": ours, "torch": theirs, "ours_kept": kept}, warmup, steps)
    engine.shutdown()
    kept_engine.shutdown()
    missing = torch.tensor([theirs.missing])  # parameters left without a gradient, all ranks
    dist.all_reduce(missing)
    dp_bytes = torch.tensor([ours.dp_bytes, kept.dp_bytes], dtype=torch.float64)  # the last step's
    dist.all_reduce(dp_bytes, op=dist.ReduceOp.MAX)
    if rank == 0:
        worst = {stage: max(e[stage] for e in errors if stage in e) for stage in sorted({s for e in errors for s in e})}
        run = summarise_pair(timed)  # ours (resharding) against torch
        kept_pair = summarise_pair({"ours": run.pop("ours_kept"), "torch": run["torch"]})
        run.update(ours_kept=kept_pair["ours"], kept_ratio=kept_pair["ratio"],
                   kept_max_loss_difference=kept_pair["max_loss_difference"])
        run["ours"]["gradient_error"], run["ours_kept"]["gradient_error"] = ours_error, kept_error
        run["ours"]["dp_bytes_per_step"], run["ours_kept"]["dp_bytes_per_step"] = map(int, dp_bytes.tolist())
        queue.put(dict(run, torch_parameters_without_gradient=int(missing), torch_gradient_error_by_stage=worst))
    dist.destroy_process_group()


def results_table(results: dict) -> Table:
    run = results["run"]
    reshard = "yes" if results["torch_reshard_after_forward"] else "no"
    table = Table(caption="gradient error: the largest relative error against one process (PyTorch's by stage, "
                          "stage 0 first); no gradient: PyTorch's weight shards left without one after a step, over "
                          "all ranks; dp MB: ours a step, the busiest rank (PyTorch's not measured)",
                  title=f"dp={DP} × pp={PP}, {results['layers']} layers, hidden {results['hidden']}, "
                        f"{results['microbatches']} micro-batches of {results['micro_batch']} × 128 tokens a replica, "
                        f"1 thread per rank; ours zb-h1, PyTorch ZeroBubble v=2 with FSDP2 (reshard after forward: "
                        f"{reshard})")
    for column in ("ours, ZeRO-3", "ours (s)", "PyTorch (s)", "ratio", "max |Δloss|", "ours dp MB",
                   "ours gradient error", "PyTorch gradient error", "no gradient"):
        table.add_column(column, justify="left" if column == "ours, ZeRO-3" else "right",
                         no_wrap=column == "PyTorch gradient error")
    torch_errors = " ".join(f"{e:.1e}" for e in run["torch_gradient_error_by_stage"].values())
    for name, side, ratio, loss in (("resharding", "ours", "ratio", "max_loss_difference"),
                                    ("kept gathered", "ours_kept", "kept_ratio", "kept_max_loss_difference")):
        table.add_row(name, f"{run[side]['step_time_s']:.3f}", f"{run['torch']['step_time_s']:.3f}",
                      f"{run[ratio]:.3f}", f"{run[loss]:.1e}", f"{run[side]['dp_bytes_per_step'] / 1e6:.1f}",
                      f"{run[side]['gradient_error']:.1e}", torch_errors, str(run["torch_parameters_without_gradient"]))
    return table


@click.command()
@click.option("--layers", default=8, show_default=True, help="Blocks (a multiple of 4: PyTorch's 4 chunks).")
@click.option("--hidden", default=256, show_default=True)
@click.option("--micro-batch", default=2, show_default=True, help="Sequences per micro-batch.")
@click.option("--microbatches", default=4, show_default=True, help="Micro-batches per step and replica.")
@click.option("--warmup", default=2, show_default=True, help="Untimed steps of each first.")
@click.option("--steps", default=6, show_default=True, help="Timed steps of each.")
@click.option("--reshard/--no-reshard", default=False, show_default=True,
              help="PyTorch's blocks reshard after the forward, as our resharding side does (its gradients are then wrong).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True)
def main(layers, hidden, micro_batch, microbatches, warmup, steps, reshard, out) -> None:
    """Step time and losses of our ZeRO-3 under ZB-H1 (resharding, and kept gathered) vs FSDP2 under
    PyTorch's zero-bubble schedule."""
    if layers % (PP * TORCH_CHUNKS):
        raise click.BadParameter(f"{layers} blocks do not split into PyTorch's {PP * TORCH_CHUNKS} chunks",
                                 param_hint="--layers")
    console = Console(width=140)
    options = dict(layers=layers, hidden=hidden, micro_batch=micro_batch, microbatches=microbatches, warmup=warmup,
                   steps=steps, reshard=reshard)
    with console.status(f"dp={DP} × pp={PP}: {warmup} + {steps} alternating steps"):
        run = spawn_ranks(PP * DP, worker, dict(options))
    results = {"pp": PP, "dp": DP, "layers": layers, "hidden": hidden, "vocab_size": 4096, "seq_len": 128,
               "micro_batch": micro_batch, "microbatches": microbatches, "threads_per_rank": 1,
               "warmup_steps": warmup, "timed_steps": steps, "torch_reshard_after_forward": reshard,
               "torch_version": torch.__version__, "run": run}
    save_and_print(results, out, results_table(results), console)


if __name__ == "__main__":
    main()
