"""threefold's checkpoints against PyTorch's own ways to save the same states, same model and machine, one run.

    one process      threefold checkpoint.save / load     vs  dcp.save / dcp.load of get_state_dict(model, optim),
                                                               and torch.save / torch.load of the same dicts
                     threefold Checkpointer (asynchronous) vs  dcp.async_save
    ZeRO-3 (dp=2)    threefold zero 3, save / load         vs  FSDP2 fully_shard per block (+ root), DCP of
                                                               get_state_dict, loaded with set_state_dict
                     threefold Checkpointer (asynchronous) vs  dcp.async_save over a gloo group of its own
    resharding       the dp=2 ZeRO-3 checkpoint loaded by one process (and, as PyTorch's counterpart,
                     FSDP2's DCP checkpoint loaded into the plain model and AdamW)

The model (the ``small`` preset, 4096-token vocabulary: 12.2M parameters, so weights and Adam's
two moments are ≈ 146 MB in fp32) first trains two steps on random tokens, so that AdamW's states
exist. Every contender saves those same states: on one process threefold's Engine holds a plain
Llama and a torch AdamW, and PyTorch's contenders save exactly that model and optimizer. Each
repeat writes into a fresh temporary folder, which is deleted afterwards; the contenders
alternate (the order flips every repeat) so that machine noise hits all alike, and the reported
times are medians over repeats. On dp=2 a time is the slowest rank's.

What is timed:
  save   from the call to the folder being complete on disk: threefold's ``save`` (DCP planning,
         writing, fsync, trainer.json, rename); PyTorch: ``get_state_dict`` + ``dcp.save`` (fsyncs
         its files too); ``torch.save`` is followed by an fsync so that it is comparable.
  load   into a freshly built model/engine (built and initialised untimed, as the trainer does
         before resuming): threefold's ``load``; PyTorch: ``get_state_dict`` (which creates the
         optimizer's states by an AdamW step with zero gradients), ``dcp.load``, ``set_state_dict``.
         The files were just written, so they are read from the page cache: this is the cost of
         deserialising and placing, not of the disk.
  async  blocked: until ``Checkpointer.save`` (``dcp.async_save``) returns, the time a training
         loop would stand still; total: until ``wait()`` (the future's result) returns. Nothing
         else runs meanwhile.
  floor  one process writes the same bytes as one contiguous buffer (write + fsync) and reads them
         back into a preallocated one: what the disk and page cache cost, without any format.

Every load is checked: each loaded tensor equals the saved one bit for bit, and the resharded
load's weights equal the weights the ZeRO-3 run gathered (``engine.model_state_dict()``); the
script stops if not. Reported: median seconds, bytes on disk, and ratios threefold / PyTorch
(median over repeats of the two times measured back to back; target ≤ 1.0).

    .venv/bin/python bench/checkpoint_vs_torch.py             # writes bench/results/checkpoint.json
    .venv/bin/python bench/checkpoint_vs_torch.py --quick     # tiny preset, 2 repeats: under a minute
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import click
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rich.console import Console
from rich.table import Table
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from threefold.config import Config
from threefold.models.llama import Llama, cross_entropy
from threefold.train import checkpoint
from threefold.train.engine import Engine, build_adamw
from threefold.parallel.placements import MOMENTS
from threefold.train.trainer import split_micro_batches

from common import fresh_model, join_gloo, preset_config, spawn_ranks, step_at_lr, train_step

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"
TRAIN_STEPS = 2
TRAIN_TOKENS = 64  # tokens per training sequence: the steps only need to create Adam's states
DP = 2


def bench_config(preset: str, dp: int) -> Config:
    cfg = preset_config(preset)
    cfg.parallel.dp = dp
    cfg.parallel.zero = 3 if dp > 1 else 0
    cfg.parallel.timeout_s = 300
    cfg.train.global_batch = 2
    cfg.train.micro_batch = 1
    cfg.train.lr = 1e-3
    return cfg.validate()


def train(engine, cfg: Config, rank: int = 0, world: int = 1) -> None:
    """TRAIN_STEPS steps of the same random batches whatever the layout (rank r: its rows)."""
    gen = torch.Generator().manual_seed(cfg.train.seed)
    for _ in range(TRAIN_STEPS):
        tokens = torch.randint(cfg.model.vocab_size, (cfg.train.global_batch, TRAIN_TOKENS + 1), generator=gen)
        rows = tokens[rank * len(tokens) // world:(rank + 1) * len(tokens) // world]
        train_step(engine, split_micro_batches(rows[:, :-1], rows[:, 1:], cfg.train.micro_batch), cfg)


class FSDP2:
    """PyTorch's ZeRO-3: fully_shard per block and the root, torch AdamW, driven like an Engine."""

    def __init__(self, cfg: Config, mesh):
        from torch.distributed.fsdp import fully_shard

        self.model = fresh_model(cfg)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = build_adamw(self.model.named_parameters(), cfg)

    def forward_backward(self, micro_batches) -> None:
        for inputs, targets in micro_batches:
            (cross_entropy(self.model(inputs), targets) / len(micro_batches)).backward()

    def clip_grad_norm(self, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def optimizer_step(self, lr: float) -> None:
        step_at_lr(self.optimizer, lr)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


# --- what is compared ------------------------------------------------------------------------------
def disk_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def torch_states(model, optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and AdamW moment of a torch model/optimizer pair (this rank's part)."""
    found = []
    for key, p in model.named_parameters():
        found.append((f"model/{key}", local(p.data)))
        found += [(f"{m}/{key}", local(optimizer.state[p][m])) for m in MOMENTS]
    return found


def assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]], what: str) -> None:
    """Bit-for-bit equal, name by name; the benchmark stops otherwise."""
    assert [n for n, _ in got] == [n for n, _ in want], f"{what}: different tensors"
    for (name, a), (_, b) in zip(got, want):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: {name} differs after loading (max |Δ| {(a - b).abs().max().item():.3e})")


