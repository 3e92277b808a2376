"""Runs that span machines: two torchrun agents as two nodes (a c10d rendezvous on 127.0.0.1)
train together, with the commands docs/launch.md shows, and match one process; a job that loses
a node for good continues on the ranks that remain."""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_faults import children, losses
from test_train import TINY, corpus  # noqa: F401  (the corpus fixture)

from threefold.configure import load_config
from threefold.train.checkpoint import list_checkpoints
from threefold.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
DOC_PORT = "29400"


def documented_command(name: str) -> list[str]:
    """The command of the ```bash block after ``<!-- tests/test_multinode.py: NAME -->`` in
    docs/launch.md, as an argument list (``torchrun`` is ``python -m torch.distributed.run``)."""
    text = (ROOT / "docs" / "launch.md").read_text()
    found = re.search(rf"<!-- tests/test_multinode.py: {name} -->\n```bash\n(.*?)```", text, re.S)
    assert found, f"docs/launch.md has no block {name!r}"
    args = shlex.split(found.group(1).replace("\\\n", " "))
    assert args[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *args[1:]]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def on_this_machine(args: list[str], tmp_path, corpus, *sets: str) -> list[str]:  # noqa: F811
    """The documented command with a free port, files under tmp_path and a tiny model."""
    port = free_port()
    args = [a.replace(f":{DOC_PORT}", f":{port}") for a in args]
    args = [a.replace("runs/", f"{tmp_path}/runs/") for a in args]
    for s in TINY + [f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
                     "parallel.timeout_s=60", "--no-progress", *sets]:
        args += [s] if s.startswith("--") else ["--set", s]
    return args


def single_process_losses(tmp_path, corpus, *sets: str) -> list[float]:  # noqa: F811
    cfg = load_config(ROOT / "configs" / "ddp.toml", TINY + [
        f"data.corpus={json.dumps(str(corpus))}", f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}",
        "parallel.dp=1", *sets])
    return train(cfg, progress=False).losses


def start(args, name: str, tmp_path) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def stop(*agents: subprocess.Popen) -> None:
    """Kill what is left of these torchrun agents and their ranks (after a failed test)."""
    for agent in agents:
        if agent.poll() is None:
            for pid in [*children(agent.pid), agent.pid]:
                os.kill(pid, signal.SIGKILL)
            agent.wait()


def test_two_nodes_train_dp2_tp2_together_and_match_one_process(tmp_path, corpus):  # noqa: F811
    args = on_this_machine(documented_command("two-nodes"), tmp_path, corpus, "train.steps=8")
    nodes = [start(args, f"node{i}", tmp_path) for i in range(2)]
    try:
        for i, node in enumerate(nodes):
            assert node.wait(timeout=240) == 0, (tmp_path / f"node{i}.log").read_text()[-3000:]
    finally:
        stop(*nodes)
    got = losses(tmp_path / "runs" / "two-nodes.jsonl")
    assert sorted(got) == list(range(1, 9))
    want = single_process_losses(tmp_path, corpus, "train.steps=8")
    assert [got[s] for s in range(1, 9)] == pytest.approx(want, rel=1e-5, abs=0)


# torchrun with the given arguments, started as soon as the rendezvous store on PORT is up (its
# imports done before): so this node joins the first node's round within its last_call_timeout.
TORCHRUN_WHEN_LISTENING = """
import socket, sys, time
from torch.distributed import run
port = int(sys.argv.pop(1))
while socket.socket().connect_ex(("127.0.0.1", port)):
    time.sleep(0.02)
sys.argv[0] = "torchrun"
run.main()
"""


