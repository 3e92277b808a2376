"""Mixture-of-Experts on one process: the block against per-expert and per-token references,
the drop rule, the balance loss and bias, the seam in every preset, metrics, Mixtral interop."""
import dataclasses
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from test_train import config, corpus  # noqa: F401  (the 40 kB corpus fixture)
from threefold.config import Config, ConfigError, ModelConfig
from threefold.configure import load_config
from threefold.models import moe
from threefold.models.llama import Llama, cross_entropy
from threefold.models.presets import PRESETS, get_preset
from threefold.models.sizes import is_moe_layer, moe_parameter_counts
from threefold.train.engine import Engine

CFG = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, vocab_size=64, seq_len=16, moe_experts=4,
                  moe_top_k=2, moe_ffn=24)


def model(seed: int = 0, **changes) -> Llama:
    cfg = dataclasses.replace(CFG, **changes)
    cfg.validate()
    m = Llama(cfg)
    m.init_weights(seed)
    return m


def tokens(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, CFG.seq_len), generator=torch.Generator().manual_seed(seed))


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in m.named_parameters()}


# --- the experts: grouped products against the loop -------------------------------------------


@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 16, 0], [0, 0, 0, 0]])
def test_grouped_products_equal_the_per_expert_loop_forward_and_backward(counts):
    gen = torch.Generator().manual_seed(0)
    experts = moe.GroupedExperts(4, 32, 24)
    for p in experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(sum(counts), 32, generator=gen, requires_grad=True)
    counts = torch.tensor(counts)
    results = {}
    for grouped in (True, False):
        experts.grouped = grouped
        experts.zero_grad()
        x.grad = None
        y = experts(x, counts)
        y.sum().backward()  # an expanded upstream gradient, the case the grouped backward needs made contiguous
        results[grouped] = (y.detach(), x.grad.clone(), [p.grad.clone() for p in experts.parameters()])
    (y_g, dx_g, dw_g), (y_l, dx_l, dw_l) = results[True], results[False]
    assert moe.grouped_mm_fits(x, 24)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-5)
    for g, ref in zip(dw_g, dw_l):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)
    for e in (e for e, c in enumerate(counts.tolist()) if c == 0):  # an idle expert: zero, not absent
        assert all(torch.equal(g[e], torch.zeros_like(g[e])) for g in dw_g)


def test_widths_the_grouped_kernel_refuses_fall_back_to_the_loop():
    x = torch.randn(6, 30)  # 30 fp32 = 120 bytes a row: not a multiple of 16
    experts = moe.GroupedExperts(2, 30, 8)
    torch.nn.init.normal_(experts.w_gate), torch.nn.init.normal_(experts.w_up), torch.nn.init.normal_(experts.w_down)
    assert not moe.grouped_mm_fits(x, 8)
    counts = torch.tensor([4, 2])
    expected = moe.looped_swiglu(x, counts, experts.w_gate, experts.w_up, experts.w_down)
    torch.testing.assert_close(experts(x, counts), expected)


