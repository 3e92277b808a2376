"""Data parallelism (DDP, ZeRO-1/2/3) against the single-process engine, on gloo worker pools.

The reference is ``Engine`` on one process with the same global batches. Every data-parallel
run must reproduce its losses and parameters, send exactly the bytes the planner predicts
(``costs.dp_bytes_per_step``; for ZeRO-2 plus the per-micro-batch reduce-scatters that
``costs.estimate`` adds) and hold exactly the model-state bytes it predicts
(``costs.model_state_bytes``).

Every layout runs through tests/equivalence.py's ``case`` and is compared by its
``assert_same_training``, whose tolerances are justified there, once for all strategies.
"""
from __future__ import annotations

import time

import pytest
import torch

import equivalence
from equivalence import assert_same_training, global_batches, my_micro_batches, new_engine, train_steps
from threefold.configure import load_config
from threefold.models.llama import Llama, count_parameters, cross_entropy
from threefold.plan.costs import dp_bytes_per_step, model_state_bytes
from threefold.train.engine import Engine
from threefold.train.metrics import storage_key

STEPS = 5
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.vocab_size=256",
        "model.seq_len=32", "train.global_batch=16", "train.micro_batch=2", "train.lr=1e-3", "train.grad_clip=1.0",
        "parallel.bucket_mb=0.1", "parallel.timeout_s=30"]


def make_config(dp: int = 1, zero: int = 0, *extra: str):
    return load_config(None, list(layout(dp, zero, *extra)))


def layout(dp: int = 1, zero: int = 0, *extra: str) -> tuple[str, ...]:
    return tuple(TINY + [f"parallel.dp={dp}", f"parallel.zero={zero}", *extra])


def case(distributed, dp: int, zero: int, *extra: str) -> list[dict]:
    """Each layout runs once; the equivalence, ledger and memory tests read the same run."""
    return equivalence.case(distributed, layout(dp, zero, *extra))


def reference(*extra: str) -> dict:
    return equivalence.reference(layout(1, 0, *extra))


# --- functions the workers run (module level, so they pickle) ---------------------------------
def run_resume(dp: int, zero: int, folder: str) -> bool:
    """3 steps, checkpoint, 2 more; a fresh engine loaded from the checkpoint runs the same 2: identical?"""
    from threefold.train import checkpoint

    cfg = make_config(dp, zero)
    batches = global_batches(cfg, STEPS)
    first = new_engine(cfg)
    train_steps(first, cfg, batches[:3])
    checkpoint.save(folder, 3, first, cfg, sampler_state={})
    train_steps(first, cfg, batches[3:])
    straight = first.model_state_dict()
    first.shutdown()
    second = new_engine(cfg)
    checkpoint.load(checkpoint.step_dir(folder, 3), second, cfg)
    train_steps(second, cfg, batches[3:])
    resumed = second.model_state_dict()
    plain = second.plain_model().state_dict()
    second.shutdown()
    return (all(torch.equal(straight[k], resumed[k]) for k in straight)
            and all(torch.equal(plain[k], resumed[k]) for k in resumed))


def run_overlap(zero: int) -> dict:
    """When did gradients arrive, when did reductions start? Many small buckets."""
    cfg = make_config(2, zero, "parallel.bucket_mb=0.05")
    engine = new_engine(cfg)
    arrivals: list[tuple[int, float]] = []
    micro = [0]
    engine.model.register_forward_pre_hook(lambda m, a: micro.__setitem__(0, micro[0] + 1))
    for p in engine.model.parameters():  # registered after the engine's own hooks, so they run after
        p.register_post_accumulate_grad_hook(lambda p: arrivals.append((micro[0], time.perf_counter())))
    engine.forward_backward(my_micro_batches(global_batches(cfg, 1)[0], cfg, engine.dp_rank, engine.dp_size))
    launches = [r.started for r in engine.comm.ledger.records if r.key == "dp"]
    engine.shutdown()
    last = max(m for m, _ in arrivals)
    return {"launches": launches, "last_micro": [t for m, t in arrivals if m == last],
            "earlier_micro": [t for m, t in arrivals if m < last]}


def run_eval_and_plain(dp: int, zero: int) -> dict:
    cfg = make_config(dp, zero)
    engine = new_engine(cfg)
    batch = my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:2]
    loss = engine.eval_loss(batch)
    comm = engine.comm_bytes()
    plain = engine.plain_model().state_dict()
    engine.shutdown()
    return {"loss": loss, "comm": comm, "plain": plain}


