"""The planner's cost model against independent counts: real modules, FLOP counters, published figures."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from threefold.config import ConfigError, ModelConfig
from threefold.models.llama import Llama
from threefold.models.presets import get_preset
from threefold.plan import costs


# ---- parameters and FLOPs ------------------------------------------------------------------

@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_llama_param_count_matches_the_module(tie, kv_heads):
    cfg = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=kv_heads, ffn=96, vocab_size=100, seq_len=16,
                      tie_embeddings=tie)
    assert costs.param_count(cfg) == sum(p.numel() for p in Llama(cfg).parameters())


def _gpt_module(layers, h, f, vocab, seq, tie):
    """A classic GPT in plain torch modules, only to count its parameters."""
    block = lambda: nn.ModuleList([nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h), nn.LayerNorm(h),
                                   nn.Linear(h, f), nn.Linear(f, h)])
    parts = [nn.Embedding(vocab, h), nn.Embedding(seq, h), *[block() for _ in range(layers)], nn.LayerNorm(h)]
    if not tie:
        parts.append(nn.Linear(h, vocab, bias=False))
    return nn.ModuleList(parts)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_param_count_matches_a_torch_gpt(tie):
    cfg = ModelConfig(arch="gpt", layers=3, hidden=48, heads=4, ffn=80, vocab_size=70, seq_len=20, tie_embeddings=tie)
    expected = sum(p.numel() for p in _gpt_module(3, 48, 80, 70, 20, tie).parameters())
    assert costs.param_count(cfg) == expected


def test_gpt3_param_count_is_the_published_174_6b():
    assert costs.param_count(get_preset("gpt3-175b")) / 1e9 == pytest.approx(174.6, abs=0.05)


def test_gpt3_model_flops_match_megatrons_72_formula():
    L, h, s, V = 96, 12288, 2048, 51200
    per_token = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))  # Narayanan et al. 2021, per token
    assert costs.model_flops_per_token(get_preset("gpt3-175b")) == pytest.approx(per_token, rel=2e-4)


def test_llama_matmul_flops_match_torchs_flop_counter():
    """Forward + backward of every linear layer, counted by torch; attention added by hand."""
    cfg = ModelConfig(layers=2, hidden=64, heads=8, kv_heads=2, ffn=96, vocab_size=100, seq_len=32,
                      tie_embeddings=False)
    model = Llama(cfg)
    tokens = torch.randint(0, 100, (2, 32))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    linear_flops = counter.get_total_flops() / tokens.numel()  # SDPA on CPU is not counted by torch
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert linear_flops == 6 * linear_weights
    norm_weights = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    attention = 12 * cfg.layers * cfg.seq_len * cfg.hidden
    assert costs.model_flops_per_token(cfg) == linear_flops + 6 * norm_weights + attention


def test_recompute_adds_a_forward():
    cfg = get_preset("gpt3-175b")
    model = costs.model_flops_per_token(cfg)
    full = costs.hardware_flops_per_token(cfg, "full")
    selective = costs.hardware_flops_per_token(cfg, "selective")
    L, h, s, V = 96, 12288, 2048, 51200
    megatron_hfu = 96 * L * h * h * (1 + s / (6 * h) + V / (16 * h * L))  # Megatron's full-recompute count
    assert full == pytest.approx(megatron_hfu, rel=2e-4)
    assert selective - model == pytest.approx(4 * L * s * h)
    assert costs.hardware_flops_per_token(cfg, "none") == model


def test_missing_vocab_is_a_config_error():
    with pytest.raises(ConfigError, match="vocab"):
        costs.param_count(ModelConfig(arch="gpt"))


# ---- exact data-parallel bytes and model states for the engine ----------------------------

@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_dp_bytes_per_step(dp):
    numel, m = 4_000_000, 3
    ring = (dp - 1) / dp
    assert costs.dp_bytes_per_step(numel, dp, 0, m) == 2 * ring * numel * 4
    for zero in (1, 2):
        assert costs.dp_bytes_per_step(numel, dp, zero, m) == ring * numel * 8
    assert costs.dp_bytes_per_step(numel, dp, 3, m) == m * ring * numel * 12
    assert costs.dp_bytes_per_step(numel, dp, 1, m, grad_bytes=2, param_bytes=2) == ring * numel * 4


def test_dp_bytes_is_zero_without_replicas():
    assert all(costs.dp_bytes_per_step(1000, 1, z, 4) == 0 for z in range(4))


def test_dp_bytes_vectorised_equals_scalar():
    dp, zero = np.array([1, 2, 4, 8, 8]), np.array([0, 1, 2, 3, 0])
    vector = costs.dp_bytes_per_step(1000, dp, zero, 2)
    assert list(vector) == [costs.dp_bytes_per_step(1000, int(d), int(z), 2) for d, z in zip(dp, zero)]


def test_model_state_bytes():
    numel = 4096
    assert costs.model_state_bytes(numel, 4, 0) == {"params": 16384, "grads": 16384, "optimizer": 32768}
    assert costs.model_state_bytes(numel, 4, 1) == {"params": 16384, "grads": 16384, "optimizer": 8192}
    assert costs.model_state_bytes(numel, 4, 2) == {"params": 16384, "grads": 4096, "optimizer": 8192}
    assert costs.model_state_bytes(numel, 4, 3) == {"params": 4096, "grads": 4096, "optimizer": 8192}
