"""What a split backward's B releases (parallel/pipeline/runtime.SavedForW), on one process: a
stage of two Llama blocks in fp32, the activation meter's hooks outside the runtime's."""
import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from threefold.config import ModelConfig
from threefold.models.llama import Llama
from threefold.parallel.pipeline.runtime import SavedForW, backward_input, backward_weight
from threefold.plan import costs
from threefold.train.metrics import ActivationMeter

CFG = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab_size=128, seq_len=32)
TOKENS = 2 * 32


def stage(recompute: str = "none"):
    torch.manual_seed(0)
    model = Llama(CFG)
    model.set_recompute(recompute)
    hidden = torch.randn(2, 32, 64, requires_grad=True)
    return model, hidden


def forward(model, hidden, meter, saves):
    positions = torch.arange(32)
    with meter.forward_pass(), saves.hooks():
        out = hidden
        for block in model.blocks:
            out = block(out, model.rope_cos, model.rope_sin, positions)
    return out


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_b_keeps_what_w_reads_and_w_still_makes_the_whole_backwards_gradients(recompute):
    """After B the meter holds exactly costs.weight_input_bytes for the two blocks (each norm's
    x·rsqrt and output, the inputs of wo and w_down), and W's weight gradients are the plain
    backward's to the bit; after W nothing is held."""
    model, hidden = stage(recompute)
    params = list(model.blocks.parameters())
    meter = ActivationMeter.for_module(model)
    out = forward(model, hidden, meter, saves := SavedForW())
    saved = meter.live
    grad = torch.randn_like(out)
    input_grad, groups = backward_input(get_gradient_edge(out), grad, hidden, saves)
    kept = costs.weight_input_bytes(CFG, TOKENS, 1, False, recompute, dtype_bytes=4)
    assert meter.live == 2 * kept < 0.5 * saved
    backward_weight(groups)
    split = [p.grad.clone() for p in params]
    del groups, out
    assert meter.live == 0

    model, hidden = stage(recompute)
    out = forward(model, hidden, ActivationMeter.for_module(model), SavedForW())
    out.backward(grad)
    assert torch.equal(hidden.grad, input_grad)
    for got, want in zip(split, model.blocks.parameters()):
        assert torch.equal(got, want.grad)


def test_under_full_recomputation_b_releases_nothing():
    """The products' saved tensors sit in each block's checkpoint, which W's unpacking recomputes
    from inputs saved through these hooks: B must keep them all, and W still works."""
    model, hidden = stage("full")
    params = list(model.blocks.parameters())
    meter = ActivationMeter.for_module(model)
    out = forward(model, hidden, meter, saves := SavedForW())
    saved = meter.live
    _, groups = backward_input(get_gradient_edge(out), torch.ones_like(out), hidden, saves)
    assert meter.live == saved > 0
    backward_weight(groups)
    assert all(p.grad is not None for p in params)
