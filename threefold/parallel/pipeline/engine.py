"""The pipeline-parallel engine: pp × dp × tp on one mesh.

Every rank builds the full plain model from the seed, so its initial weights are the
single-process model's. Then, in torchtitan's order:

  1. tensor parallelism (tp > 1): ``tensor_parallel.parallelize`` cuts every matrix in place;
  2. pipeline: ``partition`` assigns blocks to stages; this rank keeps the ``StageModule`` of
     each of its stages (stage s on pipeline rank s % pp) and nothing else of the model;
  3. data parallelism over dp: the kept parameters are laid out in gradient buckets
     (``data_parallel.Bucket``): all-reduced (zero 0), or reduce-scattered with the optimizer
     sharded and the parameters all-gathered after the update (zero 1). ZeRO-2/3 are refused
     with pp > 1 (``partition.check_pipeline`` says why).

A step: the ``PipelineRuntime`` executes this rank's actions of the schedule; gradients of all
micro-batches accumulate in the buckets. Then, in this order: the tied embedding's gradient
is summed between the first and the last stage (point-to-point on the pp axis, tagged "tied");
with sequence parallelism the norm gains' gradients are summed over tp (each rank saw a part of
the sequence); the buckets are reduced over dp. The loss of the global batch is on the last
stage: summed over pp (zeros elsewhere) and averaged over dp, both as "scalar" traffic.

Gradient norm: matrices are tp shards (their squares are summed over tp), vectors are the same
on every tp rank (counted once), the stages' parts are summed over pp, ZeRO-1's chunks over dp;
the tied weight's copy on the last stage is left out, so it counts once.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
from torch import nn

from threefold.config import Config
from threefold.distributed.comm import Comm
from threefold.distributed.mesh import ParallelMesh
from threefold.models.llama import Llama, cross_entropy
from threefold.parallel.data_parallel import Bucket, BucketedEngine, make_buckets, sharded_adamw
from threefold.parallel.pipeline.partition import StageSpan, check_pipeline, partition
from threefold.parallel.pipeline.runtime import MeasuredAction, PipelineRuntime, ScatterGather
from threefold.parallel.pipeline.schedule import Kind, Schedule, build_schedule
from threefold.plan.simulate import ActionCosts, simulate
from threefold.train.engine import autocast, scale_to_norm, tensor_bytes
from threefold.train.shards import Placement, tensor_parallel_placement


class StageModule(nn.Module):
    """The part of the plain model one stage runs. Its modules are the plain model's own (so
    its parameter names are the plain model's state-dict keys): the embedding on the first
    stage, blocks ``span.blocks``, the final norm and head on the last."""

    def __init__(self, model: Llama, span: StageSpan):
        super().__init__()
        self.span = span
        self.first, self.last = span.first, span.last
        self.embed = model.embed if span.first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in span.blocks})
        self.norm = model.norm if span.last else None
        self.head = model.head if span.last else None
        self.rope_cos, self.rope_sin = model.rope_cos, model.rope_sin

    def forward(self, hidden: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The next stage's input, or on the last stage the logits. ``seq_len``: the tokens'
        length (the hidden state holds fewer positions under sequence parallelism)."""
        positions = torch.arange(seq_len, device=hidden.device)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for block in self.blocks.values():
            hidden = block(hidden, cos, sin, positions)
        if self.last:
            return self.head(self.norm(hidden))
        return hidden


