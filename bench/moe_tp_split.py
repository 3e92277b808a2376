"""An MoE model under tensor parallelism: the experts repeated on every tp rank (no SP), split
over the tp ranks by sequence position (SP), and the ep group folded over the tp ranks (each
holding half the experts), side by side in one run.

Two gloo processes (one thread each) train the same MoE model on the same batches twice in the
same processes: tp=2 without sequence parallelism, where every tp rank runs each MoE block's
experts on the whole sequence (``ReplicatedMoE``: the experts' work is repeated on both ranks),
and tp=2 with it, where every rank routes the whole gathered sequence but runs the experts and
shared experts on its own s/t positions only (``SequenceSplitMoE``, parallel/tensor_parallel.py);
the MoE blocks' gradients are then partial sums over tp, all-reduced once a step (ledger key
"tp.partial_grads"); and folded (``parallel.expert_tp = 1``, ep = tp = 2, SP), where each rank
holds 4 of the 8 experts and routes its own positions, whose rows for the other rank's experts
cross in all-to-alls (ledger key "ep"; parallel/expert_parallel.py). Same seed, weights and
batches; the steps alternate. Reported per side: the median step time (the slowest rank), the
bytes per step and rank by ledger key and the median seconds a rank was blocked on each; and the
ratios split / repeated and folded / split of the step time. Every side computes one process's
loss, so their losses must agree to rounding (checked against ``--tolerance``; the script fails
otherwise).

    .venv/bin/python bench/moe_tp_split.py    # writes bench/results/moe_tp_split.json
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
from pathlib import Path

import click
import torch
from rich.console import Console

from threefold.config import Config
from threefold.models.presets import get_preset
from threefold.models.sizes import attention_width, moe_layer_count
from threefold.train.engine import build_engine

from common import alternate_steps, dp_rows_step, fresh_model, join_gloo, report_sides, same_losses, spawn_ranks

RESULTS = Path(__file__).parent / "results" / "moe_tp_split.json"
WORLD = TP = 2
SIDES = {"repeated": (False, False), "split": (True, False), "folded": (True, True)}  # name → (SP, folded)


def bench_config(sequence_parallel: bool, seq_len: int, micro_batch: int, microbatches: int,
                 folded: bool = False) -> Config:
    cfg = Config()
    cfg.model = get_preset("tiny-moe")
    cfg.model.vocab_size, cfg.model.seq_len = 4096, seq_len
    cfg.train.micro_batch, cfg.train.global_batch = micro_batch, micro_batch * microbatches  # dp = 1
    cfg.parallel.tp, cfg.parallel.sequence_parallel = TP, sequence_parallel
    if folded:  # the ep group is the tp group: each rank holds half the experts
        cfg.parallel.ep, cfg.parallel.expert_tp = TP, 1
    return cfg.validate()  # checks that tp divides the heads, kv heads and (with SP) the sequence


def expert_share(cfg: Config) -> float:
    """The experts' share of the forward matmul FLOPs per token on one process (routed top-k and
    shared experts against attention's projections and scores, the router and the head)."""
    m = cfg.model
    q, kv = attention_width(m)
    attention = m.hidden * (2 * q + 2 * kv) + 2 * m.seq_len * q  # wq, wk, wv, wo; QKᵀ and AV, unmasked
    experts = 3 * m.hidden * m.moe_ffn * (m.moe_top_k + m.moe_shared_experts)
    moe_layers = moe_layer_count(m)
    dense = (m.layers - moe_layers) * 3 * m.hidden * m.ffn_hidden
    total = m.layers * attention + moe_layers * (experts + m.hidden * m.moe_experts) + dense + m.hidden * m.vocab_size
    return moe_layers * experts / total


