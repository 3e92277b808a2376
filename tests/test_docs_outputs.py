"""The docs teach with the planner's own output: every ``$ threefold plan`` or ``estimate`` block
under docs/ is what the command prints today, line for line (the search's timing aside), at the
120 columns the docs were printed at. A change to the cost model that moves a number the docs
show fails here until the docs are printed again:

    .venv/bin/python tests/test_docs_outputs.py     # rewrites every such block with today's output

(then read the prose around each block: it quotes the same numbers)."""
import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import pytest

from threefold.cli import main

DOCS = Path(__file__).resolve().parents[1] / "docs"
TIMING = re.compile(r" in [\d.]+ s \([\d,]+ layouts/s\)")
COLUMNS = "120"


def documented_blocks(doc: Path) -> list[tuple[str, int, int]]:
    """(command, first line, end line) of the output under each plan or estimate block of a doc."""
    lines, blocks = doc.read_text().split("\n"), []
    for i, line in enumerate(lines):
        if not re.match(r"\$ threefold (plan|estimate) ", line):
            continue
        command, j = line[len("$ threefold "):], i
        while command.endswith("\\"):
            j += 1
            command = command[:-1] + " " + lines[j].strip()
        blocks.append((command, j + 1, next(k for k in range(j + 1, len(lines)) if lines[k].startswith("```"))))
    return blocks


def every_block():
    return [pytest.param(doc, command, start, end, id=f"{doc.name}:{start}")
            for doc in sorted(DOCS.glob("*.md")) for command, start, end in documented_blocks(doc)]


def _comparable(lines):
    return [TIMING.sub(" in … s", line.rstrip()) for line in lines]


@pytest.mark.parametrize("doc, command, start, end", every_block())
def test_a_docs_block_is_what_the_command_prints(capsys, monkeypatch, doc, command, start, end):
    monkeypatch.setenv("COLUMNS", COLUMNS)
    assert main(shlex.split(command)) == 0
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert _comparable(printed) == _comparable(doc.read_text().split("\n")[start:end])


def test_the_blocks_are_found():
    """The docs' plans and estimates all take part (a change of prompt would drop them silently)."""
    commands = [block.values[1] for block in every_block()]
    assert len(commands) >= 8 and sum(c.startswith("plan ") for c in commands) >= 7


def reprint() -> None:
    """Rewrite every block with what its command prints now (last block first, so the line
    numbers of the earlier ones hold)."""
    os.environ["COLUMNS"] = COLUMNS
    for doc in sorted(DOCS.glob("*.md")):
        lines = doc.read_text().split("\n")
        for command, start, end in reversed(documented_blocks(doc)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                main(shlex.split(command))
            lines[start:end] = out.getvalue().rstrip("\n").split("\n")
        doc.write_text("\n".join(lines))


if __name__ == "__main__":
    reprint()
