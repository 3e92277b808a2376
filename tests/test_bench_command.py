"""``threefold bench``: NAME --help is the benchmark's own help; --help alone is the wrapper's."""
import os
import subprocess
import sys


def threefold(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "threefold.cli", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))


def test_bench_name_help_is_the_benchmarks():
    run = threefold("bench", "generate", "--help")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Usage: generate.py") and "--tokens" in run.stdout and "--repeats" in run.stdout


def test_bench_help_is_the_wrappers():
    run = threefold("bench", "--help")
    assert run.returncode == 0 and "Run bench/NAME.py" in run.stdout
    assert "generate" in threefold("bench").stdout.split()  # without NAME: the list
