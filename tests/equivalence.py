"""What every equivalence test does: the same global batches for every layout, each rank's
rows of them split into micro-batches as the trainer does, and a few optimizer steps."""
from __future__ import annotations

import torch


def global_batches(cfg, steps: int) -> list[torch.Tensor]:
    """Random tokens from a fixed seed: the same global batches for every layout."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.model.seq_len + 1), generator=gen)
            for _ in range(steps)]


def my_micro_batches(tokens: torch.Tensor, cfg, dp_rank: int, dp_size: int):
    """Rows [r·B/dp, (r+1)·B/dp) of the global batch, split into micro-batches, as the trainer does."""
    rows = tokens.shape[0] // dp_size
    mine = tokens[dp_rank * rows:(dp_rank + 1) * rows]
    return list(zip(mine[:, :-1].split(cfg.train.micro_batch), mine[:, 1:].split(cfg.train.micro_batch)))


def train_steps(engine, cfg, batches) -> dict:
    """Losses, gradient norms and bytes per step; model-state bytes after the last update."""
    out = {"losses": [], "norms": [], "comm": [], "memory": None}
    for tokens in batches:
        out["losses"].append(engine.forward_backward(my_micro_batches(tokens, cfg, engine.dp_rank, engine.dp_size)))
        out["norms"].append(engine.clip_grad_norm(cfg.train.grad_clip))
        engine.optimizer_step(cfg.train.lr)
        out["memory"] = engine.memory_bytes()
        engine.zero_grad()
        out["comm"].append(engine.comm_bytes())
    return out


def train_reference(cfg, steps: int):
    """The single-process run every layout is compared with: (its engine, ``train_steps``'
    results plus the initial and final full states)."""
    from threefold.models.llama import Llama
    from threefold.train.engine import Engine

    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    model.set_recompute(cfg.train.recompute)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = Engine(model, cfg)
    out = train_steps(engine, cfg, global_batches(cfg, steps))
    out["state"], out["initial"] = engine.model_state_dict(), initial
    return engine, out
