"""The engine: how one rank turns micro-batches into an optimizer step, for every layout.

One ``Engine`` serves every layout. ``build_engine`` (or ``Engine(model, cfg, mesh, comm)``)
transforms the plain model, which every rank built from the same seed, in one documented order:

  1. tensor (and sequence) parallelism   parallel/tensor_parallel.apply_tp, from the plan table;
  2. context parallelism                 parallel/context_parallel.apply_cp: every attention core
                                         attends over the sequence split across the cp ranks;
  3. expert parallelism                  parallel/expert_parallel.apply_ep: this rank's E/ep experts
                                         of each MoE layer, tokens dispatched to them and combined back;
  4. pipeline                            parallel/pipeline/stages.py: this rank's stage modules;
  5. gradient synchronisation, per part  data_parallel.BucketGradSync (DDP, ZeRO-1/2),
                                         fsdp.ShardedGradSync (ZeRO-3; hybrid sharding: over
                                         dps, all-reduced over dpr), or LocalGradSync (dp=cp=1),
                                         over dp, or dp × cp together under context parallelism;
                                         the experts of an ep layout over edp = dp/ep (× cp) by a sync of
                                         their own (the two driven as one, ``GradSyncs``);

A model built on the meta device (``build_model(cfg, device="meta")``) is materialised after
step 4: each rank draws only the tensors it keeps (``models.llama.initial_value``: one generator
per parameter, seeded by the run's seed and its name), cuts its piece by the placement, and
holds it on its own device; so peak memory while building is this rank's share plus the largest
single tensor, and every layout starts from the single-process weights bit for bit.

Then it assembles the parts, their gradient synchronisation, one torch AdamW over what each rank
updates, and a driver: the plain micro-batch loop, or the pipeline runtime playing this rank's
actions of the schedule. Every local tensor has a ``Placement`` (placements.py), written by
the transformation that cut it, from which the gradient norm, the full state dict and the
checkpoint pieces are computed once for all layouts. The trainer loop
(``threefold/train/trainer.py``) is the same for all:

    loss = engine.forward_backward(micro_batches)   # mean loss over this step's global batch
    norm = engine.clip_grad_norm(max_norm)           # global norm, before clipping
    engine.optimizer_step(lr)
    engine.zero_grad()

Context parallelism: the trainer hands every rank of a dp replica the same rows (whole
sequences); the engine keeps this rank's zigzag share of each (``context_parallel_batch``: its
tokens, targets and positions) before the driver runs, so the loss of a rank is the mean over
its tokens. The cp ranks hold equally many tokens and the same weights, so the gradient of the
global mean is the mean of the ranks' gradients over dp × cp, and so is the loss.

A step: each part's gradient synchronisation is told which backward is the step's last (the
plain loop says so before its last micro-batch, the runtime before each stage's last B, or W);
each bucket is reduced over dp (× cp) as soon as its last gradient is in, so under a pipeline
the reductions run during the drain. Then, in this order: the waits and the means over dp
(× cp); the tied embedding's reduced gradient summed between the first and the last stage (pp,
"tied"); gradients that are partial sums (sequence parallelism's norm gains) summed over tp;
the loss summed over pp and averaged over dp (× cp) ("scalar").
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import warnings

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from threefold.config import Config
from threefold.distributed.comm import Comm
from threefold.distributed.mesh import ParallelMesh
from threefold.models.llama import Llama, cross_entropy, initial_value, rotary_tables
from threefold.models.moe import routed_expert_keys
from threefold.parallel.data_parallel import BucketGradSync, GradSyncs, LocalGradSync
from threefold.parallel.expert_parallel import expert_keys
from threefold.parallel.tensor_parallel import vocab_parallel_cross_entropy
from threefold.train.metrics import storage_key
from threefold.words import plural
from threefold.parallel.placements import Placement, Shard, full_tensors, grad_norm, key_of, local_piece, region, \
    sum_partial_grads, whole_shards


def decay_groups(named_params) -> tuple[list, list]:
    """Weight decay applies to matrices, never to norm gains (the usual GPT/Llama practice)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return decay, no_decay


def build_adamw(named_params, cfg: Config, experts: frozenset[int] = frozenset()) -> torch.optim.AdamW:
    """AdamW with a group per (decay, learning-rate scale): the tensors whose ids are in ``experts``
    (the routed experts' weights, or their chunks) step at lr × ``model.moe_expert_lr_scale``,
    the rest at lr (``Engine.optimizer_step`` multiplies each group's ``lr_scale``)."""
    t, named = cfg.train, list(named_params)
    groups = []
    for lr_scale, mine in ((1.0, [(k, p) for k, p in named if id(p) not in experts]),
                           (cfg.model.moe_expert_lr_scale, [(k, p) for k, p in named if id(p) in experts])):
        decay, no_decay = decay_groups(mine)
        groups += [{"params": decay, "weight_decay": t.weight_decay, "lr_scale": lr_scale},
                   {"params": no_decay, "weight_decay": 0.0, "lr_scale": lr_scale}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)


