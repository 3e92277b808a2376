"""The data package: corpus, tokenizers, cached token files, sampler, and `threefold data prepare`."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from threefold.cli import main
from threefold.config import ConfigError, DataConfig
from threefold.data import BatchSampler, prepare_dataset, val_batches
from threefold.data.corpus import find_corpus, markdown_to_text
from threefold.data.tokenizer import gpt2_tokenizer, train_bpe
from threefold.data import tokens as tokens_module
from threefold.data.tokens import token_dtype, unigram_entropy

WORDS = "the king queen sword night love death crown café naïve Größe 日本 fair foul hath thee".split()
LINE = re.compile(r"doc (\d) line (\d{4}) [^\n]* end")
UNICODE_SAMPLE = "Héllo wörld — 日本語 🤖\n\ttabs  and  spaces\n"


def write_corpus(folder, documents=3, lines=300):
    """Documents of uniquely numbered lines, so a line of text says where it came from."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for doc in range(documents):
        text = "".join(f"doc {doc} line {line:04d} {' '.join(rng.choices(WORDS, k=8))} end\n" for line in range(lines))
        (folder / f"part{doc}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture
def small_cfg(tmp_path):
    return DataConfig(corpus=str(write_corpus(tmp_path / "corpus")), vocab_size=400, val_fraction=0.1,
                      cache_dir=str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    cfg = DataConfig(cache_dir=str(tmp_path_factory.mktemp("shakespeare-cache")))
    return prepare_dataset(cfg, seq_len=256, progress=False)


# --- corpus -----------------------------------------------------------------------------------

def test_markdown_to_text_keeps_speakers_and_verse():
    markdown = "# Hamlet\n\n## ACT I\n\n_Enter Ghost_\n\n**HAMLET**  \nTo be, or not to be:  \n*aside* \\[x] snake_case\n"
    assert markdown_to_text(markdown) == "Hamlet\n\nACT I\n\nEnter Ghost\n\nHAMLET:\nTo be, or not to be:\naside [x] snake_case\n"


def test_folder_corpus_is_recursive_sorted_and_text_only(tmp_path):
    for name in ("b.txt", "a/z.md", "a/c.txt", "skip.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    corpus = find_corpus(str(tmp_path))
    assert [str(p.relative_to(tmp_path)) for p in corpus.files] == ["a/c.txt", "a/z.md", "b.txt"]
    with pytest.raises(ConfigError, match="data.corpus"):
        find_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.txt or \\*.md"):
        find_corpus(str(tmp_path / "empty"))


# --- tokenizers -------------------------------------------------------------------------------

def test_trained_bpe_round_trips_any_text(small_cfg):
    corpus = find_corpus(small_cfg.corpus)
    tokenizer = train_bpe(corpus.documents(), vocab_size=300)
    assert tokenizer.vocab_size == 300
    for text in (UNICODE_SAMPLE, "doc 1 line 0007 the king end\n", ""):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode("the king")) < len("the king".encode())  # merges learned from the corpus


def test_gpt2_tokenizer_matches_known_ids():
    tokenizer = gpt2_tokenizer()
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (50257, 50256)
    assert tokenizer.encode("<|endoftext|>") == [50256]
    assert tokenizer.decode(tokenizer.encode(UNICODE_SAMPLE)) == UNICODE_SAMPLE


def test_token_dtype_and_entropy():
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32
    assert unigram_entropy(np.array([5, 5, 5, 5, 0])) == pytest.approx(np.log(4))


# --- token files and cache --------------------------------------------------------------------

def test_prepare_splits_every_document_without_overlap(small_cfg):
    dataset = prepare_dataset(small_cfg, seq_len=32, progress=False)
    tokenizer, meta = dataset.tokenizer, dataset.meta
    documents = [path.read_text(encoding="utf-8") for path in find_corpus(small_cfg.corpus).files]
    expected = np.concatenate([tokenizer.encode(text) + [tokenizer.eos_id] for text in documents])
    assert dataset.train_tokens.dtype == np.uint16
    assert (meta["documents"], meta["characters"]) == (3, sum(map(len, documents)))
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(dataset.train_tokens), len(dataset.val_tokens))
    assert len(dataset.train_tokens) + len(dataset.val_tokens) == len(expected)
    assert abs(len(dataset.val_tokens) - 0.1 * len(expected)) <= 1
    # the same tokens, only redistributed between the splits
    assert np.array_equal(np.sort(np.concatenate([dataset.train_tokens, dataset.val_tokens])), np.sort(expected))

    train_lines = set(LINE.findall(tokenizer.decode(dataset.train_tokens)))
    val_lines = set(LINE.findall(tokenizer.decode(dataset.val_tokens)))
    assert not train_lines & val_lines
    assert {doc for doc, _ in val_lines} == {"0", "1", "2"}  # validation samples every document
    assert len(train_lines | val_lines) >= 3 * 300 - 3  # at most the line cut at each split point is lost
    counts = np.bincount(dataset.train_tokens, minlength=tokenizer.vocab_size)
    assert meta["unigram_entropy"] == pytest.approx(unigram_entropy(counts))


def test_encoding_in_pieces_gives_the_tokens_of_the_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens_module, "PIECE_CHARS", 64)  # force many cuts in a short text
    rng = random.Random(1)
    text = "".join(rng.choice(["", " ", "  ", "\t"]) + " ".join(rng.choices(WORDS, k=rng.randint(0, 6)))
                   + rng.choice(["", " ", "  "]) + "\n" * rng.randint(1, 3) for _ in range(400))
    (tmp_path / "one.txt").write_text(text, encoding="utf-8")
    cfg = DataConfig(corpus=str(tmp_path / "one.txt"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    dataset = prepare_dataset(cfg, seq_len=8, progress=False)
    whole = dataset.tokenizer.encode(text) + [dataset.tokenizer.eos_id]
    assert np.concatenate([dataset.train_tokens, dataset.val_tokens]).tolist() == whole  # one document: head, tail


def test_second_prepare_reuses_the_cache(small_cfg, tmp_path):
    first = prepare_dataset(small_cfg, seq_len=32, progress=False)
    second = prepare_dataset(small_cfg, seq_len=32, progress=False)
    assert not first.cached and second.cached
    assert second.train_tokens.filename == first.train_tokens.filename and second.meta == first.meta
    assert np.array_equal(first.val_tokens, second.val_tokens)

    other_vocab = prepare_dataset(DataConfig(**{**vars(small_cfg), "vocab_size": 320}), seq_len=32, progress=False)
    assert not other_vocab.cached and other_vocab.tokenizer.vocab_size == 320

    (tmp_path / "corpus" / "part9.txt").write_text("doc 9 line 0000 a new document end\n")
    grown = prepare_dataset(small_cfg, seq_len=32, progress=False)
    assert not grown.cached and grown.meta["documents"] == 4


PREPARE_IN_CHILD = """
import json, sys
from threefold.config import DataConfig
from threefold.data.tokens import prepare_dataset
dataset = prepare_dataset(DataConfig(**json.loads(sys.argv[1])), seq_len=32, progress=False)
print(json.dumps([dataset.cached, len(dataset.train_tokens)]))
"""


def test_concurrent_prepare_on_a_cold_cache(small_cfg):
    children = [subprocess.Popen([sys.executable, "-c", PREPARE_IN_CHILD, json.dumps(vars(small_cfg))],
                                 stdout=subprocess.PIPE, text=True) for _ in range(3)]
    results = [json.loads(child.communicate(timeout=120)[0]) for child in children]
    assert [child.returncode for child in children] == [0, 0, 0]
    assert sorted(cached for cached, _ in results) == [False, True, True]  # one built, the others waited
    dataset = prepare_dataset(small_cfg, seq_len=32, progress=False)
    assert dataset.cached and {length for _, length in results} == {len(dataset.train_tokens)}


def test_too_small_corpus_is_a_config_error(small_cfg):
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        prepare_dataset(small_cfg, seq_len=100_000, progress=False)


# --- sampler ----------------------------------------------------------------------------------

def counting_tokens(n=1000):
    """Token i has value i, so a window's first input says where it starts."""
    return np.arange(n, dtype=np.uint32)


def test_batches_are_windows_with_shifted_targets():
    inputs, targets = BatchSampler(counting_tokens(), seq_len=10, global_batch=4, seed=1).global_batch_at(3)
    assert inputs.shape == targets.shape == (4, 10) and inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs, inputs[:, :1] + torch.arange(10))  # contiguous text
    assert torch.equal(targets, inputs + 1)


def test_an_epoch_covers_every_window_once():
    # 1000 tokens, seq_len 10: (1000 - 10) // 10 = 99 windows, leaving 10 tokens of slack for the offset
    sampler = BatchSampler(counting_tokens(), seq_len=10, global_batch=9, seed=5)
    starts = [sampler.global_batch_at(step)[0][:, 0] for step in range(11)]  # 99 samples = one epoch
    starts = np.sort(torch.cat(starts).numpy())
    assert len(starts) == 99 and np.all(np.diff(starts) == 10) and 0 <= starts[0] <= 9
    next_epoch = torch.cat([sampler.global_batch_at(step)[0][:, 0] for step in range(11, 22)])
    assert not torch.equal(next_epoch, torch.cat([sampler.global_batch_at(s)[0][:, 0] for s in range(11)]))


def test_resuming_from_a_checkpoint_without_a_sampler_state_is_refused():
    """A checkpoint saved outside ``train`` (``checkpoint.save(..., sampler_state={})``) was a KeyError."""
    sampler = BatchSampler(counting_tokens(), seq_len=10, global_batch=4, seed=1)
    with pytest.raises(ConfigError, match="holds no seed, step, seq_len, global_batch"):
        sampler.load_state_dict({})
    sampler.load_state_dict({"seed": 1, "step": 3, "seq_len": 10, "global_batch": 4})
    assert sampler.step == 3


def test_sampler_depends_only_on_seed_and_step():
    tokens = counting_tokens()
    a, b = BatchSampler(tokens, 10, 8, seed=7), BatchSampler(tokens, 10, 8, seed=7)
    b.global_batch_at(40)  # a different history must not matter
    for step in (0, 5, 40):
        assert torch.equal(a.global_batch_at(step)[0], b.global_batch_at(step)[0])
    assert not torch.equal(a.global_batch_at(0)[0], BatchSampler(tokens, 10, 8, seed=8).global_batch_at(0)[0])


@pytest.mark.parametrize("step", [0, 3, 12])  # step 12 straddles the first epoch boundary
def test_local_batches_of_any_world_make_the_global_batch(step):
    sampler = BatchSampler(counting_tokens(), seq_len=10, global_batch=8, seed=3)
    inputs, targets = sampler.global_batch_at(step)
    for world in (1, 2, 4):
        parts = [BatchSampler(counting_tokens(), 10, 8, seed=3).local_batch_at(step, rank, world) for rank in range(world)]
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)
    with pytest.raises(ConfigError, match="not divisible"):
        sampler.local_batch_at(step, 0, 3)


