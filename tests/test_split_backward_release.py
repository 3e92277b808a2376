"""What a split backward's B releases (parallel/pipeline/runtime.SavedForW), on one process: a
stage of two Llama blocks in fp32, the activation meter's hooks outside the runtime's; the order
W runs its groups in; and ZeRO-3's units around B and W, on dry-run ranks."""
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


def test_w_runs_its_groups_block_by_block_from_the_last():
    """W's groups come in the order a whole backward runs them: every group of the second block
    before any of the first, so a block's gradients (its bucket, its ZeRO-3 unit) are complete
    before the next block's begin. A breadth-first walk from the output reaches both blocks
    early through the residual stream and mixes them."""
    model, hidden = stage()
    out = forward(model, hidden, ActivationMeter.for_module(model), saves := SavedForW())
    _, groups = backward_input(get_gradient_edge(out), torch.ones_like(out), hidden, saves)
    block_of = {id(p): i for i, block in enumerate(model.blocks) for p in block.parameters()}
    order = [block_of[id(p)] for group in groups for p in group.params]
    assert sorted(order, reverse=True) == order and set(order) == {0, 1}


def test_zero3_units_are_freed_as_b_goes_past_them_and_w_gathers_none():
    """ZeRO-3 under ZB-H1 (parallel/fsdp.py), one dry-run rank of each end of dp2 × pp2: while B
    runs at most two units are gathered (the one B is in and the one before it, whose gather B
    started), after B none, and W gathers none."""
    from threefold.configure import load_config
    from threefold.parallel import fsdp
    from threefold.parallel.pipeline import runtime
    from threefold.train.dryrun import dry_run_config, dry_run_rank

    cfg = dry_run_config(load_config(None, ["model.preset=tiny", "model.layers=6", "model.vocab_size=256",
                                            "model.seq_len=64", "train.global_batch=8", "train.micro_batch=2",
                                            "parallel.dp=2", "parallel.pp=2", "parallel.zero=3",
                                            "parallel.schedule=zb-h1", "parallel.reshard_after_forward=true"]), 4)
    units, during_b, after = [], [], {}
    unit_init, pre_backward, execute = fsdp.ShardedUnit.__init__, fsdp.ShardedGradSync._pre_backward, \
        runtime.PipelineRuntime._execute

    def record_unit(self, *args, **kwargs):
        unit_init(self, *args, **kwargs)
        units.append(self)

    def record_b(self, *args):
        pre_backward(self, *args)
        during_b.append(sum(u.gathered for u in units))

    def record_action(self, index, action):
        execute(self, index, action)
        if action.kind in (runtime.Kind.BACKWARD, runtime.Kind.WEIGHT_GRAD):
            after.setdefault(action.kind, []).append(sum(u.gathered for u in units))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fsdp.ShardedUnit, "__init__", record_unit)
        patch.setattr(fsdp.ShardedGradSync, "_pre_backward", record_b)
        patch.setattr(runtime.PipelineRuntime, "_execute", record_action)
        for rank in (0, 3):
            units.clear()
            dry_run_rank(cfg, rank)
            assert len(units) > 3  # the stage's blocks and its root
    assert during_b and max(during_b) == 2
    assert after[runtime.Kind.BACKWARD] and not any(after[runtime.Kind.BACKWARD])
    assert after[runtime.Kind.WEIGHT_GRAD] and not any(after[runtime.Kind.WEIGHT_GRAD])
