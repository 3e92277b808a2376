"""``threefold bench``: run the benchmarks under bench/ of a source checkout."""
from __future__ import annotations

import ast
import difflib
import subprocess
import sys
from pathlib import Path

import click

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


SHARED = {"common"}  # bench/common.py holds what the benchmarks share; it is not one


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in SHARED) if BENCH_DIR.is_dir() else []


SUMMARY_CHARS = 160  # a first paragraph longer than this is cut at its first colon


def summary(name: str) -> str:
    """What bench/NAME.py measures: its docstring's first paragraph on one line, a long one up to
    its first colon (what names it; the rest details it). The source is parsed, not imported:
    importing would load torch for each."""
    doc = ast.get_docstring(ast.parse((BENCH_DIR / f"{name}.py").read_text(encoding="utf-8"))) or ""
    # no final stop, as click's short help; nor a colon, which introduced an example
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "`").rstrip(".:")
    return text.split(": ")[0] if len(text) > SUMMARY_CHARS else text


class BenchCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The benchmarks, as `threefold --help` lists the commands."""
        write_listing(formatter)
        super().format_epilog(ctx, formatter)


def write_listing(formatter: click.HelpFormatter) -> None:
    names = available()
    if names:
        with formatter.section("Benchmarks"):
            formatter.write_dl([(name, summary(name)) for name in names])


# --help after NAME belongs to the benchmark (its own options); before it, to this command.
@click.command(cls=BenchCommand, options_metavar="[--help]",
               context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx, name, args):
    """Run bench/NAME.py (with ARGS; NAME --help shows its options); without NAME, list the benchmarks
    and what each measures."""
    if name in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    names = available()
    if not names:
        raise click.UsageError(f"no benchmarks found in {BENCH_DIR} (they ship with the source checkout)")
    if name is None:
        formatter = ctx.make_formatter()
        write_listing(formatter)
        click.echo(formatter.getvalue().rstrip("\n"))
        click.echo("\nRun one with `threefold bench NAME [ARGS]`; `threefold bench NAME --help` shows its options.")
        return
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        raise click.UsageError(f"unknown benchmark {name!r}; "
                               + (f"did you mean {close[0]}?" if close else f"known: {', '.join(names)}"))
    sys.exit(subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *args]))
