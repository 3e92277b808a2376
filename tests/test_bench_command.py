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


def test_the_list_says_what_each_benchmark_measures(capsys):
    """Without NAME: each benchmark beside the first paragraph of its docstring, as `threefold
    --help` lists the commands (a name alone said nothing of what it measures)."""
    from threefold.bench_commands import available, summary
    from threefold.cli import main

    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == "Benchmarks:"
    flat = " ".join(out.split())  # the descriptions wrap at the terminal's width
    for name in available():
        assert any(line.startswith(f"  {name} ") for line in lines), name
        assert f"{name} {summary(name)}" in flat and summary(name), name
    assert "generate Generation with the key/value cache against generation without it" in flat
    assert "`threefold bench NAME --help` shows its options" in flat
    assert main(["bench", "--help"]) == 0
    assert "Benchmarks:\n  checkpoint_vs_torch " in capsys.readouterr().out


def test_a_summary_is_the_first_paragraph_on_one_line(tmp_path, monkeypatch):
    from threefold import bench_commands

    monkeypatch.setattr(bench_commands, "BENCH_DIR", tmp_path)
    (tmp_path / "short.py").write_text('"""Our ``thing`` against theirs,\non this CPU.\n\nDetails."""\n')
    (tmp_path / "long.py").write_text('"""Balanced stages, measured: ' + "each rank's idle share " * 8 + '."""\n')
    (tmp_path / "bare.py").write_text("import os\n")
    (tmp_path / "example.py").write_text('"""Record it, in one command:\n\n    python example.py\n"""\n')
    assert bench_commands.summary("short") == "Our `thing` against theirs, on this CPU"
    assert bench_commands.summary("long") == "Balanced stages, measured"
    assert bench_commands.summary("bare") == ""
    assert bench_commands.summary("example") == "Record it, in one command"


def test_a_mistyped_name_gets_the_closest(capsys):
    from threefold.cli import main

    assert main(["bench", "dp_vs_torc"]) == 2
    assert capsys.readouterr().err.strip() == ("error: unknown benchmark 'dp_vs_torc'; did you mean dp_vs_torch? "
                                               "(see `threefold bench --help`)")
    assert main(["bench", "zzz"]) == 2
    assert "error: unknown benchmark 'zzz'; known: checkpoint_vs_torch, " in capsys.readouterr().err