def init_adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, exp_avg: torch.Tensor | None = None,
                    exp_avg_sq: torch.Tensor | None = None) -> dict:
    """``p``'s AdamW state as torch's AdamW creates it before its first step (zeros), unless it
    exists; the moments may be given (views into a flat buffer). Checkpoints need the states
    to exist before any step, to load into them."""
    state = optimizer.state[p]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
        state["exp_avg"] = torch.zeros_like(p) if exp_avg is None else exp_avg
        state["exp_avg_sq"] = torch.zeros_like(p) if exp_avg_sq is None else exp_avg_sq
    return state


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def autocast(dtype: str):
    """bf16 autocast for compute; parameters, gradients and optimizer states stay fp32."""
    if dtype == "bfloat16":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --- reading values: the only places a dry run (fake tensors: shapes, no values) differs --------
def has_values(tensor: torch.Tensor) -> bool:
    """False for a fake tensor and a meta one: shapes without storage."""
    return not (is_fake(tensor) or tensor.is_meta)


def value_of(scalar: torch.Tensor) -> float:
    """A 0-d tensor's value (the loss, the gradient norm); NaN for one without values."""
    return scalar.item() if has_values(scalar) else math.nan


def values_of(tensor: torch.Tensor) -> list | None:
    """A tensor's values as nested lists; None for one without values."""
    return tensor.tolist() if has_values(tensor) else None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def named_plain_parameters(part: nn.Module, tied: bool) -> list[tuple[str, nn.Parameter]]:
    """A part's parameters under the plain model's keys; a tied weight is "embed.weight" even
    where only the head holds it (the last pipeline stage)."""
    return [("embed.weight" if tied and key == "head.weight" else key, p) for key, p in part.named_parameters()]


@dataclasses.dataclass
class CutModel:
    """This rank's part of the model after tensor parallelism and the pipeline split."""
    parts: dict[int, nn.Module]  # stage → module (one part, stage 0, without a pipeline)
    placements: dict[str, Placement]  # plain-model key → where this rank's tensor sits
    tp: object | None  # tensor_parallel.TensorParallelGroup, when tp > 1
    schedule: object | None  # pipeline/schedule.Schedule, when pp > 1
    tied: dict[int, nn.Parameter] = dataclasses.field(default_factory=dict)  # pipeline, tied embeddings: see tied_copies
    spans: list | None = None  # pipeline: every stage's blocks (schedule.StageSpan)
    stage_costs: object | None = None  # pipeline: the costs its split balanced (schedule.LayerCosts; None: FLOPs)


def loss_function(tp):
    """The mean loss of a micro-batch: vocabulary-parallel under tensor parallelism."""
    return cross_entropy if tp is None else functools.partial(vocab_parallel_cross_entropy, tp=tp)


def cut_model(model: Llama, cfg: Config, mesh: ParallelMesh, comm: Comm) -> CutModel:
    """Transformations 1 to 4 of the plain ``model``, in place: tensor (and sequence)
    parallelism, context parallelism, expert parallelism, then this rank's pipeline stages; a model on the meta
    device is then materialised, this rank's tensors only."""
    p = cfg.parallel
    on_meta = any(q.is_meta for q in model.parameters())
    if not on_meta:
        model.to(mesh.device)
    placements = {k: Placement(tuple(v.shape)) for k, v in model.state_dict().items()}

    # 1. tensor (and sequence) parallelism
    tp = None
    if mesh.size("tp") > 1:
        from threefold.parallel.tensor_parallel import TensorParallelGroup, apply_tp

        tp = TensorParallelGroup(comm, mesh.coord("tp"), mesh.size("tp"), p.sequence_parallel, cfg.model.vocab_size,
                                 overlap=p.tp_overlap, experts_folded=mesh.folded)
        placements.update(apply_tp(model, tp))

    # 2. context parallelism: the attention cores only (the weights stay whole, replicated over cp)
    if mesh.size("cp") > 1:
        from threefold.parallel.context_parallel import apply_cp

        apply_cp(model, comm, p.cp_method)

    # 3. expert parallelism: this rank's experts; tokens dispatched to them and combined back
    if mesh.size("ep") > 1:
        from threefold.parallel.expert_parallel import apply_ep

        for key, placement in apply_ep(model, comm).items():  # a tp partial sum (SP's MoE) stays one
            placements[key] = dataclasses.replace(placement, partial=placements[key].partial)

    # 4. pipeline: this rank's stages (one part per stage), or the whole model as one part
    cut = CutModel({0: model}, placements, tp, None)
    if mesh.size("pp") > 1:
        from threefold.parallel.pipeline.partition import partition
        from threefold.parallel.pipeline.schedule import build_schedule
        from threefold.parallel.pipeline.stages import run_stage_costs, stage_modules

        cut.schedule = build_schedule(p.schedule, mesh.size("pp"), cfg.microbatches, p.virtual_stages)
        seq = cfg.model.seq_len // (tp.size if tp is not None and tp.sequence_parallel else 1)
        if p.stage_costs == "planner":  # the planner's seconds on a planned GPU: nothing to time
            from threefold.plan.stage_costs import planner_layer_costs

            cut.stage_costs = planner_layer_costs(cfg)
        else:
            cut.stage_costs = run_stage_costs(model, cfg, mesh, comm, loss_function(tp),
                                              (cfg.train.micro_batch, seq, cfg.model.hidden),
                                              compute=lambda: autocast(cfg.train.dtype))
        cut.spans = partition(cfg.model, mesh.size("pp"), cut.schedule.virtual_stages, p.stage_layers,
                              cut.stage_costs)
        cut.parts = stage_modules(model, cut.spans, cut.schedule.stages_of(mesh.coord("pp")))
        if cfg.model.tie_embeddings:
            cut.tied = tied_copies(cut.parts)
            if not any(m.first for m in cut.parts.values()):  # the last stage's copy: counted once, by stage 0
                for key in ("embed.weight", "head.weight"):
                    placements[key] = dataclasses.replace(placements[key], duplicate=True)
    if on_meta:  # draw the tensors this rank keeps, and only those
        materialise(cut, cfg, mesh.device)
    return cut


