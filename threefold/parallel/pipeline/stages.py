"""Split the plain model into the stage modules of one pipeline rank.

``partition`` (partition.py) says which blocks each stage runs; stage ``s`` lives on pipeline
rank ``schedule.rank_of(s)``. A ``StageModule`` holds the plain model's own modules for its
stage (so its parameter names are the plain model's state-dict keys) and runs them with the
model's own block loop, ``Llama.run_blocks``: the embedding on the first stage (called by the
runtime, which needs the embedded input for a split backward), blocks ``span.blocks``, and the
final norm and head on the last. Nothing else of the model stays referenced, so a rank keeps
only its stages' tensors.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
from torch import nn

from threefold.distributed.mesh import AXES
from threefold.models.llama import Llama
from threefold.models.sizes import block_param_count
from threefold.parallel.pipeline.partition import StageSpan
from threefold.parallel.pipeline.schedule import LayerCosts


class StageModule(nn.Module):
    """The part of the plain model one stage runs (see the module docstring)."""

    def __init__(self, model: Llama, span: StageSpan):
        super().__init__()
        self.span = span
        self.first, self.last = span.first, span.last
        self.embed = model.embed if span.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in span.blocks})
        self.norm = model.norm if span.last else None
        self.head = model.head if span.last else None
        # the plain model's rotary tables, as buffers here too: model state, not activations
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor | range) -> torch.Tensor:
        """The next stage's input, or on the last stage the logits. ``positions``: the tokens'
        positions in the sequence, for the rotary tables (this rank's under context parallelism;
        the hidden state holds fewer of them under sequence parallelism)."""
        hidden = Llama.run_blocks(self, hidden, positions, self.blocks.values())
        if self.last:
            return self.head(self.norm(hidden))
        return hidden


def stage_modules(model: Llama, spans: list[StageSpan], stages) -> dict[int, StageModule]:
    """This rank's stages (index → module) of the plain ``model``, cut at ``spans``."""
    return {s: StageModule(model, spans[s]) for s in stages}


# --------------------------------------------------------------------------------------------
# Measured stage costs: what the split balances (schedule.balanced_split)

ADAM_STATE_BYTES = 16  # per fp32 parameter: the weight, its gradient, Adam's two moments


def run_stage_costs(model: Llama, cfg, mesh, comm, loss_fn, activation_shape: tuple[int, ...],
                    compute=contextlib.nullcontext) -> LayerCosts | None:
    """The costs the run's stage split balances, measured where the run computes: every rank times
    every part of the model as the earlier transformations left it (tensor parallelism's shards and
    collectives included), all ranks at once as in training; the median rank's time of each part
    (the median over each mesh axis in turn, gathered, so every rank takes the same and cuts the
    model the same way). Not the slowest rank's: one rank descheduled through a part's repeats moved
    the maximum. The demo's 8 ranks on 2 cores read the head at 0.86-1.14 blocks, but in three of
    six launches one rank read 1.5-2.0, and two launches of ten split the 5 blocks 4-1, not 3-2, on
    the maximum (a recording that trained 4-1 took 1.84 s a step, one at 3-2 1.74; 2026-12-05); on
    the median, six launches of six split 3-2. None where the split comes from elsewhere:
    ``parallel.stage_layers``, equal interleaved chunks, ``parallel.stage_costs = "flops"``, context
    parallelism (its attention needs the step's position split), a Mixture-of-Experts model (its
    blocks' cost follows the routing, and timing them would run their dispatch and count their
    routing outside a step), a model without values (the dry run's fake tensors), or ranks without a
    process group (a mesh of coordinates only): the FLOP model then."""
    from torch._guards import detect_fake_mode

    p = cfg.parallel
    if (p.stage_layers is not None or p.virtual_stages > 1 or p.stage_costs != "measured" or p.cp > 1
            or cfg.model.moe_experts or detect_fake_mode() is not None or mesh.device.type == "meta"
            or (mesh.world_size > 1 and not torch.distributed.is_initialized())):
        return None
    costs = measure_layer_costs(model, cfg, mesh.device, activation_shape, loss_fn, compute)
    values = torch.tensor([costs.embed, *costs.blocks, costs.head, *costs.block_activation_bytes],
                          dtype=torch.float64, device=mesh.device)
    for axis in (axis for axis in AXES if mesh.sizes[axis] > 1):  # the median over each axis in turn
        group = values.new_empty(mesh.size(axis) * values.numel())
        comm.all_gather(group, values, axis, tag="stage_costs")
        values = group.view(-1, values.numel()).quantile(0.5, dim=0)  # of two ranks, their mean
    comm.ledger.take()  # the measurement is no step's traffic
    got, layers = values.tolist(), cfg.model.layers
    return dataclasses.replace(costs, embed=got[0], blocks=tuple(got[1:layers + 1]), head=got[layers + 1],
                               block_activation_bytes=tuple(got[layers + 2:]))