def threefold_states(engine) -> list[tuple[str, torch.Tensor]]:
    return [(f"{s.name}@{s.offsets}", s.tensor) for s in engine.checkpoint_shards()]


def sync_seconds(seconds: float) -> float:
    """The slowest rank's time (every rank calls this), or the time itself on one process."""
    if not dist.is_initialized():
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn) -> float:
    barrier()
    began = time.perf_counter()
    fn()
    return sync_seconds(time.perf_counter() - began)


def clear(path: Path) -> None:
    """Rank 0 deletes a contender's folder; everyone waits."""
    barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True) if Path(path).is_dir() else Path(path).unlink(missing_ok=True)
    barrier()


# --- the contenders: each saves the same states (sync, async) and loads them into a fresh copy ----------
class ThreefoldSide:
    name = "threefold"

    def __init__(self, engine, cfg: Config, new_engine):
        self.engine, self.cfg, self.new_engine = engine, cfg, new_engine
        self.saver = checkpoint.Checkpointer(engine, asynchronous=True, timeout_s=cfg.parallel.timeout_s)

    def save(self, root: Path) -> Path:
        checkpoint.save(root, TRAIN_STEPS, self.engine, self.cfg, sampler_state={})
        return checkpoint.step_dir(root, TRAIN_STEPS)

    def async_save(self, root: Path) -> Path:
        self.saver.save(root, TRAIN_STEPS, self.cfg, sampler_state={})
        return checkpoint.step_dir(root, TRAIN_STEPS)

    def wait(self) -> None:
        self.saver.wait()

    def fresh(self):
        return self.new_engine()

    def load(self, path: Path, fresh) -> None:
        checkpoint.load(path, fresh, self.cfg)

    def check(self, fresh) -> None:
        assert_same(threefold_states(fresh), threefold_states(self.engine), "threefold load")
        assert fresh.adam_step() == self.engine.adam_step() == TRAIN_STEPS

    def discard(self, fresh) -> None:
        fresh.shutdown()

    def close(self) -> None:
        self.saver.close()