def tied_copies(parts: dict[int, nn.Module]) -> dict[int, nn.Parameter]:
    """Pipeline, tied embeddings: stage → the copy of the tied weight that this rank's end stages
    hold (the first stage's embedding, the last's head). Each copy is its stage's own parameter,
    reduced by its stage's gradient sync; ``Engine._sum_tied_grads`` then adds the two reduced
    gradients, between two ranks, or here where one rank holds both ends (DualPipeV's V puts
    them on rank 0): the head then gets a copy of its own, as if on another rank."""
    ends = {stage: m.embed.weight for stage, m in parts.items() if m.first}
    for stage, m in parts.items():
        if m.last:
            if any(m.head.weight is q for q in ends.values()):
                m.head.weight = nn.Parameter(m.head.weight.detach().clone(), requires_grad=m.head.weight.requires_grad)
            ends[stage] = m.head.weight
    return ends


def drawn_pieces(cfg: Config):
    """The reader of pieces drawn from the seed: each parameter's initial value drawn whole (its
    own generator), cut by the placement, and let go before the next is drawn."""
    def read(requests: dict[str, tuple[Placement, tuple]]) -> dict[str, torch.Tensor]:
        return {key: local_piece(initial_value(cfg.model, key, placement.full_shape, cfg.train.seed), placement,
                                 shape).clone() for key, (placement, shape) in requests.items()}
    return read


def initial_pieces(cfg: Config):
    """Where a rank's initial weights come from: ``[model] init_from`` (a Hugging Face folder or
    a checkpoint, of which it reads its pieces only), else the seed."""
    if cfg.model.init_from:
        from threefold.interop.hf import init_from_reader

        return init_from_reader(cfg.model)
    return drawn_pieces(cfg)


@torch.no_grad()
def materialise(cut: CutModel, cfg: Config, device: torch.device) -> None:
    """Give every meta tensor of this rank's parts its real value on ``device``: a parameter its
    initial value (its piece only, from ``initial_pieces``), a buffer zeros, the rotary tables
    computed."""
    m = cfg.model
    wanted = {key: (cut.placements[key], tuple(q.shape)) for part in cut.parts.values()
              for key, q in named_plain_parameters(part, m.tie_embeddings) if q.is_meta}
    values = initial_pieces(cfg)(wanted)
    made = {}  # key → the tensor made for it: a second copy (both ends of tied embeddings) is cloned from it
    for stage, part in cut.parts.items():
        real = {}  # id of a meta parameter → its materialised replacement (a tied one is made once)
        for key, q in named_plain_parameters(part, m.tie_embeddings):
            if q.is_meta and id(q) not in real:
                made[key] = values.pop(key).to(device) if key in values else made[key].clone()
                real[id(q)] = nn.Parameter(made[key], requires_grad=q.requires_grad)
        for module in part.modules():
            for name, q in module._parameters.items():
                if q is not None and id(q) in real:
                    module._parameters[name] = real[id(q)]
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
        if stage in cut.tied:
            cut.tied[stage] = real.get(id(cut.tied[stage]), cut.tied[stage])
        part.rope_cos, part.rope_sin = (t.to(device) for t in rotary_tables(m.head_dim, m.seq_len, m.rope_theta))


def build_engine(model: Llama, cfg: Config) -> "Engine":
    """The engine for ``cfg.parallel`` on this rank: joins the job's process group (creating it
    under torchrun), builds the mesh, and transforms the full plain ``model`` every rank built
    from the same seed into this rank's part of it."""
    mesh = ParallelMesh.from_config(cfg.parallel)
    return Engine(model, cfg, mesh, Comm(mesh))


