"""Bad metrics files and flags given to the commands that read a run's metrics: ``threefold schedule
--from-metrics``, ``threefold compare`` and ``threefold calibrate --from-runs``. Each is answered
with exit code 2 and one line on stderr naming the file (and line, and key), never a traceback or
a silent success; calibrate writes no profile. Damaged copies of the recorded runs, in-process."""
import json
from pathlib import Path

import pytest

from threefold.cli import main

RUNS = Path(__file__).resolve().parents[1] / "bench" / "results" / "planner_runs"  # recorded runs (manifest.json)
DEMO = RUNS / "demo.jsonl"  # the demo's pipeline run (demo.toml: dp=2 tp=2 pp=2, 1F1B), with timelines


@pytest.fixture(autouse=True)
def recorded_profile(request, monkeypatch):
    """calibrate --from-runs reads the machine profile the runs were measured with (recorded beside
    them), not whatever this machine's cache holds, or lacks: a clean machine has none."""
    if request.node.name.startswith("test_calibrate_from_runs"):
        monkeypatch.setenv("THREEFOLD_HOME", str(RUNS))


def records(path: Path, count: int = 3) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:count]]


def write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def damaged(tmp_path: Path, damage, source: Path = DEMO, count: int = 3) -> Path:
    """A copy of the first ``count`` records of ``source`` with ``damage(last record)`` applied."""
    rows = records(source, count)
    damage(rows[-1])
    return write(tmp_path / "damaged.jsonl", rows)


def half_written(tmp_path: Path, source: Path = DEMO, count: int = 3) -> Path:
    """A run killed mid-write: its last line cut in half."""
    lines = source.read_text().splitlines()[:count]
    path = tmp_path / "half.jsonl"
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:len(lines[-1]) // 2])
    return path


def one_error(capsys, args) -> str:
    """Run the CLI; assert exit 2 and exactly one stderr line, ``error: …``; return that line."""
    code = main(args)
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def setter(*keys, value):
    """A damage: set record[keys[0]]...[keys[-1]] = value (``pop`` to remove the key)."""
    def damage(record):
        for key in keys[:-1]:
            record = record[key]
        if value == "pop":
            record.pop(keys[-1])
        else:
            record[keys[-1]] = value
    return damage


# ------------------------------------------------------------------ schedule --from-metrics

TIMELINE_DAMAGE = {
    "microbatches missing": (setter("timeline", "microbatches", value="pop"), "'microbatches'"),
    "pp a string": (setter("timeline", "pp", value="two"), "timeline['pp']"),
    "pp null": (setter("timeline", "pp", value=None), "timeline['pp']"),
    "pp not the ranks'": (setter("timeline", "pp", value=3), "pp=3"),
    "schedule unknown": (setter("timeline", "schedule", value="nope"), "timeline['schedule']"),
    "schedule a number": (setter("timeline", "schedule", value=7), "timeline['schedule']"),
    "microbatches more than recorded": (setter("timeline", "microbatches", value=10**9), "compute actions"),
    "ranks empty lists": (setter("timeline", "ranks", value=[[], []]), "timeline['ranks'][0]"),
    "ranks null": (setter("timeline", "ranks", value=None), "timeline['ranks']"),
    "short event": (lambda r: r["timeline"]["ranks"][0].__setitem__(0, [0.0, 1.0]), "timeline['ranks'][0]"),
    "null event": (lambda r: r["timeline"]["ranks"][1].__setitem__(0, None), "timeline['ranks'][1]"),
    "null time": (lambda r: r["timeline"]["ranks"][0][0].__setitem__(1, None), "timeline['ranks'][0]"),
    "unknown kind": (lambda r: r["timeline"]["ranks"][0][0].__setitem__(2, "X"), "kind 'X'"),
    "stage out of range": (lambda r: r["timeline"]["ranks"][0][0].__setitem__(4, 9), "stage"),
    "timeline a string": (setter("timeline", value="x"), "timeline"),
    "stage_layers strings": (setter("timeline", "stage_layers", value=["a", "b"]), "stage_layers"),
}


@pytest.mark.parametrize("case", TIMELINE_DAMAGE)
def test_schedule_from_metrics_refuses_a_damaged_timeline(tmp_path, capsys, case):
    damage, said = TIMELINE_DAMAGE[case]
    path = damaged(tmp_path, damage)
    line = one_error(capsys, ["schedule", "--from-metrics", str(path)])
    assert line.startswith(f"error: --from-metrics: {path} line 3 ") and said in line, line
    assert "parallel." not in line  # the metrics file is wrong, not a config


