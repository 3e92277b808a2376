"""``--help`` as a new user reads it: every option says what it does, and what a command accepts or
writes is what its help says."""
from __future__ import annotations

import click
import pytest

from threefold.cli import cli, main


def help_of(capsys, *command: str) -> str:
    assert main([*command, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # one line: the help wraps where the terminal ends


@pytest.mark.parametrize("command, wanted", [
    (["generate"], ["--prompt TEXT Text the sample continues"]),
    (["data", "prepare"], ["--tokenizer bpe|gpt2|FILE", "tokenizer.json", "--val-fraction FLOAT Share of the corpus",
                           "--cache-dir TEXT Folder of the tokenized corpora", "--allow-binary"]),
    (["train"], ["optional: without it, the defaults", "Show the progress bar. [default: progress]"]),
    (["export"], ["MixtralForCausalLM", "tokenizer_config.json"]),
    (["estimate"], ["--tie-embeddings / --no-tie-embeddings The output head shares",
                    "--sequence-parallel / --no-sequence-parallel With --tp > 1",
                    "Pipeline schedule, used with --pp > 1"]),
])
def test_help_says_what_each_option_does(capsys, command, wanted):
    text = help_of(capsys, *command)
    for phrase in wanted:
        assert phrase in text, (phrase, text)


@pytest.mark.parametrize("command", [["train"], ["generate"], ["inspect"], ["data", "prepare"], ["export"],
                                     ["import"], ["estimate"]])
def test_no_option_goes_without_help(command):
    found, ctx = cli, click.Context(cli)
    for name in command:
        found = found.get_command(ctx, name)
    bare = [p.opts[0] for p in found.params if isinstance(p, click.Option) and not p.help and not p.hidden]
    assert bare == [], bare
