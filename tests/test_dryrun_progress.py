"""``threefold dryrun`` as a user sees it run: a line per rank on stderr while it runs (its phase,
and its block forwards as a bar), on a terminal only and never with --json or --no-progress; and
its one-line refusals count in the singular where the count is one."""
from __future__ import annotations

import io
import json
import sys

import pytest
from rich.console import Console

from tests.equivalence import matrix_config
from threefold.cli import main
from threefold.train import dryrun as dryrun_module
from threefold.train.dryrun import dry_run, dry_run_config, dry_run_rank

TINY = ["--set", "model.preset=tiny", "--set", "model.layers=2", "--set", "model.vocab_size=256",
        "--set", "model.seq_len=32", "--set", "train.global_batch=4", "--set", "train.micro_batch=2"]


def small(*overrides: str):
    """The equivalence matrix's model with two micro-batches a step per replica (a dry run of it
    takes under a second)."""
    cfg = matrix_config("train.micro_batch=2", "train.global_batch=4", *overrides)
    return dry_run_config(cfg, cfg.parallel.world_size)


def terminal(file) -> Console:
    return Console(file=file, force_terminal=True, width=160, color_system=None)


def test_the_progress_shows_each_rank_and_its_phases():
    """(The hooks that count the forwards are there in every dry run: test_dryrun.py's figures,
    exact against the planner's, are measured with them.)"""
    cfg = small("parallel.dp=2")
    screen = io.StringIO()
    dry_run(cfg, (0, 1), console=terminal(screen))
    text = screen.getvalue()
    for line in ("rank 0 of 2 (1 of 2): building its share of the model",
                 "rank 0 of 2 (1 of 2): forward and backward",
                 "rank 1 of 2 (2 of 2): gradient norm and optimizer step", "rank 1 of 2 (2 of 2): done"):
        assert line in text, text
    assert "100%" in text


@pytest.mark.parametrize("layout", [["parallel.pp=2"],
                                    ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
                                    ["train.recompute=full"], ["parallel.pp=2", "parallel.schedule=2bw"]],
                         ids=["1f1b", "interleaved", "full-recompute", "2bw"])
def test_the_bar_ends_full_at_the_last_forward(layout):
    """Each block of the rank runs forward once per micro-batch (twice as many for 2bw's two
    steps; its first also starts the next step's forwards, which the bar does not overrun)."""
    cfg = small(*layout)
    told = []
    result = dry_run_rank(cfg, 0, on_step=lambda description, done=0, total=None:
                          told.append((description, done, total)))
    counts = [(done, total) for description, done, total in told if description == "forward and backward"]
    assert counts[0][0] == 0 and counts[-1][0] == counts[-1][1] > 0
    assert all(done <= total for done, total in counts)
    blocks = cfg.model.layers // cfg.parallel.pp
    assert counts[-1][1] == blocks * cfg.microbatches * result["steps_run"]
    assert [d for d, _, _ in told][0] == "building its share of the model"
    assert [d for d, _, _ in told][-1] == "gradient norm and optimizer step"


def test_off_a_terminal_stderr_stays_clean(capsys):
    assert main(["dryrun", "--world-size", "1", *TINY]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "rank 0 of 1" in out
    assert main(["dryrun", "--world-size", "1", "--json", *TINY]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["rank"] == 0


@pytest.mark.parametrize("flags, shown", [([], True), (["--no-progress"], False), (["--json"], False)])
def test_on_a_terminal_the_progress_goes_to_stderr_unless_turned_off(capsys, monkeypatch, flags, shown):
    real = dryrun_module.dry_run
    monkeypatch.setattr(dryrun_module, "dry_run", lambda *a, **k: real(*a, **k, console=terminal(sys.stderr)))
    assert main(["dryrun", "--world-size", "1", *flags, *TINY]) == 0
    out, err = capsys.readouterr()
    assert ("rank 0 of 1: forward and backward" in err) == shown, err
    assert "forward and backward" not in out


@pytest.mark.parametrize("argv, line", [
    (["--world-size", "3"], 'error: --world-size: the layout dp×tp×pp×cp = 1×1×1×1 = 1 rank, not 3; '
                            'parallel.dp = "auto" takes dp = 3 from the world size'),
    (["--world-size", "3", "--set", "parallel.tp=2"],
     "error: --world-size: the layout dp×tp×pp×cp = 1×2×1×1 = 2 ranks, not 3"),
    (["--world-size", "1", "--rank", "1"], "error: --rank: 1 is outside a world of 1 rank (0 to 0)"),
])
def test_a_refusal_counts_one_rank_in_the_singular(capsys, argv, line):
    assert main(["dryrun", *argv, *TINY]) == 2
    assert capsys.readouterr().err.strip() == line


@pytest.mark.filterwarnings("ignore:parallel.microbatches")  # the engine's: one micro-batch leaves a bubble
def test_one_micro_batch_is_one_micro_batch(capsys):
    assert main(["dryrun", "--world-size", "2", *TINY, "--set", "parallel.pp=2", "--set", "train.global_batch=2"]) == 0
    assert "pipeline actions (1f1b, 1 micro-batch): F0 " in capsys.readouterr().out