def test_schedule_from_metrics_refuses_a_file_that_is_not_json(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not json at all\n")
    line = one_error(capsys, ["schedule", "--from-metrics", str(path)])
    assert line.startswith(f"error: --from-metrics: {path} line 1 ")


def test_schedule_from_metrics_names_the_half_written_line(tmp_path, capsys):
    path = half_written(tmp_path)
    line = one_error(capsys, ["schedule", "--from-metrics", str(path)])
    assert line.startswith(f"error: --from-metrics: {path} line 3 ") and "mid-write" in line


def test_schedule_from_metrics_still_reads_a_whole_run(tmp_path, capsys):
    path = write(tmp_path / "ok.jsonl", records(DEMO))
    assert main(["schedule", "--from-metrics", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pp"] == 2 and len(report["measured_idle"]) == 2


@pytest.mark.parametrize("flag,value", [("--pp", "3"), ("--schedule", "gpipe"), ("--microbatches", "2"),
                                        ("--virtual-stages", "2"), ("--backward-ratio", "3"),
                                        ("--weight-grad-share", "0.2"), ("--p2p-ratio", "0.1"), ("--actions", None)])
def test_schedule_from_metrics_refuses_layout_flags_it_would_ignore(tmp_path, capsys, flag, value):
    path = write(tmp_path / "ok.jsonl", records(DEMO))
    line = one_error(capsys, ["schedule", "--from-metrics", str(path), flag, *([value] if value else [])])
    assert line.startswith(f"error: {flag}: ") and "--from-metrics" in line


@pytest.mark.parametrize("flag,value", [("--backward-ratio", "nan"), ("--backward-ratio", "inf"),
                                        ("--weight-grad-share", "nan"), ("--p2p-ratio", "nan"),
                                        ("--p2p-ratio", "inf")])
@pytest.mark.parametrize("as_json", [False, True])
def test_schedule_refuses_costs_that_are_not_finite(capsys, flag, value, as_json):
    line = one_error(capsys, ["schedule", flag, value, *(["--json"] if as_json else [])])
    assert line.startswith(f"error: {flag}: ") and "finite" in line


# ------------------------------------------------------------------ compare

RECORD_DAMAGE = {
    "step_time_s a string": (setter("step_time_s", value="x"), "'step_time_s'"),
    "step_time_s null": (setter("step_time_s", value=None), "'step_time_s'"),
    "step_time_s NaN": (setter("step_time_s", value=float("nan")), "'step_time_s'"),
    "step_time_s infinite": (setter("step_time_s", value=float("inf")), "'step_time_s'"),
    "step_time_s negative": (setter("step_time_s", value=-1.0), "'step_time_s'"),
    "step_time_s true": (setter("step_time_s", value=True), "'step_time_s'"),
    "step_time_s huge integer": (setter("step_time_s", value=10**400), "'step_time_s'"),
    "memory a string": (setter("memory", value="lots"), "'memory'"),
    "memory value a string": (setter("memory", "params", value="x"), "memory['params']"),
    "memory value negative": (setter("memory", "grads", value=-5), "memory['grads']"),
    "memory without activations": (setter("memory", "activations", value="pop"), "'activations'"),
    "comm_bytes a list": (setter("comm_bytes", value=[1, 2]), "'comm_bytes'"),
    "comm_bytes value a string": (setter("comm_bytes", "dp", value="x"), "comm_bytes['dp']"),
    "comm_exposed_s a string": (setter("comm_exposed_s", value="x"), "'comm_exposed_s'"),
    "comm_exposed_call_least_s value null": (setter("comm_exposed_call_least_s", "tp", value=None),
                                             "comm_exposed_call_least_s['tp']"),
    "step a string": (setter("step", value="3"), "'step'"),
    "timeline pp a string": (setter("timeline", "pp", value="two"), "timeline['pp']"),
}


def compare_args(path: Path) -> list[str]:
    return ["compare", "--config", str(RUNS / "demo.toml"), "--metrics-file", str(path)]


@pytest.mark.parametrize("case", RECORD_DAMAGE)
def test_compare_refuses_a_field_of_the_wrong_type_or_value(tmp_path, capsys, case):
    damage, said = RECORD_DAMAGE[case]
    path = damaged(tmp_path, damage)
    line = one_error(capsys, compare_args(path))
    assert line.startswith(f"error: --metrics-file: {path} line 3 ") and said in line, line


def test_compare_names_the_half_written_line(tmp_path, capsys):
    path = half_written(tmp_path)
    line = one_error(capsys, compare_args(path))
    assert line.startswith(f"error: --metrics-file: {path} line 3 ") and "mid-write" in line


# ------------------------------------------------------------------ calibrate --from-runs

def calibrate_refuses(tmp_path, capsys, bad):
    """The one error line of ``calibrate --from-runs`` given the run ``bad`` beside a good one, and
    its spec; the profile it would have written is not there."""
    out = tmp_path / "profile.json"
    spec = f"{RUNS / 'ddp.toml'}:{bad}"
    line = one_error(capsys, ["calibrate", "--from-runs", spec, f"{RUNS / 'tp.toml'}:{RUNS / 'tp.jsonl'}",
                              "--out", str(out)])
    assert not out.exists()
    return line, spec


def test_calibrate_from_runs_refuses_a_bad_metrics_file_and_writes_nothing(tmp_path, capsys):
    """``"memory": "lots"`` was fitted anyway and the profile written: refused first, naming the
    run as the user gave it."""
    bad = damaged(tmp_path, setter("memory", value="lots"), RUNS / "ddp.jsonl", count=4)
    line, spec = calibrate_refuses(tmp_path, capsys, bad)
    assert line.startswith(f"error: --from-runs {spec}: {bad} line 4 ") and "'memory'" in line


@pytest.mark.parametrize("damage", [
    setter("step_time_s", value="x"), setter("step_time_s", value=float("nan")), setter("comm_bytes", value=[1]),
    setter("memory", "params", value="x")])
def test_calibrate_from_runs_refuses_malformed_records(tmp_path, capsys, damage):
    bad = damaged(tmp_path, damage, RUNS / "ddp.jsonl", count=4)
    line, spec = calibrate_refuses(tmp_path, capsys, bad)
    assert line.startswith(f"error: --from-runs {spec}: {bad} line 4 ")


def test_calibrate_from_runs_names_the_half_written_line(tmp_path, capsys):
    bad = half_written(tmp_path, RUNS / "ddp.jsonl", count=4)
    line, spec = calibrate_refuses(tmp_path, capsys, bad)
    assert line.startswith(f"error: --from-runs {spec}: {bad} line 4 ") and "mid-write" in line


def test_calibrate_from_runs_names_the_run_of_an_empty_metrics_file(tmp_path, capsys):
    """Not ``--metrics-file``, an option calibrate does not have: the run as the user gave it."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "profile.json"
    spec = f"{RUNS / 'ddp.toml'}:{empty}"
    line = one_error(capsys, ["calibrate", "--from-runs", spec, f"{RUNS / 'tp.toml'}:{RUNS / 'tp.jsonl'}",
                              "--out", str(out)])
    assert line == f"error: --from-runs {spec}: {empty} holds no steps"
    assert "--metrics-file" not in line and not out.exists()


def test_calibrate_from_runs_names_the_manifest_run(tmp_path, capsys):
    bad = damaged(tmp_path, setter("memory", value="lots"), RUNS / "ddp.jsonl", count=4)
    manifest = tmp_path / "runs.json"
    manifest.write_text(json.dumps({"ddp": {"config": str(RUNS / "ddp.toml"), "metrics": str(bad)},
                                    "tp": {"config": str(RUNS / "tp.toml"), "metrics": str(RUNS / "tp.jsonl")}}))
    out = tmp_path / "profile.json"
    line = one_error(capsys, ["calibrate", "--from-runs", str(manifest), "--out", str(out)])
    assert line.startswith(f"error: --from-runs {manifest}: run 'ddp': {bad} line 4 ")
    assert not out.exists()


def test_calibrate_from_runs_refuses_a_config_section_that_is_not_a_table(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("parallel = 3\n")
    out = tmp_path / "profile.json"
    one_error(capsys, ["calibrate", "--from-runs", f"{config}:{RUNS / 'ddp.jsonl'}",
                       f"{RUNS / 'tp.toml'}:{RUNS / 'tp.jsonl'}", "--out", str(out)])
    assert not out.exists()
