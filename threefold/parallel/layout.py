"""Can the strategies run this layout? One small check per strategy, run while the config is
read, before any process starts (torchtitan's ``ParallelDims`` plays this part). Torch-free.

Each check raises ``ConfigError`` with one line that names the key and the reason.
"""
from __future__ import annotations

from threefold.config import Config, ConfigError, ModelConfig, ParallelConfig


def check_layout(cfg: Config) -> None:
    p = cfg.parallel
    for axis, name in (("cp", "context"), ("ep", "expert")):
        if getattr(p, axis) > 1:
            raise ConfigError(f"parallel.{axis}: {name} parallelism is not in the engine yet (the planner models it)")
    check_tensor_parallel(cfg.model, p)
    check_pipeline(cfg)


def check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """tensor_parallel.py splits heads, key/value heads, the FFN width and the vocabulary."""
    t = parallel.tp
    if t == 1:
        return
    if model.heads % t:
        raise ConfigError(f"parallel.tp: {t} does not divide model.heads={model.heads} "
                          "(each rank computes whole heads)")
    if model.n_kv_heads % t:
        raise ConfigError(f"parallel.tp: {t} does not divide the {model.n_kv_heads} key/value heads (model.kv_heads); "
                          "tensor parallelism splits them, it does not replicate them")
    if model.ffn_hidden % t:
        raise ConfigError(f"parallel.tp: {t} does not divide the FFN width {model.ffn_hidden} (model.ffn)")
    if model.vocab_size is not None and model.vocab_size < t:
        raise ConfigError(f"parallel.tp: {t} ranks cannot share a vocabulary of {model.vocab_size} tokens "
                          "(model.vocab_size)")
    if parallel.sequence_parallel and model.seq_len % t:
        raise ConfigError(f"parallel.sequence_parallel: tp={t} does not divide model.seq_len={model.seq_len}")


def check_pipeline(cfg: Config) -> None:
    """The pipeline runtime needs a block per stage and the schedule's own conditions."""
    p = cfg.parallel
    if p.pp == 1:
        return
    stages = p.pp * p.virtual_stages
    if stages > cfg.model.layers:
        raise ConfigError(f"parallel.pp: pp × virtual_stages = {p.pp} × {p.virtual_stages} = {stages} stages, "
                          f"more than the model's {cfg.model.layers} layers (each stage needs a block)")
    if p.schedule == "interleaved":
        if cfg.model.layers % p.pp or (cfg.model.layers // p.pp) % p.virtual_stages:
            raise ConfigError(f"parallel.virtual_stages: interleaved splits each rank's layers into equal chunks, "
                              f"but {cfg.model.layers} layers over pp={p.pp} ranks do not split into "
                              f"{p.virtual_stages} equal chunks per rank")
        if cfg.microbatches < p.pp:
            raise ConfigError(f"parallel.microbatches: interleaved needs at least pp={p.pp} micro-batches per step "
                              f"(its groups of micro-batches go round the ring of ranks), got {cfg.microbatches}")
    if p.zero == 3 and p.schedule == "zb-h1" and p.dp > 1:
        raise ConfigError("parallel.zero: ZeRO-3 with zb-h1 is not supported: the deferred weight gradients (W) "
                          "would need every unit gathered again after its input gradient (B); use zero 0, 1 or 2 "
                          "with zb-h1, or another schedule with zero 3")
