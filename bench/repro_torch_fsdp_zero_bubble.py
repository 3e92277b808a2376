"""FSDP2 ``reshard_after_forward=True`` under ``ScheduleInterleavedZeroBubble`` gives wrong gradients.

Self-contained (torch only). Run on torch 2.13.0+cpu; the version in use is printed at startup.

Setup: 4 CPU processes (gloo, file rendezvous, 1 thread each), a 2-D DeviceMesh ("pp", "dp") = (2, 2).
A tiny model (embedding, 4 residual ``x + tanh(Linear(x))`` blocks, linear head) is cut into 4
pipeline chunks with one block each, placed as ScheduleInterleavedZeroBubble expects (pp rank r holds
chunks r and r + 2). Every block is ``fully_shard``-ed over the dp sub-mesh with
``reshard_after_forward`` set by the flag, then every chunk module is ``fully_shard``-ed too. Each
dp replica runs one ``schedule.step`` on its half of the global batch in 4 micro-batches
(``loss_fn`` = mean cross-entropy per micro-batch, the schedule's default ``scale_grads=True``
divides by the micro-batch count, FSDP averages over dp). The reference is the same model (same
seed) on one process, with the mean loss over the whole global batch. After one step, every
parameter's gradient (``.full_tensor()`` of FSDP's DTensor grad) is compared with the reference.

    python bench/repro_torch_fsdp_zero_bubble.py               # both settings
    python bench/repro_torch_fsdp_zero_bubble.py --reshard     # reshard_after_forward=True only
    python bench/repro_torch_fsdp_zero_bubble.py --no-reshard  # reshard_after_forward=False only

Output: one row per setting with each chunk's largest relative gradient error
(||g - g_ref|| / ||g_ref||, over the parameters that have a gradient), the number of parameters
left with ``.grad is None`` per chunk (summed over both dp ranks), and a verdict. The exit code is
always 0. On torch 2.13.0+cpu it prints:

    reshard_after_forward   max rel. grad error, chunk 0..3         .grad None, chunk 0..3   verdict
    True                    2e-07  7e-01  8e-01  3e-07              0/6  0/4  0/4  4/6       WRONG gradients
    False                   2e-07  2e-07  2e-07  3e-07              0/6  0/4  0/4  0/6       OK: matches one process

What we found by instrumenting it (not part of this script): the wrong chunks' gradients equal the
reference summed over only some micro-batches. Chunk 1 has micro-batches 2 and 3, chunk 2 has 1
and 3, and chunk 3's block has none. A micro-batch is lost when its I (input-backward) action is
the chunk's first backward after one or more of its forwards. At that point FSDP has resharded the block, so
``stage_backward_input(..., self.submod.parameters())`` sees the sharded DTensor parameters, which
are not in the autograd graph (that holds the unsharded ones). The block's parameter group comes
out empty, and the later W action computes no weight gradient for it. FSDP swaps the unsharded
parameters back in only in its pre-backward hook, which runs during that I. Chunk 0 is unaffected
because its W runs a full backward. The parameters that belong to the chunk modules themselves
(embedding, head) are unaffected too. Those modules are FSDP roots left at the default
``reshard_after_forward``, so they do not reshard after forward.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

PP, DP = 2, 2  # rank = pp_rank * DP + dp_rank, as init_device_mesh lays out (PP, DP)
CHUNKS = 2 * PP  # ScheduleInterleavedZeroBubble: two chunks per pp rank
BLOCKS_PER_CHUNK = 1
VOCAB, HIDDEN, SEQ = 64, 32, 8
MICRO_BATCHES, MICRO_BATCH = 4, 2  # per dp replica
GLOBAL_BATCH = DP * MICRO_BATCHES * MICRO_BATCH


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(CHUNKS * BLOCKS_PER_CHUNK))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Chunk(nn.Module):
    """Pipeline stage `index`: its blocks, plus the embedding (first stage) or the head (last)."""

    def __init__(self, model: Model, index: int):
        super().__init__()
        self.embed = model.embed if index == 0 else None
        self.layers = nn.ModuleList(model.blocks[index * BLOCKS_PER_CHUNK:(index + 1) * BLOCKS_PER_CHUNK])
        self.head = model.head if index == CHUNKS - 1 else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model() -> Model:
    torch.manual_seed(0)  # every process, and the reference, start from the same weights
    return Model()


def make_batch():
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def reference_name(index: int, name: str) -> str:
    """A chunk's parameter name -> the full model's name for it."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{index * BLOCKS_PER_CHUNK + int(i)}.{rest}"
    return name