def test_a_job_that_loses_a_node_continues_on_the_rest_with_dp_auto(tmp_path, corpus):  # noqa: F811
    """4 ranks (dp=4) on two nodes; the second node dies for good after the first checkpoint (step 4).
    torchrun restarts the first node's ranks alone, dp = "auto" becomes 2, and the job resumes
    from its last checkpoint, resharded, to the end: the losses of one process throughout."""
    # 4 sequences a step (1 per rank on dp=4); a smaller learning rate than TINY's, so that 40
    # steps on other layouts do not amplify rounding differences beyond rel 1e-5
    sets = ["train.steps=40", "train.micro_batch=1", "train.lr=1e-3"]
    args = on_this_machine(documented_command("shrink"), tmp_path, corpus, *sets)
    port = int(args[args.index("--rdzv-endpoint") + 1].rpartition(":")[2])
    survivor = start(args, "survivor", tmp_path)  # the first to start hosts the store: it must outlive the other
    doomed = start([sys.executable, "-c", TORCHRUN_WHEN_LISTENING, str(port), *args[3:]], "doomed", tmp_path)
    try:
        deadline = time.time() + 180
        while not list_checkpoints(tmp_path / "runs" / "shrink"):
            assert survivor.poll() is None and doomed.poll() is None and time.time() < deadline, \
                (tmp_path / "survivor.log").read_text()[-3000:]
            time.sleep(0.02)
        ranks = children(doomed.pid)  # torchrun starts each rank in a session of its own
        assert len(ranks) == 2, ranks
        for pid in [doomed.pid, *ranks]:  # the node's agent and its two ranks
            os.kill(pid, signal.SIGKILL)
        assert survivor.wait(timeout=180) == 0, (tmp_path / "survivor.log").read_text()[-3000:]
    finally:
        stop(survivor, doomed)
    log = (tmp_path / "survivor.log").read_text()
    resumed = re.search(r"resumed from \S+/step_(\d+) at step (\d+) \(saved on dp=4 tp=1 pp=1 zero=0, resharded to "
                        r"dp=2 tp=1 pp=1 zero=0; parallel.dp = \"auto\" on 2 ranks\)\n", log)
    assert resumed and 4 <= int(resumed.group(1)) < 40, log[-3000:]
    got = losses(tmp_path / "runs" / "shrink.jsonl")
    assert sorted(got) == list(range(1, 41))
    want = single_process_losses(tmp_path, corpus, *sets)
    assert [got[s] for s in range(1, 41)] == pytest.approx(want, rel=1e-5, abs=0)


def test_dp_auto_is_resolved_from_the_world_size_and_checked_like_a_given_dp(capsys):
    from threefold.cli import main
    from threefold.config import ConfigError

    cfg = load_config(None, ["parallel.dp=auto", "parallel.tp=2", "train.global_batch=8", "train.micro_batch=2"])
    assert cfg.parallel.dp == "auto"
    assert cfg.resolve_world(4).parallel.dp == 2 and cfg.resolve_world(8).parallel.dp == 4
    assert cfg.parallel.dp == "auto"  # resolving makes a new config
    with pytest.raises(ConfigError, match=r'parallel.dp: "auto" on 5 processes: not divisible by tp×pp×cp = '
                                          r"2×1×1 = 2"):
        cfg.resolve_world(5)
    with pytest.raises(ConfigError, match=r"train.global_batch: 8 is not divisible by parallel.dp × "
                                          r"train.micro_batch = 8 × 2"):
        cfg.resolve_world(16)
    with pytest.raises(ConfigError, match=r'parallel.dp: expected an integer or "auto", got \'many\''):
        load_config(None, ["parallel.dp=many"])
    # Before any process starts: "auto" needs to know how many there will be.
    assert main(["train", "--set", "parallel.dp=auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['error: parallel.dp: "auto" takes the data-parallel degree from the number of processes; '
                   "give --nproc N (or start the ranks with torchrun)"]
    assert main(["train", "--set", "parallel.dp=auto", "--set", "parallel.tp=2", "--nproc", "3"]) == 2
    assert capsys.readouterr().err.strip() == ('error: parallel.dp: "auto" on 3 processes: not divisible by '
                                               "tp×pp×cp = 2×1×1 = 2")