def worker(rank, world, port, args, queue):
    join_gloo(rank, world, port, threads=1, timeout_s=600)
    seq_len, micro_batch, microbatches, warmup, steps = args
    engines = {name: build_engine(fresh_model(cfg), cfg) for name, cfg in
               ((name, bench_config(sp, seq_len, micro_batch, microbatches, folded))
                for name, (sp, folded) in SIDES.items())}
    sent = {name: {} for name in engines}
    blocked = {name: [] for name in engines}  # per step: seconds blocked per ledger key

    def side(name):
        engine = engines[name]

        def step(inputs, targets):
            loss = dp_rows_step(engine, inputs, targets)
            sent[name], waited = engine.comm.ledger.take_step()
            blocked[name].append(waited)
            return loss
        return step

    out = alternate_steps(engines["split"].cfg, {name: side(name) for name in engines}, warmup, steps)
    memory = {name: engine.memory_bytes() for name, engine in engines.items()}
    waits = {name: {key: statistics.median(step.get(key, 0.0) for step in blocked[name][warmup:])
                    for key in sent[name]} for name in engines}
    report_sides(rank, queue, engines, out, {"bytes": sent, "memory": memory, "blocked_s": waits})


@click.command()
@click.option("--seq-len", default=256, show_default=True)
@click.option("--micro-batch", default=4, show_default=True)
@click.option("--microbatches", default=4, show_default=True)
@click.option("--warmup", default=1, show_default=True)
@click.option("--steps", default=8, show_default=True)
@click.option("--tolerance", default=1e-4, show_default=True, help="largest loss difference allowed between the sides")
def main(seq_len, micro_batch, microbatches, warmup, steps, tolerance):
    console = Console()
    load_before = os.getloadavg()
    result = spawn_ranks(WORLD, worker, (seq_len, micro_batch, microbatches, warmup, steps))
    load_after = os.getloadavg()
    repeated, split, folded = result["repeated"], result["split"], result["folded"]
    difference = max(same_losses(repeated, split, tolerance), same_losses(repeated, folded, tolerance))
    result["max_loss_difference"] = difference
    result["loss_tolerance"] = tolerance
    result["step_time_ratio"] = split["step_time_s"] / repeated["step_time_s"]
    result["folded_over_split_step_time_ratio"] = folded["step_time_s"] / split["step_time_s"]
    cfg = bench_config(True, seq_len, micro_batch, microbatches)
    result["setup"] = {"tp": TP, "dp": 1, "model": "tiny-moe", "layers": cfg.model.layers,
                       "experts": cfg.model.moe_experts,
                       "top_k": cfg.model.moe_top_k, "moe_ffn": cfg.model.moe_ffn, "hidden": cfg.model.hidden,
                       "heads": cfg.model.heads, "kv_heads": cfg.model.kv_heads, "vocab": cfg.model.vocab_size,
                       "seq_len": seq_len, "micro_batch": micro_batch, "microbatches": microbatches,
                       "warmup": warmup, "steps": steps, "threads_per_rank": 1,
                       "expert_share_of_forward_matmul_flops": round(expert_share(cfg), 3)}
    result["machine"] = {"measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         "machine_cores": os.cpu_count(), "torch": torch.__version__,
                         "load_average_before": [round(x, 2) for x in load_before],
                         "load_average_after": [round(x, 2) for x in load_after]}
    for name in SIDES:
        r = result[name]
        console.print(f"{name:>9}: step {r['step_time_s'] * 1e3:7.1f} ms (the slowest rank, median of {steps}), "
                      f"bytes/step on rank 0 {r['bytes_per_rank'][0]}")
    console.print(f"split / repeated: step time ×{result['step_time_ratio']:.3f}; folded / split "
                  f"×{result['folded_over_split_step_time_ratio']:.3f}; losses differ by at most "
                  f"{difference:.3g} (tolerance {tolerance:g}); "
                  f"load average {load_before[0]:.2f} → {load_after[0]:.2f}")
    for name in SIDES:
        del result[name]["losses"]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {RESULTS}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