def worker(rank: int, world: int, init_file: str, reshard: bool, queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    inputs, targets = make_batch()

    # Reference: one process, whole global batch. Mean over it = mean over micro-batches and replicas.
    reference = make_model()
    loss_fn(reference(inputs), targets).backward()
    want = {name: p.grad for name, p in reference.named_parameters()}

    model = make_model()
    mine = [pp_rank, pp_rank + PP]  # looped placement
    chunks = [Chunk(model, i) for i in mine]
    for chunk in chunks:
        for block in chunk.layers:
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(chunk, mesh=mesh["dp"])  # PipelineStage drives FSDP through the stage's root module
    stages = [PipelineStage(chunk, i, CHUNKS, torch.device("cpu"), group=mesh["pp"].get_group())
              for chunk, i in zip(chunks, mine)]
    schedule = ScheduleInterleavedZeroBubble(stages, MICRO_BATCHES, loss_fn=loss_fn)

    rows = slice(dp_rank * GLOBAL_BATCH // DP, (dp_rank + 1) * GLOBAL_BATCH // DP)  # this replica's half
    if pp_rank == 0:
        schedule.step(inputs[rows], target=targets[rows])
    else:
        schedule.step(target=targets[rows])

    result = {}  # chunk -> (max relative error, params with .grad None, params)
    for index, chunk in zip(mine, chunks):
        worst, missing, total = 0.0, 0, 0
        for name, p in chunk.named_parameters():  # same order on both dp ranks, so full_tensor() pairs up
            total += 1
            if p.grad is None:  # both dp ranks of a chunk agree on which grads exist
                missing += 1
                continue
            ref = want[reference_name(index, name)]
            worst = max(worst, ((p.grad.full_tensor() - ref).norm() / ref.norm()).item())
        result[index] = (worst, missing, total)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        queue.put(gathered)
    dist.destroy_process_group()


def run(reshard: bool) -> dict | None:
    """Spawn the 4 ranks; chunk -> (max error over dp ranks, .grad None summed over dp ranks, params).
    None if a rank failed (its traceback is printed above)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        world = PP * DP
        procs = [ctx.Process(target=worker, args=(r, world, init_file, reshard, queue)) for r in range(world)]
        for p in procs:
            p.start()
        gathered = None
        while gathered is None and all(p.exitcode in (None, 0) for p in procs):  # don't hang if a rank dies
            try:
                gathered = queue.get(timeout=1.0)
            except Empty:
                pass
        for p in procs:
            p.join(timeout=10) if gathered is None else p.join()
            if p.is_alive():
                p.terminate()
    if gathered is None:
        return None
    table = {}
    for result in gathered:
        for index, (worst, missing, total) in result.items():
            w, m, t = table.get(index, (0.0, 0, 0))
            table[index] = (max(w, worst), m + missing, t + total)
    return dict(sorted(table.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--reshard", dest="settings", action="store_const", const=[True],
                        help="only reshard_after_forward=True")
    choice.add_argument("--no-reshard", dest="settings", action="store_const", const=[False],
                        help="only reshard_after_forward=False")
    settings = parser.parse_args().settings or [True, False]

    print(f"torch {torch.__version__}: FSDP2 + ScheduleInterleavedZeroBubble, dp={DP} x pp={PP} "
          f"(4 gloo CPU processes), {CHUNKS} chunks, {MICRO_BATCHES} micro-batches per dp replica")
    print(f"{'reshard_after_forward':<23} {'max rel. grad error, chunk 0..3':<39} "
          f"{'.grad None, chunk 0..3':<24} verdict")
    for reshard in settings:
        start = time.perf_counter()
        table = run(reshard)
        if table is None:
            print(f"{str(reshard):<23} a rank failed (traceback above)")
            continue
        errors = "  ".join(f"{w:.0e}" for w, _, _ in table.values())
        missing = "  ".join(f"{m}/{t}" for _, m, t in table.values())
        ok = all(w < 1e-4 and m == 0 for w, m, _ in table.values())
        verdict = "OK: matches one process" if ok else "WRONG gradients"
        print(f"{str(reshard):<23} {errors:<39} {missing:<24} {verdict}  ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
