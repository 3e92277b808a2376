"""``threefold bench``: run the benchmarks under bench/ of a source checkout."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


SHARED = {"common"}  # bench/common.py holds what the benchmarks share; it is not one


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem not in SHARED) if BENCH_DIR.is_dir() else []


# --help after NAME belongs to the benchmark (its own options); before it, to this command.
@click.command(context_settings={"ignore_unknown_options": True, "help_option_names": []})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def bench(ctx, name, args):
    """Run bench/NAME.py (with ARGS; NAME --help shows its options); without NAME, list the benchmarks."""
    if name in ("-h", "--help"):
        click.echo(ctx.get_help())
        return
    names = available()
    if not names:
        raise click.UsageError(f"no benchmarks found in {BENCH_DIR} (they ship with the source checkout)")
    if name is None:
        click.echo("\n".join(names))
        return
    if name not in names:
        raise click.UsageError(f"unknown benchmark {name!r} (known: {', '.join(names)})")
    sys.exit(subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *args]))
