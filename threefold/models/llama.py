"""A Llama-style decoder on one device: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, optional tied embeddings. No parallel code lives here; the strategies in
``threefold/parallel/`` transform this module.

Names of the sub-modules are part of the contract with the strategies (the tensor-parallel
plan maps them to styles) and with checkpoint export:
``embed``, ``blocks.{i}.attn_norm``, ``blocks.{i}.attn.{wq,wk,wv,wo}``, ``blocks.{i}.mlp_norm``,
``blocks.{i}.mlp.{w_gate,w_up,w_down}``, ``norm``, ``head``; an MoE layer's ``blocks.{i}.mlp`` holds
``router``, ``experts.{w_gate,w_up,w_down}`` (stacked), ``shared`` and ``expert_bias`` (models/moe.py).

Two seams let a strategy replace a part without this file knowing of it:
``blocks.{i}.attn.core`` is the attention core (``AttentionCore``: q, k, v and the tokens'
positions in → the attended values out; context parallelism swaps in one that attends over a
sequence split across ranks), and each block's feed-forward comes from ``make_mlp(cfg, layer)``
(a Mixture-of-Experts block replaces it per layer). The forward takes the tokens' positions,
0..s−1 by default, so a rank that holds other parts of the sequence rotates them correctly.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from threefold.config import ModelConfig
from threefold.models.moe import MoE, step_statistics
from threefold.models.sizes import count_parameters, is_moe_layer  # noqa: F401  (re-exported: sizes need no torch)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_dim) for the rotate-half convention."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of the last dimension; x is (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q kᵀ/√d) v; q is (b, h, s, d), k and v (b, h_kv, t, d) with h_kv dividing h.

    The queries are the last s of the t positions (t > s when generating with a KVCache).
    This is what selective recomputation recomputes: its inputs are kept, its inner
    activations are not (scaled_dot_product_attention never stores the s×s scores anyway).
    """
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
    s, t = q.shape[2], k.shape[2]
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # is_causal aligns the mask top-left; query i sits at position t - s + i, so it sees keys up to there
    visible = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


