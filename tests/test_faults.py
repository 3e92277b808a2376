"""Surviving faults: a rank killed mid-run is restarted by torchrun and the job resumes from its
last complete checkpoint, producing the losses of a run that never stopped; SIGTERM stops a run
cleanly; a stuck rank is named; a full disk during a save loses nothing."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from test_train import TINY, corpus  # noqa: F401  (the corpus fixture)

from threefold.train.checkpoint import list_checkpoints

LAYOUT = ["parallel.dp=2", "parallel.timeout_s=60", "train.steps=24", "train.checkpoint_every=4"]


def command(tmp_path, corpus, name, *extra):  # noqa: F811
    sets = TINY + LAYOUT + [f"data.corpus={json.dumps(str(corpus))}",
                            f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
                            f"train.checkpoint_dir={json.dumps(str(tmp_path / name))}"]
    args = [sys.executable, "-m", "threefold.cli", "train", "--no-progress",
            "--metrics-file", str(tmp_path / f"{name}.jsonl"), *extra]
    for s in sets:
        args += ["--set", s]
    return args


def losses(path) -> dict[int, float]:
    """The last record of each step (a resumed run writes the steps after its checkpoint again)."""
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def whole(tmp_path_factory, corpus):  # noqa: F811
    """The losses of LAYOUT's run that never stopped (dp=2 under torchrun, 24 steps, a checkpoint
    every 4 steps): what a run stopped and resumed must reproduce, bit for bit."""
    folder = tmp_path_factory.mktemp("whole")
    run = subprocess.run(command(folder, corpus, "whole"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return losses(folder / "whole.jsonl")


def test_killed_rank_restarts_and_resumes_exactly(tmp_path, corpus, whole):  # noqa: F811
    job = subprocess.Popen(command(tmp_path, corpus, "faulty", "--max-restarts", "1"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (tmp_path / "faulty" / "step_000008").exists():  # two checkpoints in: kill a rank
        assert job.poll() is None and time.time() < deadline, "the run ended before its second checkpoint"
        time.sleep(0.05)
    workers = children(job.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-2000:]

    got = losses(tmp_path / "faulty.jsonl")
    assert sorted(got) == list(range(1, 25))
    assert got == whole  # fp32, same layout: the resumed steps are bit-identical


def test_a_killed_rank_is_named_and_ends_the_job(tmp_path, corpus):  # noqa: F811
    """Without --max-restarts, torchrun stops the job at once; the user learns which rank died, of what."""
    job = subprocess.Popen(command(tmp_path, corpus, "killed") + ["--set", "train.steps=100000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "killed.jsonl").exists() or not (tmp_path / "killed.jsonl").read_text():  # training
        assert job.poll() is None and time.time() < deadline, job.stderr.read()[-2000:] if job.poll() else "slow"
        time.sleep(0.05)
    victim = children(job.pid)[1]
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1 and time.time() - killed < 30
    assert f"(pid {victim}) died of SIGKILL; torchrun stopped the other ranks" in err, err[-2000:]


def wait_for_steps(job, metrics, n: int, timeout_s: float = 120) -> None:
    """Until the run has written ``n`` steps to its metrics file."""
    deadline = time.time() + timeout_s
    while not metrics.exists() or len(metrics.read_text().splitlines()) < n:
        assert job.poll() is None, f"the run ended early: {job.stderr.read()[-2000:]}"
        assert time.time() < deadline, "the run is too slow"
        time.sleep(0.02)


def test_sigterm_finishes_the_step_saves_and_resumes_exactly(tmp_path, corpus, whole):  # noqa: F811
    """What SLURM and Kubernetes send before they kill a job (here to the launching process,
    as Kubernetes does; it passes it on): every rank stops after the same step, saves, exits 0.
    Checkpoints take nothing from the run: its losses are those of ``whole``, which saved every 4 steps."""
    only_sigterm_saves = ["--set", "train.checkpoint_every=0"]  # a save at the end only: none before it
    job = subprocess.Popen(command(tmp_path, corpus, "stopped") + only_sigterm_saves,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_steps(job, tmp_path / "stopped.jsonl", 1)
    os.kill(job.pid, signal.SIGTERM)
    signalled = time.time()
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0 and time.time() - signalled < 20, err[-2000:]
    (saved,) = list_checkpoints(tmp_path / "stopped")
    stopped_at = int(saved.name[5:])
    assert stopped_at < 24 and f"SIGTERM: stopped after step {stopped_at} of 24, saved {saved}" in err
    assert sorted(losses(tmp_path / "stopped.jsonl")) == list(range(1, stopped_at + 1))

    resumed = subprocess.run(command(tmp_path, corpus, "stopped") + only_sigterm_saves + ["--set", "train.resume=true"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {saved} at step {stopped_at}\n" in resumed.stderr
    assert losses(tmp_path / "stopped.jsonl") == whole  # bit for bit


def rank_of(pid: int) -> int:
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).partition(b"=")[2])


def test_a_stuck_rank_is_named_at_the_timeout(tmp_path, corpus):  # noqa: F811
    """A rank that stops answering without dying (SIGSTOP: a hung kernel, a stalled disk) keeps
    its connections open, so nothing fails until parallel.timeout_s; then the others stop and
    name it, in one line, and torchrun ends the job (it kills the stuck rank after 30 s; the test
    kills it sooner)."""
    job = subprocess.Popen(command(tmp_path, corpus, "stuck") + ["--set", "train.steps=100000",
                                                                  "--set", "parallel.timeout_s=4"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(job, tmp_path / "stuck.jsonl", 1)
        stuck = children(job.pid)[1]
        rank = rank_of(stuck)
        os.kill(stuck, signal.SIGSTOP)
        stopped = time.time()
        for line in job.stderr:  # until a rank reports the failure
            if line.startswith("error:"):
                break
        named = time.time() - stopped
        # torchrun now sends SIGTERM, which a stopped rank cannot act on, and SIGKILL 30 s later:
        # played here 3 s later, still after the first failures' second, so it is not "died of"
        time.sleep(3)
        os.kill(stuck, signal.SIGKILL)
        err = line + job.stderr.read()
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert 4 <= named < 4 + 4 + 5  # the timeout, the roll call (at most the timeout), slack
    # whichever collective the stopped rank left its partner in (the step's all-reduce, most often;
    # a barrier if it stopped between steps; DCP's own gathers if it stopped in a save): named,
    # and the rank that did not come
    collectives = r"(all_reduce|barrier|all_gather|reduce_scatter|broadcast) of |saving the checkpoint of step \d+ failed"
    assert re.match(rf"error: ({collectives})", line) and line.rstrip().endswith(
        f"rank {rank} of the group [0, 1] did not reach it (dead, or stuck elsewhere)"), err[-3000:]
    assert job.returncode == 1 and time.time() - stopped < 4 + 4 + 3 + 10
    assert "Traceback" not in err and "died of" not in err, err[-3000:]  # it was stuck, not dead


FULL_DISK = """
set -e
mount -t tmpfs -o size={size} tmpfs {disk}
set +e
"$@"
code=$?
cp -a {disk}/. {after}
exit $code
"""


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, corpus):  # noqa: F811
    """checkpoint_dir on a real full disk: a tmpfs of 2.2 MB (in a mount namespace of its own,
    `unshare`), room for one 1.5 MB checkpoint of the tiny model but not two. The save of step 4
    fails on both ranks; one line names the folder and the bytes; step 2 stays the latest and
    loads; no half-written folder is left to be loaded."""
    from threefold.train import checkpoint

    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    after.mkdir()
    if subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (unshare -rm mount failed)")
    args = command(tmp_path, corpus, "full") + ["--set", f"train.checkpoint_dir={json.dumps(str(disk / 'ckpt'))}",
                                               "--set", "train.checkpoint_every=2", "--set", "train.steps=6"]
    script = FULL_DISK.format(size="2200k", disk=disk, after=after)
    run = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *args], capture_output=True, text=True,
                         timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    saved = after / "ckpt"
    kept = checkpoint.list_checkpoints(saved)
    assert [p.name for p in kept] == ["step_000002"] and sorted(p.name for p in saved.iterdir()) == ["step_000002"]
    shipped = sum(p.stat().st_size for p in kept[0].glob("*.distcp"))
    found = re.fullmatch(rf"error: checkpoint: no space left on the device of {disk}/ckpt/step_000004.tmp: the "
                         rf"checkpoint of step 4 needs at least ([\d,]+) bytes, ([\d,]+) are free there; "
                         rf"{disk}/ckpt/step_000002 stays the latest checkpoint", errors[0])
    assert found, errors[0]
    needed, free = (int(g.replace(",", "")) for g in found.groups())
    assert needed <= shipped < 1.1 * needed and free < needed  # the pieces' files: tensors and DCP's framing
    model_cfg, state = checkpoint.read_model(kept[0])  # loadable
    assert losses(tmp_path / "full.jsonl").keys() == {1, 2, 3, 4}


def test_sigterm_on_one_process_stops_after_the_step_in_progress(tmp_path, corpus, monkeypatch, capsys):  # noqa: F811
    from test_train import config

    from threefold.train.engine import Engine
    from threefold.train.trainer import train

    original, calls = Engine.forward_backward, []

    def signalled_in_step_3(self, micro_batches):
        calls.append(None)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the step
        return original(self, micro_batches)

    monkeypatch.setattr(Engine, "forward_backward", signalled_in_step_3)
    ckpt = tmp_path / "ckpt"
    result = train(config(tmp_path, corpus, "train.steps=8", f"train.checkpoint_dir={json.dumps(str(ckpt))}"),
                   progress=False)
    assert result.stopped_at == 3 and len(result.losses) == 3
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_000003"]
    assert f"SIGTERM: stopped after step 3 of 8, saved {ckpt / 'step_000003'}" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the run's only


def test_a_diverged_run_says_so_once_whatever_the_ranks(tmp_path, corpus):  # noqa: F811
    """Every rank takes the stop for a non-finite loss or gradient norm at the same step (both are
    global): one of them says it, in one line, and the job exits 1."""
    diverge = ["--set", "train.lr=1e30", "--set", "train.warmup_steps=0", "--set", "train.grad_clip=0.0"]
    run = subprocess.run(command(tmp_path, corpus, "diverged") + diverge, capture_output=True, text=True, timeout=300)
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 1 and len(errors) == 1, run.stderr[-3000:]
    assert re.match(r"error: step \d+: the loss is \S+ and the gradient norm nan; stopping", errors[0]), errors


def test_ctrl_c_stops_every_rank_and_says_so_once(tmp_path, corpus):  # noqa: F811
    """Ctrl-C, which a terminal sends to the whole job: every rank stops, rank 0 says "aborted",
    exit 130; no traceback, none of Python's "Exception ignored" reports (a KeyboardInterrupt
    raised while the activation meter's finalizer ran was ignored, and the run went on), and no
    error from the rank whose partner stopped first."""
    job = subprocess.Popen(command(tmp_path, corpus, "interrupted") + ["--set", "train.steps=100000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_steps(job, tmp_path / "interrupted.jsonl", 2)
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 130 and err.strip().splitlines()[-1] == "aborted", err[-3000:]
    assert err.count("aborted") == 1 and "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert "error:" not in err, err[-3000:]