def measure_layer_costs(model: Llama, cfg, device: torch.device, activation_shape: tuple[int, ...], loss_fn,
                        compute=contextlib.nullcontext, repeats: int = 3) -> LayerCosts:
    """Time one micro-batch's forward and backward (the fastest of ``repeats``, after a warm-up,
    the parts taken round-robin so a busy moment of the machine hits all alike) through the
    embedding, each block, and the final norm + head + loss of ``model``, on ``device`` under
    ``compute`` (autocast), the blocks on hidden states of ``activation_shape`` (a micro-batch as
    a stage receives it), and count the bytes each block saves for its backward. A part on the
    meta device gets random values for its measurement and goes back to meta after it: values do
    not change the time (a Mixture-of-Experts router's balance aside). Blocks that compute the
    same thing get the mean of their times: what differs between them is noise.

    On a CPU the parts are timed by the process's CPU clock, not the wall's: every rank times at
    once, and where ranks outnumber the cores a wall clock also counts the other ranks' turns on
    the core (the demo's 8 ranks on 2 cores: a block 69 ms by the wall, 28 ms of CPU)."""
    from threefold.models.llama import rotary_tables
    from threefold.parallel.pipeline.schedule import StageSpan

    m = cfg.model
    gen = torch.Generator().manual_seed(0)
    batch, seq = activation_shape[0], m.seq_len
    tokens = torch.randint(0, m.vocab_size, (batch, seq), generator=gen).to(device)
    hidden = torch.randn(*activation_shape, generator=gen).to(device)
    grad = torch.randn(*activation_shape, generator=gen).to(device)
    positions = range(seq)
    rope = tuple(t.to(device) for t in rotary_tables(m.head_dim, m.seq_len, m.rope_theta))

    def stage(blocks: range, last: bool) -> StageModule:
        module = StageModule(model, StageSpan(0, blocks, False, last))
        module.rope_cos, module.rope_sin = rope
        return module

    def embed():
        with compute():
            return model.embed(tokens), grad

    def block(i):
        module = stage(range(i, i + 1), False)

        def run():
            with compute():
                return module(hidden.detach().requires_grad_(), positions), grad
        return run

    head_module = stage(range(0), True)

    def head():
        with compute():
            return loss_fn(head_module(hidden.detach().requires_grad_(), positions), tokens), None

    parts = [([model.embed], embed)] + [([model.blocks[i]], block(i)) for i in range(m.layers)]
    parts.append(([model.norm, model.head], head))
    activations, seconds = [], [[] for _ in parts]
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    with _materialised([module for modules, _ in parts for module in modules], device):
        params = {q.untyped_storage()._cdata for q in (*model.parameters(), *rope)}  # model state, not activations
        for _, run in parts:
            activations.append(_saved_bytes(run, params))  # also the warm-up
        for _ in range(repeats):
            for (_, run), times in zip(parts, seconds):
                _sync(device)
                start = clock()
                out, g = run()
                out.backward(g)
                _sync(device)
                times.append(clock() - start)
        for q in model.parameters():
            q.grad = None
    best = [min(times) for times in seconds]
    kinds: dict[tuple, list[int]] = {}
    for i, b in enumerate(model.blocks):
        signature = tuple((name, type(sub).__name__) for name, sub in b.named_modules())
        kinds.setdefault(signature + tuple(tuple(q.shape) for q in b.parameters()), []).append(i)
    blocks = list(best[1:-1])
    for same in kinds.values():
        for i in same:
            blocks[i] = sum(best[1 + j] for j in same) / len(same)
    table = m.vocab_size * m.hidden * ADAM_STATE_BYTES
    return LayerCosts(best[0], tuple(blocks), best[-1], source=measured_source(cfg, device),
                      block_state_bytes=(float(ADAM_STATE_BYTES * block_param_count(m)),) * m.layers,
                      block_activation_bytes=tuple(activations[1:-1]),
                      embed_state_bytes=float(table), head_state_bytes=float(table + m.hidden * ADAM_STATE_BYTES))


def measured_source(cfg, device: torch.device) -> str:
    clock = " (CPU time)" if device.type == "cpu" else ""
    return (f"measured forward+backward{clock} on {device.type} {cfg.train.dtype}, micro-batch {cfg.train.micro_batch}"
            f" × {cfg.model.seq_len} tokens")


def _saved_bytes(run, params: set[int]) -> float:
    """Bytes ``run``'s forward saves for its backward, model state (``params``: parameters and the
    rotary tables) left out; runs the backward too."""
    saved = [0]

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, g = run()
    out.backward(g)
    return float(saved[0])


@contextlib.contextmanager
def _materialised(modules: list[nn.Module], device: torch.device):
    """The modules as they are, or, those on the meta device, with random values on ``device``
    for the duration; then their own meta tensors again (a tied weight still tied), for the
    engine to materialise with their real values."""
    on_meta = [module for module in modules if any(t.is_meta for t in module.parameters())]
    kept = [(sub, dict(sub._parameters), dict(sub._buffers)) for module in on_meta for sub in module.modules()]
    with torch.no_grad():
        for module in on_meta:
            module.to_empty(device=device)
            for q in module.parameters():
                q.normal_(0.0, 0.02) if q.dim() >= 2 else q.fill_(1.0)
            for buffer in module.buffers():
                buffer.zero_()
    try:
        yield
    finally:
        for sub, parameters, buffers in kept:
            sub._parameters.update(parameters)
            sub._buffers.update(buffers)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