class KVCache:
    """The keys and values of every position generated so far, one entry per block, so that each
    new token costs one position's work instead of the whole context's."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values (b, h_kv, s, d); return all of them so far."""
        if self.keys[layer] is not None:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class AttentionCore(nn.Module):
    """The seam for context parallelism: causal attention of q over k, v for tokens at
    ``positions`` (s,). Here every token of the sequence is present, in order, so causality is
    plain ``is_causal``; a context-parallel core receives a rank's part of the sequence.

    This is what selective recomputation recomputes (``recompute``): its inputs are kept, its
    inner activations are not (scaled_dot_product_attention never stores the s×s scores anyway).
    """

    def __init__(self):
        super().__init__()
        self.recompute = False  # selective recomputation, set by Llama.set_recompute

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | range
                ) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(attention_core, q, k, v, use_reentrant=False)
        return attention_core(q, k, v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: tuple[KVCache, int] | None = None) -> torch.Tensor:
        """``cache``: (the KVCache, this block's index) when generating; cos, sin and positions
        are then those of the new tokens."""
        b, s, _ = x.shape
        # Head counts come from the weights, so a strategy that slices heads needs no other change.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)
        out = self.core(q, k, v, positions)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.ffn_hidden
        self.w_gate = nn.Linear(cfg.hidden, width, bias=False)
        self.w_up = nn.Linear(cfg.hidden, width, bias=False)
        self.w_down = nn.Linear(width, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def initial_value(cfg: ModelConfig, name: str, shape, seed: int) -> torch.Tensor:
    """The initial value of the full parameter ``name`` (a plain-model key) of shape ``shape``:
    norm gains 1; everything else Normal(0, 0.02), the projections that write into the residual
    stream (wo, w_down, the experts' w_down) scaled by 1/√(2·layers), as GPT-2 and Megatron do.

    Each parameter has its own generator, seeded by the run's seed and the parameter's name, so
    a rank that holds a few tensors (a pipeline stage, a tp shard cut from the full tensor) draws
    exactly the values every other layout draws for them, without generating the rest."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    residual = name.endswith(("wo.weight", "w_down.weight", "experts.w_down"))
    std = 0.02 / math.sqrt(2 * cfg.layers) if residual else 0.02
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)
    return torch.randn(tuple(shape), generator=generator).mul_(std)  # in place: one full tensor at a time


def make_mlp(cfg: ModelConfig, layer: int) -> nn.Module:
    """The feed-forward block of layer ``layer``: the seam where experts replace the dense MLP."""
    if not is_moe_layer(cfg, layer):
        return SwiGLU(cfg)
    shared = SwiGLU(cfg, cfg.moe_shared_experts * cfg.moe_ffn_hidden) if cfg.moe_shared_experts else None
    return MoE(cfg, shared)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = make_mlp(cfg, layer)
        self.recompute = False  # full recomputation of this block, set by Llama.set_recompute

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 cache=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, cache)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache=None) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return checkpoint(self._forward, x, cos, sin, positions, use_reentrant=False)
        return self._forward(x, cos, sin, positions, cache)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.arch != "llama":
            raise ValueError(f"model.arch={cfg.arch!r}: the engine trains 'llama' blocks; 'gpt' is for the planner")
        if cfg.vocab_size is None:
            raise ValueError("model.vocab_size is not set (the trainer takes it from the tokenizer)")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg, layer) for layer in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.moe_last_step: dict | None = None  # the statistics end_moe_step recorded

    @classmethod
    @torch.no_grad()
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> "Llama":
        """``Llama(cfg)`` holding ``state`` (checked as strictly as ``load_state_dict``), without
        drawing the random values the state replaces (SmolLM2-135M's took 2-3 s): built on the meta
        device, given the state's tensors (in the parameters' dtypes), and the buffers the state
        does not hold made as ``__init__`` makes them, on the state's device."""
        with torch.device("meta"):
            model = cls(cfg)
        dtypes = {key: tensor.dtype for key, tensor in model.state_dict().items()}
        model.load_state_dict({key: value.to(dtypes[key]) if key in dtypes else value  # an unknown key: refused
                               for key, value in state.items()}, assign=True)
        if cfg.tie_embeddings:
            model.head.weight = model.embed.weight  # assign gave each end a Parameter of its own
        device = model.embed.weight.device
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:  # the MoE step counters: zeros, as __init__ makes them
                    module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)
        cos, sin = rotary_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
        return model

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter drawn as ``initial_value`` draws it (its own generator, seeded by the
        run's seed and its name). Deterministic in the seed, whatever holds the tensor."""
        for name, p in self.named_parameters():
            p.copy_(initial_value(self.cfg, name, p.shape, seed))
        self._refresh_rope()

    def _refresh_rope(self) -> None:
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)

    def set_recompute(self, mode: str) -> None:
        """none | selective (the attention core of every block) | full (every block)."""
        for block in self.blocks:
            block.recompute = mode == "full"
            block.attn.core.recompute = mode == "selective"

    # --- Mixture-of-Experts: the step's routing counters and what happens after the optimizer step
    def moe_layers(self) -> list[MoE]:
        """This model's MoE blocks, in layer order (a pipeline stage's: those it holds)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def set_moe_loss_scale(self, scale: float) -> None:
        """The factor the engine puts on each micro-batch's loss (1/micro-batches): the aux loss
        gets the same, so its gradient sums like the loss's."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = scale

    def moe_token_counts(self) -> torch.Tensor | None:
        """(MoE layers, E) int64: tokens routed to each expert over this step's micro-batches
        (this process's); None for a dense model."""
        layers = self.moe_layers()
        return torch.stack([layer.step_tokens for layer in layers]) if layers else None

    def end_moe_step(self, counts: torch.Tensor, update_bias: bool = True) -> None:
        """Call after the optimizer step with ``moe_token_counts()`` (summed over the ranks that
        share the weights, where there are several): each layer's bias takes its step (when
        ``moe_bias_rate``), the step's statistics go to ``moe_last_step``, the counters restart."""
        layers = self.moe_layers()
        self.moe_last_step = step_statistics(layers, counts)
        for layer, layer_counts in zip(layers, counts):
            layer.end_step(layer_counts, update_bias)

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor | range, blocks=None,
                   cache: KVCache | None = None) -> torch.Tensor:
        """The block loop, over ``blocks`` (default: all of them; a pipeline stage passes its
        own), for hidden states ``x`` of the tokens at ``positions``; ``cache`` when generating.

        ``positions`` is a ``range`` when the tokens are a contiguous run of the sequence (the
        rotary tables are then views of the buffers: nothing new is saved for backward), or a
        tensor of positions (context parallelism's zigzag), gathered from the tables."""
        if isinstance(positions, range):
            cos, sin = self.rope_cos[positions.start:positions.stop], self.rope_sin[positions.start:positions.stop]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        for i, block in enumerate(self.blocks if blocks is None else blocks):
            x = block(x, cos, sin, positions, None if cache is None else (cache, i))
        return x

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                      cache: KVCache | None = None) -> torch.Tensor:
        """With a ``cache``, ``tokens`` are the positions after those it holds, and it grows by them."""
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = range(start, start + tokens.shape[1])
        return self.norm(self.run_blocks(self.embed(tokens), positions, cache=cache))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """tokens (batch, seq) → logits (batch, seq, vocab); ``positions`` (seq,) of the tokens
        in their sequence, 0..seq−1 unless a strategy holds another part of it (or a cache holds
        the earlier ones)."""
        return self.head(self.hidden_states(tokens, positions, cache))

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, generator: torch.Generator | None = None, eos_id: int | None = None,
                 use_cache: bool = True, top_p: float = 1.0) -> torch.Tensor:
        """Sample up to ``new_tokens`` continuations of ``tokens`` (batch, seq), one at a time;
        stop early once every row has produced ``eos_id`` (kept as its last token).

        ``temperature`` 0 is greedy decoding: each step takes the most likely token (the first,
        on a tie), and ``top_k``, ``top_p`` and ``generator`` play no part. Otherwise the logits
        are divided by ``temperature``, cut to the ``top_k`` most likely tokens (0 or None: all)
        and then to the smallest set whose probability reaches ``top_p`` (1: all), as transformers'
        warpers do, in that order.

        With ``use_cache`` each step feeds only the new token and reuses the keys and values of
        the earlier ones; once the context outgrows ``seq_len``, the window slides and is computed
        afresh each step, exactly as without the cache."""
        cache, fed = None, 0  # fed: how many of ``tokens`` the cache holds
        done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        for _ in range(new_tokens):
            if not use_cache or tokens.shape[1] > self.cfg.seq_len:
                logits = self(tokens[:, -self.cfg.seq_len:])
            else:
                if cache is None:
                    cache = KVCache(len(self.blocks))
                logits = self(tokens[:, fed:], cache=cache)
                fed = tokens.shape[1]
            logits = logits[:, -1, :].float()
            if temperature == 0:
                chosen = logits.argmax(dim=-1, keepdim=True)
            else:
                chosen = torch.multinomial(sampling_probs(logits / temperature, top_k, top_p), 1, generator=generator)
            tokens = torch.cat([tokens, chosen], dim=1)
            if eos_id is not None:
                done |= tokens[:, -1] == eos_id
                if bool(done.all()):
                    break
        return tokens


def sampling_probs(logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
    """Softmax of (batch, vocab) ``logits`` over the ``top_k`` most likely tokens (0 or None: all;
    ties at the k-th are kept), then over the smallest set of the most likely whose probability
    reaches ``top_p`` (the most likely one always stays)."""
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the probability of the tokens more likely than each
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)  # back in vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every token of the batch, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