class TorchDCPSide:
    """dcp.save / load of get_state_dict(model, optimizer), the way PyTorch documents it."""
    name = "torch DCP"

    def __init__(self, model, optimizer, new_pair, async_group=None):
        self.model, self.optimizer, self.new_pair = model, optimizer, new_pair
        self.no_dist = not dist.is_initialized()
        self.async_group, self.pending = async_group, None
        self.phases: dict[str, list[float]] = {}  # where a load's time goes (this rank)

    def save(self, root: Path) -> Path:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root, no_dist=self.no_dist)
        return root

    def async_save(self, root: Path) -> Path:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        self.pending = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root,
                                      process_group=self.async_group, no_dist=self.no_dist)
        return root

    def wait(self) -> None:
        self.pending.result()
        self.pending = None

    def fresh(self):
        return self.new_pair()

    def load(self, path: Path, fresh) -> None:
        model, optimizer = fresh
        began = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)  # creates AdamW's states: a step with zero grads
        built = time.perf_counter()
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, no_dist=self.no_dist)
        read = time.perf_counter()
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        for phase, seconds in (("get_state_dict", built - began), ("dcp.load", read - built),
                               ("set_state_dict", time.perf_counter() - read)):
            self.phases.setdefault(phase, []).append(seconds)

    def check(self, fresh) -> None:
        assert_same(torch_states(*fresh), torch_states(self.model, self.optimizer), f"{self.name} load")

    def discard(self, fresh) -> None:
        pass

    def close(self) -> None:
        pass


class TorchSaveSide(TorchDCPSide):
    """torch.save of {"model": state_dict, "optim": state_dict} into one file, then fsync."""
    name = "torch.save"
    async_save = None  # no asynchronous form

    def save(self, root: Path) -> Path:
        path = Path(str(root) + ".pt")
        with open(path, "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return path

    def load(self, path: Path, fresh) -> None:
        model, optimizer = fresh
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])