class PipelineEngine(BucketedEngine):
    """Pipeline parallelism over pp, with tp and dp (zero 0 or 1) on the same mesh."""

    def __init__(self, model: Llama, cfg: Config, mesh: ParallelMesh, comm: Comm):
        check_pipeline(cfg)
        p = cfg.parallel
        self.pp, self.pp_rank = mesh.size("pp"), mesh.coord("pp")
        self.schedule = build_schedule(p.schedule, self.pp, cfg.microbatches, p.virtual_stages)
        self.tp = None
        self.tp_splits = {}
        if mesh.size("tp") > 1:
            from threefold.parallel.tensor_parallel import TensorParallelGroup, parallelize

            self.tp = TensorParallelGroup(comm, mesh.coord("tp"), mesh.size("tp"), p.sequence_parallel,
                                          cfg.model.vocab_size)
            self.tp_splits = parallelize(model, self.tp)
        self.spans = partition(cfg.model, self.pp, p.virtual_stages)
        self.stages = {s: StageModule(model, self.spans[s]) for s in self.schedule.stages_of(self.pp_rank)}
        stage_modules = nn.ModuleList(self.stages.values())
        self.state_keys = list(model.state_dict().keys())  # the plain model's, for checkpoints
        self.zero = p.zero
        self.tied = None  # the tied embedding/head weight, when this rank holds either end
        if cfg.model.tie_embeddings:
            ends = [m.embed for m in self.stages.values() if m.first] + [m.head for m in self.stages.values() if m.last]
            self.tied = ends[0].weight if ends else None
        # The tied weight gets a bucket of its own: its gradient crosses the pipeline alone, and
        # the last stage's copy is left out of the gradient norm.
        others = [q for q in stage_modules.parameters() if q is not self.tied]
        self.tied_bucket = Bucket([self.tied], mesh, self.zero) if self.tied is not None else None
        self.buckets = make_buckets(nn.ParameterList(others), mesh, p.bucket_mb, self.zero)
        if self.tied_bucket is not None:
            self.buckets.append(self.tied_bucket)
        super().__init__(stage_modules, cfg, mesh, comm)
        self.sharded_grads = self.zero == 1
        if self.sharded_grads:
            self.optimizer, self.moment_chunks = sharded_adamw(
                [b.layout for b in self.buckets], [b.layout.own(b.param_flat) for b in self.buckets],
                [b.grad_chunk for b in self.buckets], cfg)
        loss_fn = cross_entropy
        if self.tp is not None:
            from threefold.parallel.tensor_parallel import vocab_parallel_cross_entropy

            loss_fn = functools.partial(vocab_parallel_cross_entropy, tp=self.tp)
        wire = None
        if self.tp is not None and not p.sequence_parallel:
            wire = ScatterGather(comm, self.tp.size, self.tp.rank)  # each tp rank sends its 1/tp
        self.runtime = PipelineRuntime(self.schedule, self.pp_rank, self.stages, comm, loss_fn, self._compute_context,
                                       wire=wire)
        self.last_timeline: dict | None = None
        if cfg.microbatches < self.pp and self.rank == 0:
            warnings.warn(f"parallel.microbatches: {cfg.microbatches} micro-batches for {self.pp} pipeline ranks; "
                          f"{p.schedule} is predicted to idle {predicted_bubble(self.schedule):.0%} of the time "
                          f"(use at least {self.pp})", stacklevel=2)

    @contextlib.contextmanager
    def _compute_context(self):
        with self.forward_context(), autocast(self.cfg.train.dtype):
            yield

    def activation_shape(self, tokens: torch.Tensor) -> tuple[int, ...]:
        """What crosses a stage boundary: (batch, positions, hidden); under sequence parallelism
        each tp rank holds, and sends, its 1/tp of the positions."""
        batch, seq = tokens.shape
        if self.tp is not None and self.tp.sequence_parallel:
            seq //= self.tp.size
        return batch, seq, self.cfg.model.hidden

    # --- the step -----------------------------------------------------------------------------
    def forward_backward(self, micro_batches) -> float:
        loss_sum, timeline = self.runtime.run(micro_batches, self.activation_shape(micro_batches[0][0]))
        self.last_timeline = self._gather_timeline(timeline)
        self._sum_tied_grads()
        if self.tp is not None and self.tp.sequence_parallel:
            self._sum_norm_grads_over_tp()
        self._reduce_over_dp()
        self.comm.all_reduce(loss_sum, "pp", tag="scalar")
        return self.mean_over_dp((loss_sum / len(micro_batches)).item())

    def _sum_tied_grads(self) -> None:
        """First and last stage each hold the tied weight and a part of its gradient (from the
        embedding, from the head): exchange and add; a + b = b + a, so both copies stay equal."""
        if self.tied is None:
            return
        peer = self.schedule.rank_of(self.schedule.num_stages - 1) if self.pp_rank == 0 else 0
        grad = self.tied.grad
        theirs = torch.empty_like(grad)
        receive = self.comm.recv(theirs, "pp", peer, tag="tied")
        send = self.comm.send(grad, "pp", peer, tag="tied")
        receive.wait()
        send.wait()
        grad.add_(theirs)

    def _sum_norm_grads_over_tp(self) -> None:
        """Sequence parallelism: each tp rank's norm gains saw its part of the sequence only."""
        grads = [q.grad for q in self.model.parameters() if q.dim() == 1]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.comm.all_reduce(flat, "tp", tag="norm_grads")
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _reduce_over_dp(self) -> None:
        if self.zero == 0:
            pending = [self.comm.all_reduce(b.grad_flat, "dp", async_op=True) for b in self.buckets]
        else:
            pending = [self.comm.reduce_scatter(b.grad_chunk, b.grad_flat, "dp", async_op=True) for b in self.buckets]
        for bucket, work in zip(self.buckets, pending):
            work.wait()
            (bucket.grad_flat if self.zero == 0 else bucket.grad_chunk).div_(self.dp_size)

    # --- the measured timeline ----------------------------------------------------------------
    def _gather_timeline(self, timeline: list[MeasuredAction]) -> dict:
        """Every pipeline rank's timeline of this step (all ranks of this rank's pp group take
        part), times in seconds from the earliest start. perf_counter is one clock for all
        processes of a machine; across machines the ranks' clocks are not aligned."""
        kinds = list(Kind)
        longest = max(len(actions) for actions in self.schedule.actions)
        mine = torch.full((longest, 5), math.nan, dtype=torch.float64)  # NaN rows: padding to the longest
        mine[:len(timeline)] = torch.tensor([[a.start, a.end, kinds.index(a.kind), a.microbatch, a.stage]
                                             for a in timeline], dtype=torch.float64)
        everyone = torch.empty(self.pp * longest * 5, dtype=torch.float64)
        self.comm.all_gather(everyone, mine.reshape(-1), "pp", tag="timeline")
        everyone = everyone.view(self.pp, longest, 5)
        origin = everyone[..., 0].nan_to_num(math.inf).min().item()
        ranks = [[[row[0] - origin, row[1] - origin, kinds[int(row[2])].value, int(row[3]), int(row[4])]
                  for row in rank.tolist() if not math.isnan(row[0])] for rank in everyone]
        return {"schedule": self.schedule.name, "pp": self.pp, "microbatches": self.schedule.microbatches,
                "virtual_stages": self.schedule.virtual_stages, "ranks": ranks}

    def step_timeline(self) -> dict | None:
        """The last step's measured timeline of this rank's pipeline: per pp rank, every action
        as [start_s, end_s, kind, micro-batch, stage] (kind "F", "B", "W", "send_act", …)."""
        return self.last_timeline

    # --- after the step -----------------------------------------------------------------------
    def _norm_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Squares of this rank's reduced gradient: (matrices, which are tp shards; vectors, the
        norm gains, the same on every tp rank)."""
        matrices, vectors = torch.zeros(()), torch.zeros(())
        for bucket in self.buckets:
            if bucket is self.tied_bucket and self.pp_rank != 0:
                continue  # the last stage's copy of the tied weight; the first stage counts it
            layout = bucket.layout
            if self.zero == 0:  # the whole buffer: matrices first, then vectors (decay_first)
                parts = [("decay", bucket.grad_flat[:layout.decay_numel]),
                         ("no_decay", bucket.grad_flat[layout.decay_numel:])]
            else:
                parts = layout.decay_split(bucket.grad_chunk)
            for kind, grad in parts:
                if kind == "decay":
                    matrices += grad.float().pow(2).sum()
                else:
                    vectors += grad.float().pow(2).sum()
        return matrices, vectors

    def clip_grad_norm(self, max_norm: float) -> float:
        matrices, vectors = self._norm_parts()
        if self.tp is not None:
            self.comm.all_reduce(matrices, "tp", tag="scalar")
        squares = matrices + vectors
        self.comm.all_reduce(squares, "pp", tag="scalar")
        if self.sharded_grads:
            self.comm.all_reduce(squares, "dp", tag="scalar")
        return scale_to_norm(self.reduced_grads(), squares, max_norm)

    def memory_bytes(self) -> dict[str, int]:
        return {"params": tensor_bytes(b.param_flat for b in self.buckets),
                "grads": tensor_bytes(b.grad_flat for b in self.buckets),
                "optimizer": self.optimizer_state_bytes()}

    # --- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        self.model.eval()
        losses = self.runtime.forward_only(batches, self.activation_shape(batches[0][0]))
        self.model.train()
        self.comm.all_reduce(losses, "pp", tag="eval")
        return losses.mean().item()

    # --- full states, keyed like the plain model (collectives: every rank calls them) --------
    def _local_params(self) -> dict[str, nn.Parameter]:
        return {name: param for stage in self.stages.values() for name, param in stage.named_parameters()}

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The stages' parameters under plain-model keys; the last stage's copy of a tied weight
        is the embedding's (the checkpoint holds it once)."""
        named = {}
        for key, param in self._local_params().items():
            named.setdefault(id(param), ("embed.weight" if param is self.tied else key, param))
        return list(named.values())

    def placement(self, key: str, local_shape) -> Placement:
        return tensor_parallel_placement(local_shape, self.tp_splits.get(key), self.tp.rank if self.tp else 0)

    @torch.no_grad()
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole over tp (gathered), then every stage's tensors gathered over pp: one flat fp32
        buffer per pipeline rank, padded to the longest."""
        whole = {key: self._gather_over_tp(key, param.detach()) for key, param in self._local_params().items()}
        shapes = _plain_shapes(self.cfg)
        keys_of = [self._keys_of_rank(rank) for rank in range(self.pp)]
        sizes = [sum(shapes[k].numel() for k in keys) for keys in keys_of]
        longest = max(sizes)
        flat = torch.zeros(longest)
        torch.cat([whole[k].reshape(-1).float() for k in keys_of[self.pp_rank]], out=flat[:sizes[self.pp_rank]])
        everyone = torch.empty(self.pp * longest)
        self.comm.all_gather(everyone, flat, "pp", tag="checkpoint")
        state = {}
        for rank, keys in enumerate(keys_of):
            values = everyone[rank * longest:rank * longest + sizes[rank]].split([shapes[k].numel() for k in keys])
            state.update({k: v.view(shapes[k]).clone() for k, v in zip(keys, values)})
        return {k: state[k] for k in self.state_keys}

    def _keys_of_rank(self, rank: int) -> list[str]:
        """The plain model's state-dict keys held by pipeline rank ``rank``, in the model's order."""
        spans = [self.spans[s] for s in self.schedule.stages_of(rank)]
        return [key for key in self.state_keys if any(_stage_owns(span, key) for span in spans)]

    def _gather_over_tp(self, key: str, local: torch.Tensor) -> torch.Tensor:
        split = self.tp_splits.get(key)
        if split is None or split.dim is None:
            return local
        from threefold.parallel.tensor_parallel import all_gather_stacked

        parts = all_gather_stacked(local, self.tp, "checkpoint")
        return torch.cat(parts.unbind(0), dim=split.dim).narrow(split.dim, 0, split.size)

    def plain_model(self) -> nn.Module:
        plain = Llama(self.cfg.model).to(self.mesh.device)
        plain.load_state_dict(self.model_state_dict())
        return plain


def _stage_owns(span: StageSpan, key: str) -> bool:
    """Whether a plain-model state-dict key belongs to the stage ``span``."""
    root, _, rest = key.partition(".")
    if root == "blocks":
        return int(rest.partition(".")[0]) in span.blocks
    return (root == "embed" and span.first) or (root in ("norm", "head") and span.last)


def _plain_shapes(cfg: Config) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in Llama(cfg.model).state_dict().items()}


def predicted_bubble(schedule: Schedule) -> float:
    """The simulator's bubble for ``schedule`` with uniform stages (backward = 2 × forward)."""
    chunk = 1.0 / schedule.virtual_stages
    return simulate(schedule, ActionCosts(forward=chunk, backward=2 * chunk, weight_grad=chunk)).bubble_fraction
