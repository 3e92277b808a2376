"""The plain model: exact parameter count, learning, recomputation that changes nothing."""
import dataclasses

import pytest
import torch

from threefold.config import ModelConfig
from threefold.models.llama import Llama, count_parameters, cross_entropy
from threefold.models.presets import PRESETS, get_preset
from threefold.models.sizes import moe_parameter_counts

SMALL = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, vocab_size=128, seq_len=32)


@pytest.mark.parametrize("name", [n for n, c in PRESETS.items() if c.arch == "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_matches_module(name, tied):
    cfg = dataclasses.replace(get_preset(name), tie_embeddings=tied)
    if cfg.vocab_size is None:
        cfg.vocab_size = 4096
    with torch.device("meta"):
        model = Llama(cfg)
    # count_parameters counts the dense model; moe_parameter_counts the experts too (its total).
    assert moe_parameter_counts(cfg)[0] == sum(p.numel() for p in model.parameters())
    if not cfg.moe_experts:
        assert count_parameters(cfg) == moe_parameter_counts(cfg)[0]


def test_known_sizes():
    # Published sizes: Llama 3 8B has 8.03B parameters, SmolLM2-135M 134.5M.
    assert count_parameters(get_preset("llama3-8b")) == 8_030_261_248
    assert count_parameters(get_preset("smollm2-135m")) == 134_515_008


def test_init_is_deterministic_in_the_seed():
    a, b, c = Llama(SMALL), Llama(SMALL), Llama(SMALL)
    a.init_weights(3), b.init_weights(3), c.init_weights(4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if pa.dim() > 1:
            assert not torch.equal(pa, pc), name


def test_causal():
    model = Llama(SMALL)
    model.init_weights(0)
    tokens = torch.randint(0, 128, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 128
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-6)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-4)


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = Llama(SMALL)
    model.init_weights(0)
    tokens = torch.randint(0, 128, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, loss.item()


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_identical_gradients(mode):
    tokens = torch.randint(0, 128, (2, 33))
    grads = {}
    for m in ("none", mode):
        model = Llama(SMALL)
        model.init_weights(0)
        model.set_recompute(m)
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads[m] = [p.grad.clone() for p in model.parameters()]
    for g0, g1 in zip(grads["none"], grads[mode]):
        assert torch.allclose(g0, g1, rtol=1e-5, atol=1e-7)


def test_grouped_query_attention_equals_repeated_heads():
    """GQA with kv_heads=2 equals full multi-head attention whose k/v weights repeat each group."""
    gqa = Llama(SMALL)
    gqa.init_weights(1)
    mha = Llama(dataclasses.replace(SMALL, kv_heads=4))
    state = gqa.state_dict()
    d = SMALL.head_dim
    for key in list(state):
        if key.endswith(("wk.weight", "wv.weight")):
            state[key] = state[key].view(2, d, -1).repeat_interleave(2, dim=0).reshape(4 * d, -1)
    mha.load_state_dict(state)
    tokens = torch.randint(0, 128, (2, 16))
    assert torch.allclose(gqa(tokens), mha(tokens), atol=1e-5)


def test_tied_embeddings_share_storage():
    model = Llama(SMALL)
    assert model.head.weight is model.embed.weight
    untied = Llama(dataclasses.replace(SMALL, tie_embeddings=False))
    assert untied.head.weight is not untied.embed.weight