def reference_moe(block: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """The block written token by token from the docstring's rules: top-k of score + bias,
    weights renormalised, capacity served first choices first, tokens in order."""
    tokens = x.reshape(-1, x.shape[-1])
    scores = moe.router_scores(tokens, block.router.weight, block.router_kind)
    biased = scores + block.expert_bias if block.bias_rate else scores
    capacity = (math.ceil(block.capacity_factor * len(tokens) * block.top_k / block.num_experts)
                if block.capacity_factor else len(tokens) * block.top_k)
    choice = biased.topk(block.top_k, dim=-1).indices
    taken, keep = [0] * block.num_experts, torch.zeros_like(choice, dtype=torch.bool)
    for j in range(block.top_k):
        for t in range(len(tokens)):
            e = choice[t, j].item()
            if taken[e] < capacity:
                taken[e] += 1
                keep[t, j] = True
    ex = block.experts
    rows = []
    for t, token in enumerate(tokens):
        weights = scores[t, choice[t]]
        weights = weights / weights.sum() if block.renormalize else weights
        out = torch.zeros_like(token)
        for j, e in enumerate(choice[t].tolist()):
            if keep[t, j]:
                out = out + weights[j] * F.linear(F.silu(F.linear(token, ex.w_gate[e])) * F.linear(token, ex.w_up[e]),
                                                  ex.w_down[e])
        rows.append(out + (block.shared(token) if block.shared is not None else 0))
    return torch.stack(rows).view(x.shape)


@pytest.mark.parametrize("changes", [
    {},
    {"moe_capacity_factor": 0.5},
    {"moe_capacity_factor": 1.0, "moe_top_k": 1, "moe_renormalize": False},
    {"moe_router": "sigmoid", "moe_shared_experts": 1, "moe_bias_rate": 0.01},
])
def test_the_block_equals_a_token_by_token_reference(changes):
    block = model(**changes).blocks[0].mlp
    if block.bias_rate:
        block.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(2, 16, CFG.hidden, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(block(x), reference_moe(block, x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_are_what_the_rule_says():
    # 4 tokens, 2 choices, 3 experts, capacity 2. First choices in token order: 0, 0, 0, 1 →
    # expert 0 takes tokens 0 and 1, drops token 2's; then second choices: 1, 2, 1, 2 → expert 1
    # already holds token 3's first choice, takes token 0's, drops token 2's; expert 2 takes both.
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 2]])
    assert moe.expert_capacity(4, 2, 3, 0.75) == 2
    kept = moe.capacity_keep(experts, 3, 2)
    assert kept.tolist() == [[True, True], [True, True], [False, False], [True, True]]
    assert moe.capacity_keep(experts, 3, None).all()  # factor 0: dropless
    # The block drops exactly those: the dropped assignments' rows never reach an expert.
    routing = moe.Routing(torch.rand(4, 3), experts, torch.full((4, 2), 0.5), kept)
    x_perm, counts, order = moe.permute(torch.arange(4.0).unsqueeze(1).expand(4, 16), routing)
    assert counts.tolist() == [2, 2, 2]
    assert x_perm[:, 0].tolist() == [0, 1, 0, 3, 1, 3]  # expert 0: tokens 0, 1; expert 1: 0, 3; expert 2: 1, 3


def test_the_aux_loss_equals_its_formula():
    scores = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    # Both tokens chose expert 0: f = (1, 0), P = (0.625, 0.375) → 2 · 0.625.
    assert moe.load_balancing_loss(scores, torch.tensor([[0], [0]])).item() == pytest.approx(1.25)
    uniform = torch.full((8, 4), 0.25)
    assert moe.load_balancing_loss(uniform, torch.arange(16).view(8, 2) % 4).item() == pytest.approx(1.0)
    # Sigmoid affinities are normalised per token first.
    sig = torch.tensor([[0.9, 0.3], [0.6, 0.2]])
    assert moe.load_balancing_loss(sig, torch.tensor([[1], [0]]), "sigmoid").item() == pytest.approx(
        2 * 0.5 * (0.75 + 0.25))


def test_the_router_z_loss_equals_its_formula():
    # logsumexp of (0, 0) is ln 2, of (ln 3, 0) ln 4 = 2 ln 2: the mean of their squares is 2.5 (ln 2)².
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert moe.router_z_loss(logits).item() == pytest.approx(2.5 * math.log(2.0) ** 2)


@pytest.mark.parametrize("coef, z_coef", [(0.3, 0.0), (0.0, 0.2), (0.3, 0.2)])
def test_the_aux_loss_gradient_is_the_scaled_loss_added_to_the_objective(coef, z_coef):
    """Attached by the autograd function (train mode) = added to the loss by hand (eval mode,
    same weights, the router's inputs caught by hooks): the balance loss, the router z-loss, both."""
    scale = 0.25
    m = model(moe_aux_loss_coef=coef, moe_router_z_loss_coef=z_coef)
    x = tokens()
    m.train()
    m.set_moe_loss_scale(scale)
    cross_entropy(m(x), x).backward()
    attached = grads(m)
    m.end_moe_step(m.moe_token_counts())
    recorded = m.moe_last_step["aux_loss"]

    m.zero_grad()
    m.eval()
    inputs = layer_inputs(m, x)  # a forward of its own: the sum of both graphs' gradients is the objective's
    loss = cross_entropy(m(x), x)
    routings = [layer.route(h) for layer, h in zip(m.moe_layers(), inputs)]
    aux = sum(coef * moe.load_balancing_loss(r.scores, r.experts) + z_coef * moe.router_z_loss(r.logits)
              for r in routings)
    (loss + scale * aux).backward()
    assert recorded == pytest.approx(aux.item(), rel=1e-5)
    for name, g in grads(m).items():
        torch.testing.assert_close(attached[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert attached["blocks.0.mlp.router.weight"].abs().sum() > 0


def test_counts_are_summed_over_the_steps_micro_batches_and_recompute_does_not_count_twice():
    x = tokens(batch=4)
    expected = None
    for recompute in ("none", "full"):
        m = model(moe_bias_rate=0.1)
        m.set_recompute(recompute)
        engine = Engine(m, Config(model=m.cfg))
        m.set_moe_loss_scale(0.5)
        engine.forward_backward([(x[:2], x[:2]), (x[2:], x[2:])])
        counts = m.moe_token_counts()
        assert counts.sum(1).tolist() == [4 * 16 * 2] * 2  # every token's two choices, both micro-batches
        with torch.no_grad():
            m.eval()
            per_micro = sum(torch.stack([torch.bincount(layer.route(h).experts.reshape(-1), minlength=4)
                                         for layer, h in zip(m.moe_layers(), layer_inputs(m, part))])
                            for part in (x[:2], x[2:]))
            m.train()
        assert torch.equal(counts, per_micro)
        expected = counts if expected is None else expected
        assert torch.equal(counts, expected)
        engine.forward_backward([(x[:2], x[:2])])  # evaluation adds nothing; another micro-batch does
        engine.eval_loss([(x, x)])
        assert m.moe_token_counts().sum().item() == counts.sum().item() + 2 * 16 * 2 * 2


def layer_inputs(m: Llama, x: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's input tokens (T, h) for the batch ``x``."""
    caught = []
    hooks = [layer.register_forward_pre_hook(lambda mod, args: caught.append(args[0].reshape(-1, args[0].shape[-1])))
             for layer in m.moe_layers()]
    m(x)
    for hook in hooks:
        hook.remove()
    return caught


def test_the_bias_steps_once_per_step_toward_balance_and_moves_only_the_choice():
    m = model(moe_bias_rate=0.1)
    counts = torch.tensor([[10, 30, 20, 20], [5, 5, 5, 45]])
    m.end_moe_step(counts)
    assert m.blocks[0].mlp.expert_bias.tolist() == pytest.approx([0.1, -0.1, 0.0, 0.0])
    assert m.blocks[1].mlp.expert_bias.tolist() == pytest.approx([0.1, 0.1, 0.1, -0.1])
    m.end_moe_step(counts, update_bias=False)  # a skipped step leaves it
    assert m.blocks[0].mlp.expert_bias.tolist() == pytest.approx([0.1, -0.1, 0.0, 0.0])
    assert m.moe_last_step["tokens_per_expert"] == {"min": 5.0, "mean": 17.5, "max": 45.0}
    assert m.moe_last_step["max_over_mean"] == pytest.approx(45 / 15)
    assert "blocks.0.mlp.expert_bias" in m.state_dict()  # model state, not a parameter
    assert "blocks.0.mlp.expert_bias" not in dict(m.named_parameters())
    # A large bias decides the choice; the weights stay the unbiased scores.
    scores = torch.tensor([[0.5, 0.3, 0.2]])
    experts, weights = moe.select_experts(scores, 1, torch.tensor([0.0, 0.0, 1.0]), renormalize=False)
    assert experts.tolist() == [[2]] and weights.tolist() == [[pytest.approx(0.2)]]


def test_the_expert_learning_rate_scale_multiplies_the_routed_experts_step_only():
    """One AdamW step from the same weights and batch: with moe_expert_lr_scale = 3 every routed
    expert tensor moves 3 times as far (Adam's step and the decoupled decay are both ∝ lr), and
    everything else (router, shared experts, attention) exactly as with scale 1."""
    x = tokens(batch=4)
    moved = {}
    for scale in (1.0, 3.0):
        m = model(moe_shared_experts=1, moe_expert_lr_scale=scale)
        before = {name: p.detach().clone() for name, p in m.named_parameters()}
        engine = Engine(m, Config(model=m.cfg))
        engine.forward_backward([(x, x)])
        engine.optimizer_step(1e-3)
        moved[scale] = {name: p.detach() - before[name] for name, p in m.named_parameters()}
    for name, step in moved[1.0].items():
        expected = 3 * step if ".experts." in name else step
        torch.testing.assert_close(moved[3.0][name], expected, rtol=1e-5, atol=5e-8, msg=name)  # fp32 rounding
    assert sum(".experts." in name for name in moved[1.0]) == 6 and moved[1.0]["blocks.0.mlp.experts.w_up"].abs().sum() > 0


def test_an_expert_that_receives_no_tokens_gets_a_zero_gradient_not_none():
    m = model(moe_bias_rate=0.01)
    for layer in m.moe_layers():
        layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -10.0]))  # expert 3 is never chosen
    x = tokens()
    cross_entropy(m(x), x).backward()
    assert m.moe_token_counts()[:, 3].tolist() == [0, 0]
    for name in ("w_gate", "w_up", "w_down"):
        g = getattr(m.blocks[0].mlp.experts, name).grad
        assert g is not None and torch.equal(g[3], torch.zeros_like(g[3]))
        assert g[:3].abs().sum() > 0


def test_the_block_under_bf16_autocast():
    m = model()
    x = tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = cross_entropy(m(x), x)
    loss.backward()
    reference = cross_entropy(model()(x), x)
    assert abs(loss.item() - reference.item()) < 0.05
    assert m.blocks[0].mlp.experts.w_gate.grad.dtype == torch.float32


# --- the seam, presets and sizes --------------------------------------------------------------


def test_layer_pattern_first_dense_and_every():
    cfg = dataclasses.replace(CFG, layers=7, moe_first_dense=2, moe_every=2)
    assert [is_moe_layer(cfg, i) for i in range(7)] == [False, False, True, False, True, False, True]
    m = Llama(cfg)
    assert [type(b.mlp).__name__ for b in m.blocks] == ["SwiGLU", "SwiGLU", "MoE", "SwiGLU", "MoE", "SwiGLU", "MoE"]
    assert [type(b.mlp).__name__ for b in Llama(dataclasses.replace(CFG, moe_experts=0, moe_top_k=None,
                                                                      moe_ffn=None)).blocks] == ["SwiGLU"] * 2


@pytest.mark.parametrize("changes", [{}, {"moe_shared_experts": 2, "moe_first_dense": 1}, {"moe_experts": 0,
                                                                                          "moe_top_k": None,
                                                                                          "moe_ffn": None}])
def test_parameter_counts_are_exact(changes):
    m = model(**changes)
    total, active = moe_parameter_counts(m.cfg)
    assert total == sum(p.numel() for p in m.parameters())
    cfg = m.cfg
    per_expert = 3 * cfg.hidden * cfg.moe_ffn_hidden
    inactive = sum((cfg.moe_experts - cfg.moe_top_k_experts) * per_expert for i in range(cfg.layers)
                   if is_moe_layer(cfg, i))
    assert active == total - inactive


def test_published_moe_sizes():
    billions = {name: tuple(round(n / 1e9, 1) for n in moe_parameter_counts(PRESETS[name]))
                for name in ("mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "deepseek-v3-like")}
    assert billions["mixtral-8x7b"] == (46.7, 12.9)  # Mistral AI's figures
    assert billions["mixtral-8x22b"] == (140.6, 39.2)
    assert billions["qwen3-30b-a3b"] == (30.1, 2.9)  # 30.5/3.3 with Qwen3's wider attention (presets.py)
    assert billions["deepseek-v3-like"] == (672.1, 38.7)  # 671/37 with multi-latent attention
    tiny, tiny_moe = (dataclasses.replace(get_preset(n), vocab_size=4096) for n in ("tiny", "tiny-moe"))
    assert moe_parameter_counts(tiny_moe)[1] - moe_parameter_counts(tiny)[1] == 4 * 8 * 256  # only the routers


@pytest.mark.parametrize("preset", ["tiny", "small", "smollm2-135m"])
def test_any_dense_preset_becomes_moe_with_moe_experts(preset):
    cfg = load_config(None, [f"model.preset={preset}", "model.moe_experts=4", "model.moe_top_k=1",
                             "model.layers=2", "model.vocab_size=64", "model.seq_len=16"]).model
    m = Llama(cfg)
    m.init_weights(0)
    assert all(isinstance(b.mlp, moe.MoE) for b in m.blocks)
    assert m.blocks[0].mlp.experts.w_gate.shape == (4, get_preset(preset).ffn_hidden, cfg.hidden)
    x = tokens()
    cross_entropy(m(x), x).backward()
    assert m.blocks[0].mlp.router.weight.grad is not None
    assert moe_parameter_counts(cfg)[0] == sum(p.numel() for p in m.parameters())
    big = load_config(None, ["model.preset=llama3-8b", "model.moe_experts=8", "model.moe_top_k=2"]).model
    assert moe_parameter_counts(big)[1] < moe_parameter_counts(big)[0]


@pytest.mark.parametrize("overrides, needle", [
    (["model.moe_experts=4", "model.moe_top_k=5"], "model.moe_top_k: must be between 1 and model.moe_experts=4"),
    (["model.moe_experts=4", "model.moe_top_k=0"], "model.moe_top_k: must be between 1"),
    (["model.moe_experts=4", "model.moe_capacity_factor=-1"], "model.moe_capacity_factor: must not be negative"),
    (["model.moe_top_k=2"], "model.moe_top_k: set without model.moe_experts"),
    (["model.moe_ffn=128"], "model.moe_ffn: set without model.moe_experts"),
    (["model.moe_shared_experts=1"], "model.moe_shared_experts: set without model.moe_experts"),
    (["model.moe_experts=-2"], "model.moe_experts: must not be negative"),
    (["model.moe_experts=4", "model.moe_router=hash"], "model.moe_router: must be 'softmax' or 'sigmoid'"),
    (["model.moe_experts=4", "model.moe_first_dense=4"], "model.moe_first_dense: 4 leaves no MoE layer"),
    (["model.moe_experts=4", "model.moe_every=0"], "moe_every"),
    (["model.moe_experts=4", "model.moe_aux_loss_coef=-0.1"], "model.moe_aux_loss_coef: must not be negative"),
    (["model.moe_experts=4", "model.moe_bias_rate=-1"], "model.moe_bias_rate: must not be negative"),
    (["model.moe_experts=4", "model.moe_router_z_loss_coef=-0.001"], "model.moe_router_z_loss_coef: must not be negative"),
    (["model.moe_experts=4", "model.moe_expert_lr_scale=0"], "model.moe_expert_lr_scale: must be positive"),
    (["model.moe_expert_lr_scale=2"], "model.moe_expert_lr_scale: set without model.moe_experts"),
])
def test_bad_moe_config_is_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.preset=tiny", *overrides])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_moe_config_exits_2_from_the_cli(capsys):
    from threefold.cli import main

    assert main(["train", "--set", "model.preset=tiny", "--set", "model.moe_experts=4",
                 "--set", "model.moe_top_k=9"]) == 2
    assert capsys.readouterr().err.strip() == ("error: model.moe_top_k: must be between 1 and model.moe_experts=4, "
                                               "got 9")


# --- the trainer: the bias step and the metrics -----------------------------------------------


def test_training_writes_moe_metrics_and_steps_the_bias(tmp_path, corpus):  # noqa: F811
    from threefold.train.trainer import train

    metrics = tmp_path / "m.jsonl"
    cfg = config(tmp_path, corpus, "train.steps=3", "model.moe_experts=4", "model.moe_top_k=2", "model.moe_ffn=48",
                 "model.moe_capacity_factor=1.0", "model.moe_bias_rate=0.01")
    train(cfg, str(metrics), progress=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    routed = 2 * cfg.train.global_batch * cfg.model.seq_len * 2  # layers × tokens × top-k
    for r in records:
        m = r["moe"]
        per_expert = m["tokens_per_expert"]
        assert per_expert["mean"] * 4 * 2 == pytest.approx(routed)
        assert per_expert["min"] <= per_expert["mean"] <= per_expert["max"]
        assert 0 <= m["dropped"] < routed and m["aux_loss"] > 0


# --- Hugging Face's Mixtral format -------------------------------------------------------------


@pytest.fixture(scope="module")
def transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


def mixtral_config(vocab_size: int) -> ModelConfig:
    return ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=48, vocab_size=vocab_size, seq_len=32,
                       tie_embeddings=False, rope_theta=50000.0, moe_experts=4, moe_top_k=2)


def test_mixtral_export_gives_transformers_our_logits_and_imports_back(tmp_path, transformers):
    from test_interop import max_logit_difference, save_checkpoint, tokens_for

    from threefold.data.tokenizer import train_bpe
    from threefold.interop.commands import export_checkpoint, import_model
    from threefold.train import checkpoint

    tokenizer = train_bpe(iter(["To be, or not to be, that is the question."] * 40), 300)
    cfg = mixtral_config(tokenizer.vocab_size)
    model, _ = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    assert export_checkpoint(tmp_path / "run", tmp_path / "hf") == cfg
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert theirs.config.num_local_experts == 4 and theirs.config.num_experts_per_tok == 2
    difference = max_logit_difference(model.eval(), theirs, tokens_for(cfg.vocab_size))
    assert difference <= 1e-4, difference

    import_model(tmp_path / "hf", tmp_path / "back")
    read_cfg, imported = checkpoint.read_model(tmp_path / "back")
    assert read_cfg == cfg
    original = model.state_dict()
    assert original.keys() == imported.keys()
    assert all(torch.equal(original[name], imported[name]) for name in original)


def test_a_mixtral_transformers_wrote_gives_us_its_logits(tmp_path, transformers):
    from test_interop import max_logit_difference, randomize, tokens_for

    from threefold.interop import load_hf_weights

    config = transformers.MixtralConfig(vocab_size=120, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=6, num_experts_per_tok=3, rope_theta=20000.0)
    theirs = transformers.MixtralForCausalLM(config).eval()
    randomize(theirs, seed=1)
    theirs.save_pretrained(tmp_path / "hf")
    cfg, state = load_hf_weights(tmp_path / "hf")
    assert (cfg.moe_experts, cfg.moe_top_k, cfg.moe_ffn_hidden) == (6, 3, 80)
    ours = Llama(cfg).eval()
    ours.load_state_dict(state)
    assert max_logit_difference(ours, theirs, tokens_for(120)) <= 1e-4


@pytest.mark.parametrize("changes, needle", [
    ({"moe_shared_experts": 1}, "model.moe_shared_experts: Mixtral's format cannot hold shared experts"),
    ({"moe_router": "sigmoid"}, "model.moe_router: Mixtral's format cannot hold a sigmoid router"),
    ({"moe_first_dense": 1}, "model.moe_first_dense: Mixtral's format cannot hold dense layers"),
])
def test_export_refuses_what_mixtral_cannot_represent(changes, needle):
    from threefold.interop import hf

    cfg = dataclasses.replace(mixtral_config(100), **changes)
    with pytest.raises(ConfigError, match=needle):
        hf.to_hf_tensors(cfg, Llama(cfg).state_dict(), "run")
    cfg = mixtral_config(100)
    state = Llama(cfg).state_dict()
    state["blocks.1.mlp.expert_bias"][2] = 0.5
    with pytest.raises(ConfigError, match="blocks.1.mlp.expert_bias is not zero; Mixtral routes without a bias"):
        hf.to_hf_tensors(cfg, state, "run")


def test_the_demo_config_is_the_tiny_moe_with_the_tiny_models_active_size():
    from pathlib import Path

    from threefold.interop.commands import describe

    cfg = load_config(Path(__file__).parent.parent / "configs" / "moe.toml").model
    assert cfg.preset == "tiny-moe" and cfg.moe_experts == 8 and cfg.moe_top_k_experts * cfg.moe_ffn_hidden == \
        get_preset("tiny").ffn_hidden
    cfg = dataclasses.replace(cfg, vocab_size=4096)
    assert describe(cfg).startswith("10.5M parameters: 4 layers, hidden 256, 8 heads (4 kv), ffn 704, "
                                    "8 experts of 352 (top-2, 4.0M active)")


@pytest.mark.parametrize("sizes", [{"dp": 2, "ep": 2}, {"pp": 2, "dp": 2, "ep": 2}, {"tp": 2, "dp": 2, "ep": 2}])
def test_init_from_a_mixtral_folder_gives_each_expert_parallel_rank_its_experts_only(tmp_path, transformers,
                                                                                      monkeypatch, sizes):
    """`[model] init_from` a Mixtral folder into an ep layout: each rank holds its E/ep experts
    (and its tp and pp pieces of the rest) exactly as they are in the folder, and reads from the
    safetensors files only the elements it holds."""
    from test_interop import assert_holds_its_pieces, init_from_folder, rank_cut, record_safetensors_reads

    config = transformers.MixtralConfig(vocab_size=120, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                        num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=False)
    model_cfg, full = init_from_folder(transformers.MixtralForCausalLM(config).eval(), tmp_path / "hf", seed=3)
    read = record_safetensors_reads(monkeypatch)
    world = 1
    for size in sizes.values():
        world *= size
    world //= sizes["ep"]  # ep is carved out of dp
    experts = [key for key in full if "experts" in key]
    assert experts
    for rank in range(world):
        read.clear()
        cut = rank_cut(model_cfg, sizes, rank)
        held = assert_holds_its_pieces(cut, full)
        local = {key: q for part in cut.parts.values() for key, q in part.named_parameters() if "experts" in key}
        assert local and all(q.shape[0] == 6 // sizes["ep"] for q in local.values())  # E/ep experts each
        assert sum(read) == held, (sizes, rank, sum(read), held)