def test_resume_from_state_continues_the_same_stream():
    tokens = counting_tokens()
    original = BatchSampler(tokens, 10, 4, seed=11)
    for _ in range(5):
        original.next_batch()
    state = original.state_dict()
    assert state["step"] == 5 and state["seed"] == 11
    resumed = BatchSampler(tokens, 10, 4, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint's serialization
    assert torch.equal(resumed.next_batch(rank=1, world=2)[0], original.next_batch(rank=1, world=2)[0])
    assert resumed.step == original.step == 6
    with pytest.raises(ConfigError, match="seed"):
        BatchSampler(tokens, 10, 4, seed=12).load_state_dict(state)


def test_validation_batches_are_fixed_and_spread():
    tokens = counting_tokens(500)
    batches = val_batches(tokens, seq_len=10, batch=3, count=2)
    assert len(batches) == 2 and batches[0][0].shape == (3, 10)
    starts = torch.cat([inputs[:, 0] for inputs, _ in batches]).tolist()
    assert starts == [0, 98, 196, 293, 391, 489]  # linspace(0, 500 - 11, 6), rounded
    assert torch.equal(batches[1][1], val_batches(tokens, 10, 3, 2)[1][1])


# --- the real corpus and the command ----------------------------------------------------------

def test_shakespeare_corpus(shakespeare):
    meta = shakespeare.meta
    assert meta["documents"] == 38 and meta["vocab_size"] == 4096
    assert meta["val_tokens"] / (meta["train_tokens"] + meta["val_tokens"]) == pytest.approx(0.05, abs=1e-4)
    assert 4.0 < meta["unigram_entropy"] < np.log(4096)
    text = shakespeare.tokenizer.decode(shakespeare.train_tokens[:3000])
    assert "\nTHESEUS:\n" in text and "**" not in text and "  \n" not in text


def test_cli_prepare_prints_a_table(small_cfg, capsys):
    assert main(["data", "prepare", "--corpus", small_cfg.corpus, "--vocab-size", "300", "--seq-len", "16",
                 "--cache-dir", small_cfg.cache_dir]) == 0
    out = capsys.readouterr().out
    assert "documents" in out and "unigram entropy" in out


@pytest.mark.parametrize("args, key", [
    (["--corpus", "/no/such/corpus"], "--corpus"),  # data prepare's messages name its own flags
    (["--vocab-size", "100"], "--vocab-size"),
    (["--cache-dir", "/proc/not-writable"], "--cache-dir"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, key, tmp_path, capsys):
    assert main(["data", "prepare", "--cache-dir", str(tmp_path / "cache"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {key}:") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("template, said", [
    ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('the first turn must be the system') }}{% endif %}",
     "failed: the first turn must be the system"),
    ("{% for m in messages %}{{ m['content'] ", "failed: unexpected end of template"),
])
def test_a_chat_template_that_refuses_or_does_not_parse_is_one_line(template, said):
    """Hugging Face templates call raise_exception (transformers defines it) to refuse a
    conversation; that, or a template with a syntax error, is a ConfigError, not a traceback."""
    tokenizer = gpt2_tokenizer()
    tokenizer.chat_template = template
    with pytest.raises(ConfigError) as err:
        tokenizer.chat("Hi")
    assert str(err.value).startswith("--chat: the chat template of 'gpt2' failed: ") and said in str(err.value)
    assert "\n" not in str(err.value)


def test_a_chat_template_may_break_out_of_its_loop():
    """transformers renders with Jinja's loop controls; templates that use {% break %} need them."""
    tokenizer = gpt2_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% break %}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert tokenizer.chat("Hi") == "<user>Hi<assistant>"