class FloorSide:
    """The same bytes as one buffer: write + fsync, and read back into a preallocated buffer."""
    name = "floor: raw bytes"

    def __init__(self, nbytes: int):
        self.data = torch.rand(nbytes // 4)
        self.target = torch.zeros_like(self.data)

    def save(self, root: Path) -> Path:
        path = Path(str(root) + ".bin")
        with open(path, "wb") as f:
            f.write(memoryview(self.data.numpy()).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        return path

    def fresh(self):
        return None

    def load(self, path: Path, fresh) -> None:
        with open(path, "rb") as f:
            f.readinto(memoryview(self.target.numpy()).cast("B"))

    def check(self, fresh) -> None:
        assert torch.equal(self.target, self.data)
        self.target.zero_()

    def discard(self, fresh) -> None:
        pass

    def close(self) -> None:
        pass


def duel(sides: list, folder: Path, repeats: int, console: Console | None) -> dict:
    """Every side saves, loads (checked) and, if it can, saves asynchronously, ``repeats`` times,
    in an order that flips every repeat. Returns per side the lists of seconds and the bytes."""
    out = {s.name: {"save_s": [], "load_s": [], "async_blocked_s": [], "async_total_s": [], "bytes": 0}
           for s in sides}
    for r in range(repeats):
        order = sides if r % 2 == 0 else sides[::-1]
        paths = {}
        for side in order:
            root = folder / f"{side.name.replace(' ', '_').replace(':', '')}-{r}"
            holder = {}
            seconds = timed(lambda: holder.setdefault("path", side.save(root)))
            paths[side.name] = holder["path"]
            out[side.name]["save_s"].append(seconds)
            out[side.name]["bytes"] = disk_bytes(holder["path"])
        for side in order:
            fresh = side.fresh()
            out[side.name]["load_s"].append(timed(lambda: side.load(paths[side.name], fresh)))
            side.check(fresh)
            side.discard(fresh)
            clear(paths[side.name])
        for side in order:
            if getattr(side, "async_save", None) is None:
                continue
            root = folder / f"{side.name.replace(' ', '_')}-async-{r}"
            barrier()
            began = time.perf_counter()
            path = side.async_save(root)
            blocked = time.perf_counter() - began
            side.wait()
            total = time.perf_counter() - began
            out[side.name]["async_blocked_s"].append(sync_seconds(blocked))
            out[side.name]["async_total_s"].append(sync_seconds(total))
            clear(path)
        if console:
            console.print(f"  repeat {r + 1}/{repeats}: " + ", ".join(
                f"{name} {v['save_s'][-1]:.2f}/{v['load_s'][-1]:.2f}s" for name, v in out.items()))
    return out


def summarise(raw: dict, sides: list, reference: str = "threefold") -> dict:
    """Medians, and per side the ratio reference / side (median of the per-repeat ratios)."""
    summary = {}
    for side in sides:
        name, v = side.name, raw[side.name]
        row = {"bytes": v["bytes"], "times_s": {k: v[k] for k in ("save_s", "load_s", "async_blocked_s",
                                                                     "async_total_s") if v[k]}}
        for key, times in row["times_s"].items():
            row[key] = statistics.median(times)
        if getattr(side, "phases", None):
            row["load_phases_s"] = {phase: statistics.median(t) for phase, t in side.phases.items()}
        summary[name] = row
    ours = raw[reference]
    for name, row in summary.items():
        if name == reference:
            continue
        for key in ("save_s", "load_s", "async_blocked_s", "async_total_s"):
            if raw[name][key] and ours[key]:
                row[f"ratio_{key}"] = statistics.median(a / b for a, b in zip(ours[key], raw[name][key]))
    return summary


# --- 1. one process ------------------------------------------------------------------------------------
def one_process(cfg: Config, repeats: int, folder: Path, console: Console) -> tuple[dict, Engine]:
    engine = Engine(fresh_model(cfg), cfg)
    train(engine, cfg)
    state_bytes = sum(s.tensor.numel() * s.tensor.element_size() for s in engine.checkpoint_shards())

    def new_engine():
        return Engine(fresh_model(cfg), cfg)

    def new_pair():
        model = fresh_model(cfg)
        return model, build_adamw(model.named_parameters(), cfg)

    sides = [ThreefoldSide(engine, cfg, new_engine), TorchDCPSide(engine.model, engine.optimizer, new_pair),
             TorchSaveSide(engine.model, engine.optimizer, new_pair), FloorSide(state_bytes)]
    raw = duel(sides, folder, repeats, console)
    for side in sides:
        side.close()
    return {"layout": "one process", "threads": torch.get_num_threads(), "state_bytes": state_bytes,
            "contenders": summarise(raw, sides)}, engine


# --- 2. dp=2, ZeRO-3 against FSDP2 (every rank runs this) ----------------------------------------------
def zero3(cfg: Config, repeats: int, folder: Path, keep: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from threefold.train.engine import build_engine

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    engine = build_engine(fresh_model(cfg), cfg)
    peer = FSDP2(cfg, mesh)
    train(engine, cfg, rank, world)
    train(peer, cfg, rank, world)
    async_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.parallel.timeout_s))

    def new_pair():
        fresh = FSDP2(cfg, mesh)
        return fresh.model, fresh.optimizer

    sides = [ThreefoldSide(engine, cfg, lambda: build_engine(fresh_model(cfg), cfg)),
             TorchDCPSide(peer.model, peer.optimizer, new_pair, async_group)]
    sides[1].name = "torch FSDP2 + DCP"
    raw = duel(sides, folder, repeats, None)
    for side in sides:
        side.close()

    # what the resharding load starts from: both checkpoints, and both runs' gathered weights
    checkpoint.save(keep / "threefold", TRAIN_STEPS, engine, cfg, sampler_state={})
    sides[1].save(keep / "torch")
    gathered = engine.model_state_dict()
    torch_full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                  for k, v in get_state_dict(peer.model, peer.optimizer)[0].items()}
    if rank == 0:
        torch.save({"threefold": gathered, "torch": torch_full}, keep / "gathered.pt")
    barrier()
    engine.shutdown()
    dist.destroy_process_group(async_group)
    if rank:
        return {}
    return {"layout": f"ZeRO-3 dp={world}", "threads_per_rank": torch.get_num_threads(),
            "contenders": summarise(raw, sides)}