class Engine:
    """One rank of any layout; see the module docstring. Without a mesh: one process."""

    def __init__(self, model: Llama, cfg: Config, mesh: ParallelMesh | None = None, comm: Comm | None = None):
        self.cfg = cfg
        self.mesh = mesh = mesh or ParallelMesh({})
        self.comm = comm = comm or Comm(mesh)
        p = cfg.parallel
        self.rank, self.world_size = mesh.rank, mesh.world_size
        self.dp_rank, self.dp_size = mesh.coord("dp"), mesh.size("dp")
        self.pp, self.pp_rank = mesh.size("pp"), mesh.coord("pp")
        self.activation_meter = None  # set by the trainer: counts bytes saved for backward
        self.tied = cfg.model.tie_embeddings
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}  # the plain model's
        self.cp = mesh.size("cp")
        # the group whose ranks hold the same weights and different tokens: gradients are reduced over it
        self.grad_axes = ("dp", "cp") if self.cp > 1 else ("dp",)
        routed_experts = routed_expert_keys(model)  # the plain model's keys, before it is cut
        cut = cut_model(model, cfg, mesh, comm)  # transformations 1 to 4, and materialisation
        self.parts, self.placements, self.tp, self.schedule = cut.parts, cut.placements, cut.tp, cut.schedule
        self.tied_copies = cut.tied
        self.loss_fn = loss_function(self.tp)
        self.spans, self.stage_costs = cut.spans, cut.stage_costs
        self.model = model if self.schedule is None else nn.ModuleList(self.parts.values())
        self.runtime = None

        # 5. gradient synchronisation over dp (× cp), per part; experts over edp (see _expert_sync)
        reduced_over = mesh.size(*self.grad_axes)
        zero = p.zero if reduced_over > 1 else 0  # ZeRO over one rank shards nothing
        experts = expert_keys(self.placements)
        if cfg.model.moe_expert_lr_scale != 1:  # their own optimizer groups: their own sync, at ep = 1 too
            experts |= routed_experts
        self.syncs = {}
        self.split_backward = self.schedule is not None and self.schedule.split_backward  # B and W apart
        # ZeRO-3: one reduction in flight for the rank's dense units, one for its experts', whatever
        # chunk of the model they are in (fsdp.Reductions)
        self._reductions = {}
        for stage, part in self.parts.items():
            named = named_plain_parameters(part, self.tied)
            alone = (self.tied_copies[stage],) if stage in self.tied_copies else ()
            placements = self._placements_of(stage)
            dense = [(k, q) for k, q in named if k not in experts]
            if reduced_over == 1:
                sync = LocalGradSync(dense, placements)
            elif zero == 3:
                from threefold.parallel.fsdp import ShardedGradSync

                sync = ShardedGradSync(part, {id(q): k for k, q in dense}, placements, mesh, comm,
                                       isolated=alone, split_backward=self.split_backward,
                                       in_flight=self._in_flight("dense"),
                                       reshard_after_forward=p.resharding, **self._shard_axes(self.grad_axes))
            else:
                sync = BucketGradSync(dense, placements, mesh, comm, zero, p.bucket_mb,
                                      overlap=p.overlap_grad_reduce, isolated=alone, **self._shard_axes(self.grad_axes))
            expert_named = [(k, q) for k, q in named if k in experts]
            self.syncs[stage] = GradSyncs([sync, self._expert_sync(part, expert_named)]) if expert_named else sync

        # the optimizer: torch AdamW over what this rank updates (parameters, or its chunks); the
        # expert syncs' at their own learning rate
        entries, expert_ids = [], set()
        for sync in self.syncs.values():
            dense_sync, *expert_syncs = sync.syncs if isinstance(sync, GradSyncs) else [sync]  # as built above
            entries += dense_sync.optimizer_params()
            for expert_sync in expert_syncs:
                found = expert_sync.optimizer_params()
                entries += found
                expert_ids |= {id(q) for _, q, _ in found}
        self.optimizer = build_adamw([(name, q) for name, q, _ in entries], cfg, frozenset(expert_ids))
        for _, q, moments in entries:
            if moments is not None:
                init_adam_state(self.optimizer, q, **moments)

        # the driver
        if self.schedule is not None:
            self._build_runtime()

    def _placements_of(self, stage: int) -> dict[str, Placement]:
        """Where stage ``stage``'s tensors sit. The head's copy of a tied embedding is a duplicate:
        the embedding's is the one counted (norms, checkpoints). Without the first stage the rank's
        placements say so already (``cut_model``); here it also holds where one rank has both."""
        if stage in self.tied_copies and not self.parts[stage].first:
            return {**self.placements, "embed.weight": dataclasses.replace(self.placements["embed.weight"],
                                                                           duplicate=True)}
        return self.placements

    def _in_flight(self, kind: str):
        """The rank's one ZeRO-3 reduction in flight for ``kind`` ("dense" or "experts")."""
        from threefold.parallel.fsdp import Reductions

        return self._reductions.setdefault(kind, Reductions())

    def _shard_axes(self, axes: tuple[str, ...]) -> dict:
        """ZeRO's groups for gradients reduced over ``axes``: shards over all of them, or under
        hybrid sharding over the group of dp_shard ranks within them (the dense weights' dps × ep;
        the experts', reduced over edp, dps), × cp, the dpr groups holding the same shards."""
        if self.mesh.size("dpr") == 1:
            return {"axes": axes}
        group = ("dps", "ep") if axes[0] == "dp" else ("dps",)
        return {"axes": group + axes[1:], "replicate_axes": ("dpr",), "mean_over": self.mesh.size(*axes)}

    def _expert_sync(self, part: nn.Module, named: list[tuple[str, nn.Parameter]]):
        """The experts' gradient synchronisation: over edp = dp/ep (× cp), the ranks that hold the same
        experts, as ZeRO 0–3 shards them there (under hybrid sharding ZeRO-3 over the dps × cp of
        them in a shard group, or where that is one rank, plain data parallelism); the sums divided
        by dp (× cp), not edp (an expert's gradient on its rank already sums the tokens of every rank
        of its ep group; see expert_parallel.py). Over an edp of one rank it only divides."""
        p, mesh, comm = self.cfg.parallel, self.mesh, self.comm
        dp = mesh.size(*self.grad_axes)
        # the cp ranks hold the same experts too, unless the ep group is folded over them
        axes = ("edp", "cp") if self.cp > 1 and not mesh.folded else ("edp",)
        zero = p.zero if mesh.size(*axes) > 1 else 0
        if zero and mesh.size("dpr") > 1 and mesh.size("dps", *axes[1:]) == 1:
            # hybrid sharding at dp_shard = ep (cp 1): a shard group holds one rank of these experts,
            # so nothing shards them; plain data parallelism over the groups, one all-reduce a step
            zero = 0
        if zero == 3:
            from threefold.models.moe import GroupedExperts
            from threefold.parallel.fsdp import ShardedGradSync

            units = nn.Module()  # one unit per layer's local experts, gathered around its forward
            units.blocks = nn.ModuleList(m for m in part.modules() if isinstance(m, GroupedExperts))
            return ShardedGradSync(units, {id(q): k for k, q in named}, self.placements, mesh, comm,
                                   split_backward=self.split_backward, in_flight=self._in_flight("experts"),
                                   reshard_after_forward=p.resharding,
                                   **dict(self._shard_axes(axes), mean_over=dp))
        return BucketGradSync(named, self.placements, mesh, comm, zero, p.bucket_mb, overlap=p.overlap_grad_reduce,
                              **dict(self._shard_axes(axes) if zero else {"axes": axes}, mean_over=dp))

    def _build_runtime(self) -> None:
        from threefold.parallel.pipeline.runtime import PipelineRuntime, ScatterGather
        from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY

        wire = None
        if self.tp is not None and not self.tp.sequence_parallel:
            wire = ScatterGather(self.comm, self.tp.size, self.tp.rank)  # each tp rank sends its 1/tp
        runtime = PipelineRuntime
        if SCHEDULE_REGISTRY[self.schedule.name].steady is not None:  # steps back to back: 2bw, pipedream
            from threefold.parallel.pipeline.asynchronous import AsyncPipelineRuntime as runtime
        self.runtime = runtime(self.schedule, self.pp_rank, self.parts, self.comm, self.loss_fn,
                                       self._compute_context, wire=wire,
                                       before_last_backward=lambda stage: self.syncs[stage].last_microbatch())
        self.last_timeline: dict | None = None
        steady = SCHEDULE_REGISTRY[self.schedule.name].steady is not None  # never flushes: no bubble a step
        if self.cfg.microbatches < self.pp and self.rank == 0 and not steady:
            from threefold.plan.simulate import ActionCosts, simulate

            chunk = 1.0 / self.schedule.virtual_stages
            bubble = simulate(self.schedule, ActionCosts(chunk, 2 * chunk, chunk)).bubble_fraction
            microbatches = plural(self.cfg.microbatches, "micro-batch")
            warnings.warn(f"parallel.microbatches: {microbatches} for {self.pp} pipeline "
                          f"ranks; {self.schedule.name} is predicted to idle {bubble:.0%} of the time "
                          f"(use at least {self.pp})", stacklevel=3)

    def stage_split(self) -> str | None:
        """The pipeline's stages, what each runs and costs, and the slowest (printed at start)."""
        if self.schedule is None:
            return None
        from threefold.parallel.pipeline.schedule import describe_split, flop_costs

        by_hand = "set by parallel.stage_layers; " if self.cfg.parallel.stage_layers is not None else ""
        if self.stage_costs is None:  # the FLOP model, in units of one block
            return by_hand + describe_split(self.spans, flop_costs(self.cfg.model), unit="blocks", scale=1.0)
        return by_hand + describe_split(self.spans, self.stage_costs)

    # --- where this rank sits -----------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank computes: batches are moved here."""
        return self.mesh.device

    @property
    def is_main(self) -> bool:
        """The rank that prints, writes metrics and saves the model."""
        return self.rank == 0

    def parameter_storages(self) -> set[int]:
        """Storages holding model state now: parameters (ZeRO-3: the gathered units) and buffers
        (the rotary tables, whose slices the blocks save); the activation meter leaves them out."""
        found = {storage_key(q) for q in itertools.chain(self.model.parameters(), self.model.buffers())}
        return found | {storage_key(t) for t in self.gathered_buffers()}

    def gathered_buffers(self) -> list[torch.Tensor]:
        """ZeRO-3's full buffers, whose storages are allocated only while their units are gathered."""
        return [t for sync in self.syncs.values() for t in getattr(sync, "gathered_storages", list)()]

    def forward_context(self):
        """Wrap each micro-batch's forward in this, so the activation meter sees it."""
        if self.activation_meter is None:
            return contextlib.nullcontext()
        return self.activation_meter.forward_pass()

    @contextlib.contextmanager
    def _compute_context(self):
        with self.forward_context(), autocast(self.cfg.train.dtype):
            yield

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sent per mesh axis since the last call."""
        return self.comm.ledger.take()

    def comm_step(self) -> tuple[dict[str, int], dict[str, float], dict[str, list[float]]]:
        """Bytes this rank sent, seconds it was blocked waiting on communication (exposed), and
        each call's seconds blocked, per ledger key since the last call."""
        return self.comm.ledger.take_step_calls()

    def barrier(self) -> None:
        self.comm.barrier()

    def shutdown(self) -> None:
        """Release process groups."""
        self.mesh.shutdown()

    # --- the step -------------------------------------------------------------------------
    @property
    def lookahead(self) -> int:
        """How many later steps' micro-batches a step starts (``forward_backward``'s ``upcoming``):
        0, except for the pipelines that never flush (2bw, pipedream)."""
        return getattr(self.runtime, "lookahead", 0)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                         upcoming: list[list[tuple[torch.Tensor, torch.Tensor]]] = ()) -> float:
        """Accumulate gradients of the mean loss over this step's global batch; return that mean.

        Every micro-batch holds the same number of tokens, so the mean of micro-batch means
        is the mean over all tokens of the batch, as one big batch would compute it.
        ``upcoming``: this rank's micro-batches of the next steps, up to ``lookahead`` of them,
        which a pipeline that never flushes starts during this step; fewer (none) flushes it.
        """
        micro_batches, positions = self.context_split(micro_batches)
        for layer in self.moe_layers():  # the balance loss is weighted like each micro-batch's loss
            layer.aux_loss_scale = 1 / len(micro_batches)
        for sync in self.syncs.values():
            sync.start_step()
        if self.runtime is None:
            loss_sum = self._plain_loop(micro_batches, positions)
        else:
            ahead = {"upcoming": upcoming} if self.lookahead else {}
            loss_sum, timeline = self.runtime.run(micro_batches, self.activation_shape(micro_batches[0][0]),
                                                  positions=positions, **ahead)
            self.last_timeline = self._gather_timeline(timeline)
        for sync in self.syncs.values():
            sync.finish()
        self._sum_tied_grads()
        if any(pl.partial for pl in self.placements.values()):  # SP's norm gains and MoE blocks, over tp
            sum_partial_grads(self.grad_shards(), self.comm)
        if self.runtime is not None:
            self.comm.all_reduce(loss_sum, "pp", tag="scalar")  # the loss lives on the last stage
        return self._mean_over_replicas(value_of(loss_sum) / len(micro_batches))

    def discard_pipeline_carry(self) -> None:
        """Stopping mid-run under 2bw or pipedream: settle the messages and drop the forwards of
        the next step, which will not run. Nothing to do for the other schedules."""
        if hasattr(self.runtime, "discard_carried"):
            self.runtime.discard_carried()

    def context_split(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]):
        """(this rank's part of each micro-batch, the positions of its tokens): under context
        parallelism its zigzag share of every sequence (a tensor), else the whole and the range
        0, 1, … (a range: the rotary tables are then sliced, not gathered)."""
        if self.cp == 1:
            return micro_batches, range(micro_batches[0][0].shape[1])
        from threefold.parallel.context_parallel import context_parallel_batch

        split = [context_parallel_batch(x, y, self.mesh) for x, y in micro_batches]
        return [(x, y) for x, y, _ in split], split[0][2]

    def _plain_loop(self, micro_batches, positions: torch.Tensor | range) -> torch.Tensor:
        model, sync = self.parts[0], self.syncs[0]
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            if i == len(micro_batches) - 1:
                sync.last_microbatch()
            with self._compute_context():
                loss = self.loss_fn(model(inputs, positions), targets)
            (loss / len(micro_batches)).backward()
            total += loss.detach().float()
        return total

    def _mean_over_replicas(self, local_mean: float) -> float:
        """The loss of the global batch: every rank of dp (× cp) ran the same number of tokens,
        so it is the mean of their means. A scalar, counted under the "scalar" tag."""
        ranks = self.mesh.size(*self.grad_axes)
        if ranks == 1:
            return local_mean
        loss = torch.tensor([local_mean], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(loss, self.grad_axes, tag="scalar")
        return value_of(loss) / ranks

    def _sum_tied_grads(self) -> None:
        """First and last stage each hold the tied weight and a part of its reduced gradient (from
        the embedding, from the head): exchange and add; a + b = b + a, so both copies stay equal.
        Where this rank holds both (DualPipeV), the sum is made once and copied to the head's."""
        grads = [self.syncs[stage].isolated_grad(q) for stage, q in self.tied_copies.items()]
        if len(grads) == 2:
            grads[1].copy_(grads[0].add_(grads[1]))
            return
        if not grads:
            return
        grad = grads[0]
        peer = self.schedule.rank_of(self.schedule.num_stages - 1) if self.pp_rank == 0 else 0
        theirs = torch.empty_like(grad)
        receive = self.comm.recv(theirs, "pp", peer, tag="tied")
        send = self.comm.send(grad, "pp", peer, tag="tied")
        receive.wait()
        send.wait()
        grad.add_(theirs)

    def activation_shape(self, tokens: torch.Tensor) -> tuple[int, ...]:
        """What crosses a stage boundary: (batch, positions, hidden); under sequence parallelism
        each tp rank holds, and sends, its 1/tp of the positions."""
        batch, seq = tokens.shape
        if self.tp is not None and self.tp.sequence_parallel:
            seq //= self.tp.size
        return batch, seq, self.cfg.model.hidden

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` without touching gradients (every replica sees all batches;
        the cp ranks their shares of them, so their means are averaged over cp)."""
        self.model.eval()
        batches, positions = self.context_split(batches)
        if self.runtime is not None:
            losses = self.runtime.forward_only(batches, self.activation_shape(batches[0][0]), positions=positions)
            self.comm.all_reduce(losses, "pp", tag="eval")
        else:
            # one tensor made before the forwards: a loss tensor kept from each would sit between
            # the heap's freed blocks and split them, so each forward's would map new memory
            # (keep_large_blocks_in_the_heap; 300 validation batches grew a run by 14 GB)
            losses = torch.zeros(len(batches), dtype=torch.float32, device=self.device)
            with autocast(self.cfg.train.dtype):
                for i, (x, y) in enumerate(batches):
                    losses[i] = self.loss_fn(self.parts[0](x, positions), y).float()
        self.model.train()
        if self.cp == 1:
            return value_of(losses.mean())
        losses = losses.mean().reshape(1).double()
        self.comm.all_reduce(losses, "cp", tag="eval")
        return value_of(losses) / self.cp

    def grad_shards(self) -> list[Shard]:
        """This rank's pieces of the reduced gradient ("grad/<key>"), placed in the full model."""
        return [s for sync in self.syncs.values() for s in sync.grad_shards()]

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most ``max_norm`` (0: no clipping);
        return the norm before."""
        norm = grad_norm(self.grad_shards(), self.mesh, self.comm)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for sync in self.syncs.values():
                for g in sync.held()["grads"]:
                    if g is not None:
                        g.mul_(coef)
        return value_of(norm)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        self.optimizer.step()
        for sync in self.syncs.values():
            sync.after_optimizer_step()
        if hasattr(self.runtime, "after_optimizer_step"):  # the weight versions of 2bw and pipedream
            self.runtime.after_optimizer_step()

    def zero_grad(self) -> None:
        for sync in self.syncs.values():
            sync.zero_grad()

    # --- Mixture-of-Experts: the step's routing counters, the same on every rank ---------------
    def _moe_layers_by_index(self) -> list[tuple[int, nn.Module]]:
        """(layer index, MoE block) of this rank's stages, in layer order."""
        from threefold.models.moe import MoE

        found = []
        for part in self.parts.values():
            blocks = part.blocks.items() if isinstance(part.blocks, nn.ModuleDict) else enumerate(part.blocks)
            found += [(int(i), block.mlp) for i, block in blocks if isinstance(block.mlp, MoE)]
        return sorted(found, key=lambda found: found[0])

    def moe_layers(self) -> list:
        """This rank's MoE blocks (its stages'), in layer order."""
        return [layer for _, layer in self._moe_layers_by_index()]

    @torch.no_grad()
    def end_moe_step(self, update_bias: bool = True) -> dict | None:
        """After the optimizer step (every rank calls it): this step's routed tokens per expert,
        dropped assignments and aux loss of every MoE layer, summed over the ranks that routed
        different tokens of the same layer (dp, × cp; with the experts folded × tp), so that every rank takes the same bias
        step (DeepSeek-V3's update from the whole step's counts) and the metrics describe the
        global batch; under a pipeline the stages' rows are summed too, so they describe every
        layer. One all-reduce per axis, tagged "moe". Then the layers' counters restart. Returns
        the step's statistics (``models/moe.routing_statistics``); None for a dense model."""
        from threefold.models.moe import routing_statistics
        from threefold.models.sizes import is_moe_layer

        m = self.cfg.model
        everywhere = [i for i in range(m.layers) if is_moe_layer(m, i)]
        if not m.moe_experts or not everywhere:
            return None
        experts, row_of = m.moe_experts, {layer: row for row, layer in enumerate(everywhere)}
        table = torch.zeros(len(everywhere), experts + 2, dtype=torch.float64, device=self.device)
        mine = self._moe_layers_by_index()
        for index, layer in mine:  # counts, dropped, aux loss (summed over micro-batches)
            table[row_of[index]] = torch.cat([layer.step_tokens.double(), layer.step_dropped.double().view(1),
                                              layer.step_aux_loss.double().view(1)])
        routed_apart = self.grad_axes + (("tp",) if self.mesh.folded else ())  # folded: each tp rank its positions
        ranks = self.mesh.size(*routed_apart)
        if ranks > 1:
            self.comm.all_reduce(table, routed_apart, tag="moe")
        if self.pp > 1:
            self.comm.all_reduce(table, "pp", tag="moe")  # each row is one stage's; the others add zeros
        counts = table[:, :experts].round().long()
        for index, layer in mine:
            layer.end_step(counts[row_of[index]], update_bias)
        return routing_statistics(counts, table[:, experts].sum().item(), table[:, experts + 1].sum().item() / ranks,
                                  self.cfg.microbatches, ep=self.cfg.parallel.ep)

    # --- the measured timeline ----------------------------------------------------------------
    def _gather_timeline(self, timeline) -> dict:
        """Every pipeline rank's timeline of this step (all ranks of this rank's pp group take
        part), times in seconds from the earliest start. perf_counter is one clock for all
        processes of a machine; across machines the ranks' clocks are not aligned. ``origin_s``:
        the earliest start, in ``time.perf_counter()`` seconds (the ledger's clock)."""
        from threefold.parallel.pipeline.schedule import Kind

        kinds = list(Kind)
        longest = max(len(actions) for actions in getattr(self.runtime, "step_actions", self.schedule.actions))
        rows = [[a.start, a.end, kinds.index(a.kind), a.microbatch, a.stage] for a in timeline]
        mine = torch.full((longest, 5), math.nan, dtype=torch.float64, device=self.device)  # NaN rows: padding
        mine[:len(rows)] = torch.tensor(rows, dtype=torch.float64, device=self.device)
        everyone = torch.empty(self.pp * longest * 5, dtype=torch.float64, device=self.device)
        self.comm.all_gather(everyone, mine.reshape(-1), "pp", tag="timeline")
        values = values_of(everyone.view(self.pp, longest, 5))
        if values is None:  # fake tensors: the other ranks' rows have no values; this rank's are its own
            values = [rows if r == self.pp_rank else [] for r in range(self.pp)]
        origin = min(row[0] for rank in values for row in rank if not math.isnan(row[0]))
        ranks = [[[row[0] - origin, row[1] - origin, kinds[int(row[2])].value, int(row[3]), int(row[4])]
                  for row in rank if not math.isnan(row[0])] for rank in values]
        return {"schedule": self.schedule.name, "pp": self.pp, "microbatches": self.schedule.microbatches,
                "virtual_stages": self.schedule.virtual_stages, "origin_s": origin, "ranks": ranks,
                "stage_layers": [len(span.blocks) for span in self.spans]}

    def step_timeline(self) -> dict | None:
        """The last step's measured pipeline timeline for the metrics file (per pp rank, every
        action as [start_s, end_s, kind, micro-batch, stage]); None without a pipeline."""
        return self.last_timeline if self.runtime is not None else None

    # --- what this rank holds -----------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes of parameters, gradients and optimizer states held by this rank.

        Optimizer states are Adam's two moments; the step counters (one scalar per tensor)
        are left out, as every memory model does.
        """
        held = [sync.held() for sync in self.syncs.values()]
        states = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        held_bytes = {"params": tensor_bytes(t for h in held for t in h["params"]),
                      "grads": tensor_bytes(t for h in held for t in h["grads"]),
                      "optimizer": tensor_bytes(states)}
        if hasattr(self.runtime, "weight_version_bytes"):  # 2bw, pipedream: the stored weight versions
            held_bytes["weight_versions"] = sum(self.runtime.weight_version_bytes().values())
        return held_bytes

    # --- layout-independent checkpoints: this rank's pieces of the full states --------------
    def weight_shards(self) -> list[Shard]:
        """This rank's pieces of the model's state: its parameters (as its gradient sync holds
        them) and its persistent buffers (whole: the experts' routing biases)."""
        buffers = [s for part in self.parts.values() for key, b in self._persistent_buffers(part)
                   for s in whole_shards(f"model/{key}", b, Placement(tuple(b.shape)))]
        return [s for sync in self.syncs.values() for s in sync.weight_shards()] + buffers

    @staticmethod
    def _persistent_buffers(part: nn.Module) -> list[tuple[str, torch.Tensor]]:
        keys = set(part.state_dict(keep_vars=True))
        return [(key, b) for key, b in part.named_buffers() if key in keys]

    def moment_shards(self) -> list[Shard]:
        """Adam's moments of what this rank updates (created as AdamW would, if no step ran yet)."""
        state_of = functools.partial(init_adam_state, self.optimizer)
        return [s for sync in self.syncs.values() for s in sync.moment_shards(state_of)]

    def checkpoint_shards(self) -> list[Shard]:
        """This rank's pieces of the weights ("model/<key>") and of Adam's moments
        ("exp_avg/<key>", "exp_avg_sq/<key>"), each placed in the plain model's tensor, and
        (2bw, pipedream) of the older weight versions ("version<j>/<key>"); views into the live
        states, so ``train/checkpoint.py`` saves from them and loads into them."""
        versions = []
        if hasattr(self.runtime, "version_shards"):
            named = {stage: named_plain_parameters(part, self.tied) for stage, part in self.parts.items()}
            versions = self.runtime.version_shards(named, self.placements)
        return self.weight_shards() + self.moment_shards() + versions

    def adam_step(self) -> float:
        """The optimizer's step count (the same for every tensor: they all step together)."""
        return max((float(s["step"]) for s in self.optimizer.state.values() if "step" in s), default=0.0)

    def set_adam_step(self, step: float) -> None:
        """Resume at ``step`` updates: Adam's count and (2bw, pipedream) the weight versions kept
        there, whose buffers ``checkpoint_shards`` then includes for the load to fill."""
        for q in (q for group in self.optimizer.param_groups for q in group["params"]):
            init_adam_state(self.optimizer, q)["step"].fill_(step)
        if hasattr(self.runtime, "resume_at"):
            self.runtime.resume_at(int(step))

    # --- full (unsharded) states, keyed like the plain model (collectives: every rank calls them)
    @torch.no_grad()
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict, gathered from every rank's pieces."""
        alias = {"head.weight": "embed.weight"} if self.tied else {}
        shapes = {f"model/{k}": shape for k, shape in self.shapes.items() if k not in alias}
        full = full_tensors(self.weight_shards(), shapes, self.mesh, self.comm)
        return {k: full[f"model/{alias.get(k, k)}"].clone() for k in self.shapes}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full plain-model state dict into whatever this rank holds of it (its
        checkpoint pieces: whole tensors, tp slices or ZeRO chunks), on any layout."""
        with torch.device("meta"):
            Llama(self.cfg.model).load_state_dict(state, assign=True)  # strict: refuses other keys or shapes
        for shard in self.weight_shards():
            shard.tensor.copy_(region(state[key_of(shard)], shard.offsets, shard.tensor.shape))

    def plain_model(self) -> nn.Module:
        """A single-device model with the current weights, for generation and export."""
        # the gathered state is on self.device already (mesh.device): .to only makes that sure
        return Llama.from_state_dict(self.cfg.model, self.model_state_dict()).to(self.device)
