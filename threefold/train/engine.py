"""The engine: how one rank turns micro-batches into an optimizer step.

``Engine`` is the single-process engine. Each parallel strategy provides a subclass that
changes where gradients are reduced, which states are sharded and how the model is split,
while the trainer loop (``threefold/train/trainer.py``) stays the same:

    loss = engine.forward_backward(micro_batches)   # mean loss over this step's global batch
    norm = engine.clip_grad_norm(max_norm)           # global norm, before clipping
    engine.optimizer_step(lr)
    engine.zero_grad()
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from threefold.config import Config
from threefold.models.llama import Llama, cross_entropy
from threefold.train.shards import MOMENTS, Placement, Shard, key_of, region, whole_shards


def decay_groups(named_params) -> tuple[list, list]:
    """Weight decay applies to matrices, never to norm gains (the usual GPT/Llama practice)."""
    decay, no_decay = [], []
    for _, p in named_params:
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return decay, no_decay


def build_adamw(named_params, cfg: Config) -> torch.optim.AdamW:
    decay, no_decay = decay_groups(named_params)
    t = cfg.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
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


def scale_to_norm(grads, squares: torch.Tensor, max_norm: float) -> float:
    """Scale ``grads`` so that their global L2 norm, √``squares`` summed over every rank, is at
    most ``max_norm`` (0: no clipping); return the norm before. Every engine clips through here."""
    norm = squares.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
    return norm.item()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Engine:
    """Single process: plain forward/backward, gradient accumulation, torch AdamW."""

    # Where this rank sits; parallel engines set these from their mesh.
    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1

    def __init__(self, model: nn.Module, cfg: Config):
        self.model = model
        self.cfg = cfg
        self.optimizer = build_adamw(model.named_parameters(), cfg)
        self.activation_meter = None  # set by the trainer: counts bytes saved for backward

    @property
    def device(self) -> torch.device:
        """Where this rank computes: batches are moved here."""
        return next(self.model.parameters()).device

    def parameter_storages(self) -> set[int]:
        """Storages holding parameters now; the activation meter leaves them out."""
        return {p.untyped_storage().data_ptr() for p in self.model.parameters()}

    def forward_context(self):
        """Wrap each micro-batch's forward in this, so the activation meter sees it."""
        if self.activation_meter is None:
            return contextlib.nullcontext()
        return self.activation_meter.forward_pass()

    @property
    def is_main(self) -> bool:
        """The rank that prints, writes metrics and saves the model."""
        return self.rank == 0

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sent per mesh axis since the last call (a single process sends none)."""
        return {}

    def step_timeline(self) -> dict | None:
        """The last step's measured pipeline timeline for the metrics file (pipeline engines:
        per pipeline rank, each action's start, end, kind, micro-batch and stage); None otherwise."""
        return None

    def barrier(self) -> None:
        """Wait for every rank (nothing to wait for on one process)."""

    def shutdown(self) -> None:
        """Release process groups and background work."""

    # --- the step -------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token loss; tensor parallelism swaps in its vocab-parallel form."""
        return cross_entropy(logits, targets)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Accumulate gradients of the mean loss over all micro-batches; return that mean.

        Every micro-batch holds the same number of tokens, so the mean of micro-batch means
        is the mean over all tokens of the batch, as one big batch would compute it.
        """
        total = torch.zeros(())
        for inputs, targets in micro_batches:
            with self.forward_context(), autocast(self.cfg.train.dtype):
                loss = self.loss(self.model(inputs), targets)
            (loss / len(micro_batches)).backward()
            total += loss.detach().float()
        return (total / len(micro_batches)).item()

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` without touching gradients (every rank sees all batches)."""
        self.model.eval()
        losses = []
        for inputs, targets in batches:
            with autocast(self.cfg.train.dtype):
                losses.append(self.loss(self.model(inputs), targets).float())
        self.model.train()
        return torch.stack(losses).mean().item()

    def grad_norm_squared(self) -> torch.Tensor:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so their global L2 norm is at most ``max_norm``; return the norm before."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return scale_to_norm(grads, self.grad_norm_squared(), max_norm)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # --- what this rank holds --------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Exact bytes of parameters, gradients and optimizer states held by this rank.

        Optimizer states are Adam's two moments; the step counters (one scalar per tensor)
        are left out, as every memory model does.
        """
        params = list({id(p): p for p in self.model.parameters()}.values())
        states = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        return {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
                "optimizer": tensor_bytes(states)}

    # --- full (unsharded) states, keyed like the plain model --------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a full plain-model state dict into whatever this rank holds of it (its
        checkpoint pieces: whole tensors, tp slices or ZeRO chunks), on any layout."""
        with torch.device("meta"):
            Llama(self.cfg.model).load_state_dict(state, assign=True)  # strict: refuses other keys or shapes
        for shard in self.weight_shards():
            shard.tensor.copy_(region(state[key_of(shard)], shard.offsets, shard.tensor.shape))

    # --- layout-independent checkpoints: this rank's pieces of the full states --------------
    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters this rank holds, under their plain-model keys (a tied weight once)."""
        return list(self.model.named_parameters())

    def placement(self, key: str, local_shape) -> Placement:
        """Where this rank's tensor of ``key`` lies in the full one (here: it is the whole)."""
        return Placement(tuple(local_shape))

    def checkpoint_shards(self) -> list[Shard]:
        """This rank's pieces of the weights ("model/<key>") and of Adam's moments
        ("exp_avg/<key>", "exp_avg_sq/<key>"), each placed in the plain model's tensor; views
        into the live states, so ``train/checkpoint.py`` saves from them and loads into them."""
        return self.weight_shards() + self.moment_shards()

    def weight_shards(self) -> list[Shard]:
        """Here: every parameter whole."""
        return [shard for key, p in self.named_local_parameters()
                for shard in whole_shards(f"model/{key}", p.data, self.placement(key, p.shape))]

    def moment_shards(self) -> list[Shard]:
        """Here: each parameter's moments whole (created as AdamW would, if no step ran yet)."""
        shards = []
        for key, p in self.named_local_parameters():
            state = init_adam_state(self.optimizer, p)
            shards += [s for m in MOMENTS for s in whole_shards(f"{m}/{key}", state[m], self.placement(key, p.shape))]
        return shards

    def adam_step(self) -> float:
        """The optimizer's step count (the same for every tensor: they all step together)."""
        return max((float(s["step"]) for s in self.optimizer.state.values() if "step" in s), default=0.0)

    def set_adam_step(self, step: float) -> None:
        for p in (p for group in self.optimizer.param_groups for p in group["params"]):
            init_adam_state(self.optimizer, p)["step"].fill_(step)

    def plain_model(self) -> nn.Module:
        """A single-device model with the current weights, for generation and export."""
        return self.model