def worker(rank: int, world: int, port: int, preset: str, repeats: int, folder: str, keep: str, queue) -> None:
    """One ZeRO-3 rank (spawn_ranks starts it); rank 0 sends the results."""
    join_gloo(rank, world, port, threads=max(1, (os.cpu_count() or 1) // world), timeout_s=300)
    result = zero3(bench_config(preset, world), repeats, Path(folder), Path(keep))
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


# --- 3. the ZeRO-3 checkpoints loaded by one process -----------------------------------------------------
def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def reshard(cfg: Config, repeats: int, keep: Path, reference: Engine) -> dict:
    gathered = torch.load(keep / "gathered.pt", weights_only=True)
    path = checkpoint.step_dir(keep / "threefold", TRAIN_STEPS)
    ours, theirs = [], []
    side = TorchDCPSide(None, None, None)  # loads into the plain model and AdamW it is given
    for r in range(repeats):
        for name in (("threefold", "torch") if r % 2 == 0 else ("torch", "threefold")):
            if name == "threefold":
                engine = Engine(fresh_model(cfg), cfg)
                ours.append(timed(lambda: checkpoint.load(path, engine, cfg)))
                # the weights the ZeRO-3 ranks held, gathered, are what one process now holds
                held = engine.model_state_dict()
                for key, value in gathered["threefold"].items():
                    if not torch.equal(held[key], value):
                        raise AssertionError(f"resharded load: {key} differs from the ZeRO-3 run's gathered weight")
                assert engine.adam_step() == TRAIN_STEPS
                loaded = engine
            else:
                model = fresh_model(cfg)
                optimizer = build_adamw(model.named_parameters(), cfg)
                theirs.append(timed(lambda: side.load(keep / "torch", (model, optimizer))))
                held = model.state_dict()
                for key, value in gathered["torch"].items():
                    if not torch.equal(held[key], value):
                        raise AssertionError(f"FSDP2 checkpoint loaded by one process: {key} differs")
    # Adam's moments, resharded, against the one-process run of the same steps (summation order only)
    held = dict(threefold_states(loaded))
    moments = max(relative(tensor, held[name]) for name, tensor in threefold_states(reference))
    weights = max(relative(gathered["threefold"][k], v) for k, v in reference.model.state_dict().items())
    fsdp2 = max(relative(gathered["threefold"][k], v) for k, v in gathered["torch"].items())
    for what, value in (("moments vs one process", moments), ("weights vs one process", weights),
                        ("threefold vs FSDP2 weights", fsdp2)):
        if value > 1e-4:
            raise AssertionError(f"resharded load: {what} differ by {value:.1e} relative")
    return {"layout": f"ZeRO-3 dp={DP} → one process", "threads": torch.get_num_threads(),
            "load_s": {"threefold": statistics.median(ours), "torch FSDP2 + DCP": statistics.median(theirs)},
            "load_times_s": {"threefold": ours, "torch FSDP2 + DCP": theirs},
            "torch_load_phases_s": {phase: statistics.median(t) for phase, t in side.phases.items()},
            "ratio_load_s": statistics.median(a / b for a, b in zip(ours, theirs)),
            "bytes": {"threefold": disk_bytes(path), "torch FSDP2 + DCP": disk_bytes(keep / "torch")},
            "weights_equal_gathered": True,
            "max_rel_diff": {"state_vs_one_process_run": moments, "weights_vs_one_process_run": weights,
                             "threefold_vs_fsdp2_weights": fsdp2}}


# --- the table --------------------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def results_table(title: str, parts: list[dict], reshard_result: dict) -> Table:
    table = Table(title=title)
    for column in ("layout", "contender", "save s", "load s", "async blocked s", "async total s", "MB on disk",
                   "save ratio", "load ratio", "async ratio (blocked / total)"):
        table.add_column(column, justify="left" if column in ("layout", "contender") else "right")
    for part in parts:
        for name, row in part["contenders"].items():
            async_ratio = (f"{fmt(row.get('ratio_async_blocked_s'), 2)} / {fmt(row.get('ratio_async_total_s'), 2)}"
                           if "ratio_async_total_s" in row else "–")
            table.add_row(part["layout"], name, fmt(row.get("save_s")), fmt(row.get("load_s")),
                          fmt(row.get("async_blocked_s")), fmt(row.get("async_total_s")), f"{row['bytes'] / 1e6:.1f}",
                          fmt(row.get("ratio_save_s"), 2), fmt(row.get("ratio_load_s"), 2), async_ratio)
        table.add_section()
    for name, seconds in reshard_result["load_s"].items():
        table.add_row(reshard_result["layout"], name, "–", fmt(seconds), "–", "–",
                      f"{reshard_result['bytes'][name] / 1e6:.1f}", "–",
                      fmt(reshard_result["ratio_load_s"], 2) if name != "threefold" else "–", "–")
    return table


@click.command()
@click.option("--repeats", type=int, default=None, help="Saves and loads per contender (default 9; 2 with --quick).")
@click.option("--quick", is_flag=True, help="The tiny preset and 2 repeats: a check that everything runs (< 1 min).")
@click.option("--threads", default=1, show_default=True,
              help="Intra-op threads of the one-process parts (each of the dp=2 ranks gets cores / 2).")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Where to write the results (default {RESULTS}; --quick writes nothing unless given).")
def main(repeats: int | None, quick: bool, threads: int, output: Path | None) -> None:
    preset = "tiny" if quick else "small"
    repeats = repeats or (2 if quick else 9)
    output = output or (None if quick else RESULTS)
    console = Console(width=190)
    torch.set_num_threads(threads)
    cfg = bench_config(preset, 1)
    params = sum(p.numel() for p in Llama(cfg.model).parameters())
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="threefold-ckpt-bench-") as tmp, warnings.catch_warnings():
        # PyTorch's DCP warns on every call of one process: one process is what is meant there
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        tmp = Path(tmp)
        (tmp / "one").mkdir()
        (tmp / "dp").mkdir()
        (tmp / "keep").mkdir()
        console.print(f"one process ({preset}: {params / 1e6:.1f}M parameters), {repeats} repeats …")
        single, reference = one_process(cfg, repeats, tmp / "one", console)
        console.print(f"ZeRO-3 dp={DP} against FSDP2, {repeats} repeats …")
        sharded = spawn_ranks(DP, worker, preset, repeats, str(tmp / "dp"), str(tmp / "keep"))
        console.print(f"the dp={DP} checkpoints loaded by one process, {repeats} repeats …")
        resharded = reshard(cfg, repeats, tmp / "keep", reference)
    title = (f"threefold vs PyTorch checkpoints: {preset} preset ({params / 1e6:.1f}M params, weights + AdamW "
             f"{single['state_bytes'] / 1e6:.0f} MB fp32), {os.cpu_count()} cores, median of {repeats}; "
             f"ratio = threefold / that row (median of per-repeat ratios)")
    console.print(results_table(title, [single, sharded], resharded))
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({
        "machine_cores": os.cpu_count(), "torch": torch.__version__, "preset": preset, "params": params,
        "state_bytes": single["state_bytes"], "repeats": repeats, "train_steps": TRAIN_STEPS,
        "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
        "results": {"one_process": single, "zero3": sharded, "reshard": resharded}}, indent=1))
    console.print(f"wrote {output}")


if __name__ == "__main__":
    main()
