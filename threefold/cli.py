"""The ``threefold`` command. Each sub-command lives beside the code it drives and is imported
only when it runs, so ``threefold plan`` never pays for importing torch's distributed stack.

Every user error (``ConfigError``, a bad flag) ends as one line on stderr and exit code 2.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import click

from threefold.config import ConfigError

# name → (module, attribute, one-line help)
COMMANDS = {
    "train": ("threefold.train.commands", "train", "Train a model from a TOML config."),
    "generate": ("threefold.train.commands", "generate", "Generate text from a checkpoint."),
    "inspect": ("threefold.train.commands", "inspect", "Show what a checkpoint holds and which rank wrote which piece."),
    "data": ("threefold.data.commands", "data", "Prepare corpora and tokenizers."),
    "estimate": ("threefold.plan.commands", "estimate", "Predict memory, communication and step time of one layout."),
    "plan": ("threefold.plan.commands", "plan", "Search layouts for the fastest one that fits."),
    "schedule": ("threefold.plan.schedule_command", "schedule", "Draw a pipeline schedule and print its bubble."),
    "dryrun": ("threefold.train.dryrun", "dryrun", "One real training step of rank R of a large job, on fake tensors."),
    "compare": ("threefold.plan.compare", "compare", "Compare a run's measurements with the planner's prediction."),
    "calibrate": ("threefold.plan.calibrate", "calibrate", "Measure this machine for the planner."),
    "export": ("threefold.interop.commands", "export_cmd", "Write a checkpoint as a Hugging Face folder (LlamaForCausalLM, or MixtralForCausalLM with experts)."),
    "import": ("threefold.interop.commands", "import_cmd", "Read an HF Llama or Mixtral folder or a GGUF file (or smollm2) into a checkpoint."),
    "bench": ("threefold.bench_commands", "bench", "Run the benchmarks under bench/."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for name, (module, _, _) in COMMANDS.items() if importlib.util.find_spec(module)]

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as err:
            if err.name == module:
                return None
            raise

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        if not rows:
            return
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="threefold")
def cli():
    """threefold: train Llama-style models (dense and MoE) with data, tensor, pipeline, context and expert
    parallelism, and plan how."""


def main(argv=None) -> int:
    try:
        cli.main(args=argv, prog_name="threefold", standalone_mode=False)
    except ConfigError as err:
        click.echo(f"error: {err}", err=True)
        return 2
    except click.exceptions.Exit as ex:
        return ex.exit_code
    except click.exceptions.Abort:  # Ctrl-C reaches every rank of a job: one of them says it
        if os.environ.get("RANK", "0") == "0":
            click.echo("aborted", err=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # A rank of a job leaves at once, as on a broken group (train/commands.py): the
            # interpreter's teardown can destroy a native thread of the process group still
            # running, and the C++ runtime's "terminate called …" would follow "aborted"
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    except click.exceptions.NoArgsIsHelpError as err:  # `threefold`, `threefold data`: what there is to run
        click.echo(err.ctx.get_help())
        return 0
    except click.UsageError as err:  # a bad flag or value: one line, as every other bad input
        command = f"{err.ctx.command_path} --help" if err.ctx else "threefold --help"
        click.echo(f"error: {err.format_message()} (see `{command}`)", err=True)
        return 2
    except click.ClickException as err:
        err.show()
        return 2 if isinstance(err, click.UsageError) or err.exit_code == 2 else err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
