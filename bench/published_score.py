"""Score the planner on the published runs of data/published_calibration.json, the way a
held-out set is scored: each run becomes one line of ``threefold estimate --batch``, and the
predicted MFU is compared with the measured one (converted to the planner's convention: model
FLOPs 6·N + 12·L·s·(heads·head_dim) per token, non-causal attention, no recompute).

    .venv/bin/python bench/published_score.py [--json]

Prints each run's measured and predicted MFU, its predicted peak memory (and the measured one where
published) and whether it fits, the mean absolute percentage
error of MFU over all runs and per study, and the rank correlation within each study. Runs
without a global batch, or with only memory figures, are left out (listed at the end).
Where a run does not state its micro-batch, the line leaves it (and the schedule) out, and
``estimate`` takes the fastest that fits, as the authors tuned theirs.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "published_calibration.json"
# Each run's GPU: a catalog name, or a --cluster file for a part the catalog lacks (torchtitan's
# 96 GB HBM2e H100 at 500 W: its stated memory and bandwidth, the SXM5 peak the source prices it at).
GPUS = {"A100-SXM4-80GB": {"gpu": "a100-80gb"}, "a100_80gb": {"gpu": "a100-80gb"}, "h100_80gb": {"gpu": "h100-sxm"},
        "H100-SXM5-80GB": {"gpu": "h100-sxm"},
        "H100 96GB HBM2e @500W (Grand Teton)": {"cluster": str(ROOT / "bench" / "clusters" / "h100-96gb-hbm2e-500w.toml")}}


def batch_line(row: dict) -> dict:
    """The --batch line of one run; what it does not state left out for estimate to tune."""
    m, par, batch, hw = row["model"], row["parallelism"], row["batch"], row["hardware"]
    llama = m.get("kv_heads") is not None or "llama" in row["id"]
    recompute = row["recompute"] or "none"
    recompute = "full" if recompute.startswith("full") else "none" if recompute.startswith("none") else "selective"
    zero = 3 if par.get("fsdp") else (par.get("zero_stage") or (1 if "megatron_core" in row["group"] else 0))
    base = {"arch": "llama" if llama else "gpt", "layers": m["layers"], "hidden": m["hidden"], "heads": m["heads"],
            "kv_heads": m["kv_heads"], "ffn": m["ffn"], "vocab": m["vocab"], "seq_len": m["seq_len"],
            "tie_embeddings": not llama and "untied" not in (m.get("notes") or ""), "global_batch": batch["global_batch_seqs"],
            **GPUS[hw["gpu"]], "num_gpus": hw["num_gpus"], "gpus_per_node": hw.get("gpus_per_node") or 8,
            "tp": par["tp"], "pp": par["pp"], "dp": par["dp"], "zero": zero, "recompute": recompute,
            "sequence_parallel": bool(par["sequence_parallel"]) or (par["tp"] > 1 and "megatron_core" in row["group"]),
            "attention": "eager" if row["group"].startswith("korthikanti") else "flash"}
    if "megatron_core" in row["group"]:
        base["tp_comm_overlap"] = True  # the runs' stated flags (--tp-comm-overlap)
    if "fp8" in (row.get("precision") or "").lower():
        base["dtype"] = "float8"  # the blocks' products in fp8 (Transformer Engine, torchao)
    v = par.get("virtual_stages") or 1
    if batch.get("micro_batch"):
        return dict(base, micro_batch=batch["micro_batch"], virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b")
    return base


def measured_tokens_per_s_per_gpu(row: dict) -> float | None:
    got, m, hw = row["measured"], row["model"], row["hardware"]
    if got.get("tokens_per_s_per_gpu"):
        return got["tokens_per_s_per_gpu"]
    if got.get("step_time_s"):
        return row["batch"]["global_batch_seqs"] * m["seq_len"] / got["step_time_s"] / hw["num_gpus"]
    implied = (row.get("derived") or {}).get("implied_step_time_s")
    if implied:
        return row["batch"]["global_batch_seqs"] * m["seq_len"] / implied / hw["num_gpus"]
    return None


def spearman(a, b) -> float:
    """Rank correlation; with two runs, +1 when they are in the same order, −1 otherwise."""
    if len(a) < 2:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def score(published: list[dict]) -> dict:
    scored = []
    rows = [row for row in published if row["batch"].get("global_batch_seqs") and measured_tokens_per_s_per_gpu(row)]
    skipped = [row["id"] for row in published if row not in rows]
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "threefold"), "estimate", "--batch", "/dev/stdin"],
                         input="\n".join(json.dumps(batch_line(row)) for row in rows), capture_output=True,
                         text=True, check=True)
    for row, text in zip(rows, out.stdout.splitlines()):
        best = json.loads(text)
        measured = measured_tokens_per_s_per_gpu(row)
        if "error" in best:
            skipped.append(f"{row['id']} ({best['error']})")
            continue
        predicted = best["tokens_per_s"] / best["num_gpus"]
        mfu_measured = best["mfu"] * measured / predicted  # same FLOPs per token and peak on both sides
        scored.append({"id": row["id"], "group": row["group"], "mfu_measured": mfu_measured, "mfu_predicted": best["mfu"],
                       "error": best["mfu"] / mfu_measured - 1, "fits": best["fits"],
                       "memory_gib_predicted": best["memory_gib"]["total"],
                       "memory_gib_measured": row["measured"].get("peak_memory_gib")})
    errors = np.array([abs(s["error"]) for s in scored])
    groups = sorted({s["group"] for s in scored})
    per_group = {g: {"mape": float(np.mean([abs(s["error"]) for s in scored if s["group"] == g])),
                     "rank_correlation": spearman([s["mfu_measured"] for s in scored if s["group"] == g],
                                                  [s["mfu_predicted"] for s in scored if s["group"] == g]),
                     "runs": sum(s["group"] == g for s in scored)} for g in groups}
    return {"runs": scored, "mape": float(errors.mean()), "per_study": per_group, "skipped": skipped,
            "predicted_not_fitting": [s["id"] for s in scored if not s["fits"]]}


@click.command()
@click.option("--json", "as_json", is_flag=True)
def main(as_json):
    result = score(json.loads(DATA.read_text()))
    if as_json:
        click.echo(json.dumps(result, indent=1))
        return
    for s in result["runs"]:
        memory = f"  {s['memory_gib_predicted']:5.1f} GiB" + (f" (measured {s['memory_gib_measured']:.1f})"
                                                              if s["memory_gib_measured"] else "")
        click.echo(f"{s['id']:45s} measured {s['mfu_measured']:6.1%}  predicted {s['mfu_predicted']:6.1%}  "
                   f"{s['error']:+6.1%}{memory}{'' if s['fits'] else '  (predicted not to fit)'}")
    click.echo(f"MFU MAPE {result['mape']:.1%} over {len(result['runs'])} runs")
    for g, v in result["per_study"].items():
        click.echo(f"  {g:40s} MAPE {v['mape']:5.1%}  rank correlation {v['rank_correlation']:+.2f}  ({v['runs']} runs)")
    click.echo("left out: " + ", ".join(result["skipped"]))


if __name__ == "__main__":
    sys.exit(main())