def saved_activation_bytes(engine, parameter_storages) -> int:
    """Bytes of distinct storages autograd saves in one forward, leaving out parameters."""
    seen: dict[int, int] = {}

    def pack(t):
        if storage_key(t) not in parameter_storages():
            seen[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    cfg = engine.cfg
    inputs, targets = my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy(engine.model(inputs), targets)
    loss.backward()
    return sum(seen.values())


def run_activation_bytes() -> int:
    engine = new_engine(make_config(2, 3))
    measured = saved_activation_bytes(engine, engine.parameter_storages)
    engine.shutdown()
    return measured


LAYOUTS = [(dp, zero) for dp in (2, 4) for zero in (0, 1, 2, 3)]


@pytest.mark.parametrize("dp,zero", LAYOUTS)
def test_matches_single_process(distributed, dp, zero):
    assert_same_training(case(distributed, dp, zero), reference())


@pytest.mark.parametrize("dp,zero", LAYOUTS)
def test_ledger_equals_planner(distributed, dp, zero):
    numel = count_parameters(make_config().model)
    microbatches = make_config(dp).microbatches
    want = dp_bytes_per_step(numel, dp, zero, microbatches)
    # Bookkeeping scalars apart: the loss (fp64), and for sharded gradients the squared norm (fp32).
    scalars = 2 * (dp - 1) / dp * (8 + (4 if zero > 0 else 0))
    for rank_result in case(distributed, dp, zero):
        for step in rank_result["comm"]:
            assert step == {"dp": want, "dp.scalar": round(scalars)}


@pytest.mark.parametrize("dp,zero", LAYOUTS)
def test_memory_equals_planner(distributed, dp, zero):
    numel = count_parameters(make_config().model)
    want = model_state_bytes(numel, dp, zero)
    for rank_result in case(distributed, dp, zero):
        assert rank_result["memory"] == want


def test_zero3_holds_a_quarter_at_dp4(distributed):
    ddp, zero3 = (sum(case(distributed, 4, z)[0]["memory"].values()) for z in (0, 3))
    assert zero3 * 4 == ddp


def test_zero3_sends_one_and_a_half_times_ddp(distributed):
    """One micro-batch per step: ZeRO-3's two gathers and a reduce-scatter vs DDP's all-reduce."""
    one_micro = ("train.global_batch=4",)  # 4 rows / (dp 2 × micro 2) = 1 micro-batch
    ddp, zero3 = (case(distributed, 2, z, *one_micro)[0]["comm"][0]["dp"] for z in (0, 3))
    assert zero3 == 1.5 * ddp


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_reduction_overlaps_backward(distributed, zero):
    """Buckets are reduced while backward still computes. zero 0/1 send nothing before the last
    micro-batch; zero 2 reduces each micro-batch's gradients during its own backward."""
    result = distributed.run(2, run_overlap, zero)[0]
    launches = result["launches"]
    assert len(launches) > 1
    last_started = [t for t in launches if t > max(result["earlier_micro"])]
    assert min(last_started) < max(result["last_micro"])  # started before the last backward finished
    if zero < 2:
        assert len(last_started) == len(launches)  # accumulation micro-batches are silent
    else:
        assert min(launches) < max(result["earlier_micro"])  # the first micro-batch already sent


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_resume_from_a_checkpoint_is_exact(distributed, tmp_path, zero):
    assert all(distributed.run(2, run_resume, 2, zero, str(tmp_path)))


def test_zero3_eval_and_plain_model(distributed):
    results = distributed.run(2, run_eval_and_plain, 2, 3)
    cfg = make_config()
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    batch = my_micro_batches(global_batches(cfg, 1)[0], cfg, 0, 1)[:2]
    want = Engine(model, cfg).eval_loss(batch)
    numel = count_parameters(cfg.model)
    for r in results:
        assert r["loss"] == pytest.approx(want, rel=1e-6)
        assert set(r["comm"]) == {"dp.eval"}  # evaluation traffic stays out of the step's "dp"
        assert r["comm"]["dp.eval"] == 2 * dp_bytes_per_step(numel, 2, 3, 1) / 3  # one gather per forward
        assert all(torch.equal(r["plain"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_zero3_with_recomputation(distributed, recompute):
    extra = (f"train.recompute={recompute}",)
    assert_same_training(case(distributed, 2, 3, *extra), reference(*extra))


def test_bf16_autocast(distributed):
    """bf16 compute, fp32 master weights and reductions: same losses as one process, to bf16 precision."""
    extra = ("train.dtype=bfloat16",)
    ref = reference(*extra)
    for zero in (0, 3):
        for r in case(distributed, 2, zero, *extra):
            assert r["losses"] == pytest.approx(ref["losses"], rel=2e-3)
            assert r["memory"] == case(distributed, 2, zero)[0]["memory"]  # still fp32 states


def test_zero3_names_its_gathered_weights_for_the_activation_meter(distributed):
    cfg = make_config()
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    plain = Engine(model, cfg)
    # model state left out, as the engine's meter does: the parameters and the rotary tables (buffers)
    want = saved_activation_bytes(plain, lambda: {storage_key(p) for p in (*model.parameters(), *model.buffers())})
    assert distributed.run(2, run_activation_bytes) == [want, want]
