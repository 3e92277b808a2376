"""Pipelines that never flush, PipeDream-2BW and PipeDream with weight stashing, against a single
process that keeps the weight history and applies the same delayed update:

    W(t) = Opt(W(t − 1), ∇L_t(W(t − delay)))    batches from 1, W(k < 0) = W(0)

2BW: delay 2 on every stage. PipeDream (one micro-batch per batch): stage s's delay is pp − s,
each stage computing with its own version. The reference computes each batch's loss and gradient
with every stage's parameters at its version (``torch.func.functional_call``, the tied
embedding's two ends at their two stages' versions), sums the gradients into the live weights,
clips and steps AdamW: nothing of the runtime's. With every delay 1 it is plain training, which
it must reproduce (the single-process engine); the delayed reference must differ from it, or the
test could not tell a stale pipeline from a synchronous one.

Tolerances are equivalence.py's (fp32 rounding: the tied weight's parts and the gradient norm
summed in another order), except per tensor under tp: after 8 steps Adam has turned the rounding
of tp's partial sums into 8.2e-5 relative on blocks.1.attn.wv (4.5e-4 of the distance it moved);
plain 1F1B on the same tp 2 × pp 2 layout against plain training shows the same 8.3e-5 on the
same tensor (measured here, Zen 4), so tp cases get 2e-4 per tensor.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import equivalence
from equivalence import assert_same_training, global_batches, my_micro_batches, new_engine
from threefold.config import ConfigError
from threefold.configure import load_config
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY, build_run, partition, validate
from threefold.plan.simulate import ActionCosts, simulate

TINY = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.vocab_size=64",
        "model.seq_len=16", "train.micro_batch=2", "train.lr=1e-3", "train.grad_clip=1.0", "train.warmup_steps=0",
        "parallel.bucket_mb=0.01", "parallel.timeout_s=60", "parallel.stage_costs=flops"]
STEPS = 8


def layout(schedule: str, pp: int, m: int, dp: int = 1, tp: int = 1, *extra: str) -> tuple[str, ...]:
    return tuple(TINY + [f"parallel.schedule={schedule}", f"parallel.pp={pp}", f"parallel.dp={dp}", f"parallel.tp={tp}",
                         f"train.global_batch={2 * m * dp}", *extra])


# --- the distributed run ---------------------------------------------------------------------------
def run_async(overrides: tuple[str, ...], steps: int, flush_after: tuple[int, ...] = ()) -> dict:
    """One rank: ``steps`` steps, each handed the next steps' micro-batches (as many as the engine
    looks ahead), except after the steps in ``flush_after`` (an evaluation there) and at the end."""
    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    initial = engine.model_state_dict()
    batches = global_batches(cfg, steps)
    mine = [my_micro_batches(tokens, cfg, engine.dp_rank, engine.dp_size) for tokens in batches]
    out = {"losses": [], "norms": [], "initial": initial}
    for step in range(steps):
        ahead = 0 if step + 1 in flush_after else min(engine.lookahead, steps - 1 - step)
        out["losses"].append(engine.forward_backward(mine[step], mine[step + 1:step + 1 + ahead]))
        out["norms"].append(engine.clip_grad_norm(cfg.train.grad_clip))
        engine.optimizer_step(cfg.train.lr)
        out["memory"] = engine.memory_bytes()
        engine.zero_grad()
        if step + 1 in flush_after:
            out["eval_loss_mid"] = engine.eval_loss(mine[0][:1])
    runtime = engine.runtime
    if hasattr(runtime, "versions"):
        out["version_bytes"] = runtime.weight_version_bytes()
        out["stage_bytes"] = {s: sum(q.numel() * q.element_size() for q in v.params)
                              for s, v in runtime.versions.items()}
    out["state"] = engine.model_state_dict()
    out["pp_rank"] = engine.pp_rank
    engine.shutdown()
    return out


_runs: dict = {}


def distributed_run(distributed, overrides, flush_after=()) -> list[dict]:
    key = (overrides, flush_after)
    if key not in _runs:
        world = load_config(None, list(overrides)).parallel.world_size
        _runs[key] = distributed.run(world, run_async, overrides, STEPS, flush_after)
    return _runs[key]


# --- the single-process reference ------------------------------------------------------------------
def stage_of_key(key: str, spans) -> int:
    if key.startswith("embed."):
        return 0
    if key.startswith("blocks."):
        block = int(key.split(".")[1])
        return next(span.stage for span in spans if block in span.blocks)
    return len(spans) - 1  # the final norm and the head


def delayed_reference(overrides: tuple[str, ...], steps: int, synchronous: bool = False) -> dict:
    """One process, the whole global batch, each stage's parameters at version t − delay(stage)."""
    from threefold.models.llama import Llama, cross_entropy
    from threefold.train.engine import build_adamw

    cfg = load_config(None, list(overrides))
    p = cfg.parallel
    spans = partition(cfg.model, p.pp, 1, p.stage_layers)
    delay = (lambda stage: 1) if synchronous else (lambda stage: int(SCHEDULE_REGISTRY[p.schedule].delay(stage, p.pp)))
    torch.set_num_threads(1)
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    params = dict(model.named_parameters())  # a tied head is "embed.weight" here
    keys = list(model.state_dict())  # both ends of a tied table, each at its own stage's version
    alias = {"head.weight": "embed.weight"} if cfg.model.tie_embeddings else {}
    optimizer = build_adamw(model.named_parameters(), cfg)
    history = [{k: v.detach().clone() for k, v in params.items()}]  # history[k] = W(k)
    out = {"losses": [], "norms": [], "initial": {k: v.clone() for k, v in model.state_dict().items()}}
    for t, tokens in enumerate(global_batches(cfg, steps), start=1):
        used = {key: history[max(0, t - delay(stage_of_key(key, spans)))][alias.get(key, key)]
                .clone().requires_grad_() for key in keys}
        micro = my_micro_batches(tokens, cfg, 0, 1)
        total = 0.0
        for inputs, targets in micro:
            logits = torch.func.functional_call(model, used, (inputs,), tie_weights=False)
            loss = cross_entropy(logits, targets)
            (loss / len(micro)).backward()
            total += loss.item()
        for key, q in params.items():
            q.grad = sum(used[k].grad for k in keys if alias.get(k, k) == key)
        out["losses"].append(total / len(micro))
        out["norms"].append(torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.train.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append({k: v.detach().clone() for k, v in params.items()})
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


CASES = [("2bw", 2, 4, 1, 1), ("2bw", 4, 4, 1, 1), ("2bw", 2, 2, 2, 1), ("2bw", 2, 4, 1, 2),
         ("pipedream", 2, 1, 1, 1), ("pipedream", 4, 1, 1, 1), ("pipedream", 2, 1, 2, 1), ("pipedream", 2, 1, 1, 2)]


@pytest.mark.parametrize("schedule,pp,m,dp,tp", CASES)
def test_equals_the_delayed_single_process_reference(distributed, schedule, pp, m, dp, tp):
    overrides = layout(schedule, pp, m, dp, tp)
    ranks = distributed_run(distributed, overrides)
    ref = delayed_reference(overrides, STEPS)
    assert_same_training(ranks, ref, param_rtol=2e-4 if tp > 1 else equivalence.PARAM_RTOL)
    plain = delayed_reference(overrides, STEPS, synchronous=True)
    assert ref["losses"][-1] != pytest.approx(plain["losses"][-1], rel=1e-5)  # the delay shows


def test_recomputed_activations_use_their_forwards_version(distributed):
    """Full recomputation reruns each block's forward in the backward, under the same version."""
    overrides = layout("2bw", 2, 4, 1, 1, "train.recompute=full")
    assert_same_training(distributed_run(distributed, overrides), delayed_reference(overrides, STEPS))


def test_a_flush_mid_run_changes_nothing(distributed):
    """An evaluation after step 3 drains the pipeline; the update rule goes on as before."""
    overrides = layout("2bw", 2, 4)
    ranks = distributed_run(distributed, overrides, flush_after=(3,))
    assert_same_training(ranks, delayed_reference(overrides, STEPS))
    assert all(r["eval_loss_mid"] == ranks[0]["eval_loss_mid"] for r in ranks)


def test_without_the_delay_the_reference_is_plain_training():
    """Every delay 1: the reference's W(t) = Opt(W(t − 1), ∇L_t(W(t − 1))) is the single-process engine's."""
    for overrides in (layout("2bw", 2, 4), layout("pipedream", 4, 1)):
        _, plain = equivalence.train_reference(load_config(None, [o for o in overrides
                                                                  if not o.startswith("parallel.")]), STEPS)
        assert_same_training([delayed_reference(overrides, STEPS, synchronous=True)], plain)


@pytest.mark.parametrize("schedule,pp,m,dp,tp", [c for c in CASES if c[3] == 1 and c[4] == 1])
def test_stashed_weight_bytes_equal_the_formula(distributed, schedule, pp, m, dp, tp):
    """2BW: two versions of each stage's weights; PipeDream: pp − s on stage s."""
    spec = SCHEDULE_REGISTRY[schedule]
    for r in distributed_run(distributed, layout(schedule, pp, m, dp, tp)):
        (stage, got), = r["version_bytes"].items()
        assert got == spec.weight_versions(stage, pp) * r["stage_bytes"][stage]
        assert r["memory"]["weight_versions"] == got


# --- the schedule as data, the planner --------------------------------------------------------------
@pytest.mark.parametrize("schedule,pp,m", [("2bw", 2, 4), ("2bw", 4, 4), ("2bw", 4, 6), ("pipedream", 4, 1),
                                           ("pipedream", 3, 1)])
def test_a_run_fills_once(schedule, pp, m):
    """A run of S steps is one 1F1B over S·m micro-batches: at uniform costs its bubble is
    (pp − 1)/(S·m + pp − 1), the fill and drain of one step spread over the run; a step in the
    middle idles nothing (the registry's steady bubble), and rank 0 then holds pp micro-batches."""
    spec = SCHEDULE_REGISTRY[schedule]
    for steps in (1, 3, 10):
        run = build_run(schedule, pp, m, steps)
        validate(run)
        sim = simulate(run, ActionCosts(1.0, 2.0, 1.0))
        assert sim.bubble_fraction == pytest.approx((pp - 1) / (steps * m + pp - 1), abs=1e-12)
    assert float(spec.steady.bubble(pp, m, 1)) == 0.0
    assert sim.peak_activations[0] == float(spec.steady.in_flight_first(pp, m, 1)) == pp


def test_planner_counts_the_versions_and_the_steady_bubble():
    from threefold.plan import costs
    from threefold.plan.hardware import CATALOG

    cfg = load_config(None, ["model.preset=tiny", "model.layers=8", "model.vocab_size=4096"])
    work = costs.Workload(cfg.model, global_batch=64)
    gpu = CATALOG["h100-sxm"]
    base = costs.estimate(work, costs.Layout.named(schedule="1f1b", pp=4, micro_batch=2), gpu)
    two = costs.estimate(work, costs.Layout.named(schedule="2bw", pp=4, micro_batch=2), gpu)
    dream = costs.estimate(costs.Workload(cfg.model, global_batch=2),
                           costs.Layout.named(schedule="pipedream", pp=4, micro_batch=2), gpu)
    assert two["bubble_fraction"] == 0 and base["bubble_fraction"] > 0
    assert two["weight_versions_bytes"] == pytest.approx(2 * base["params_bytes"])
    assert two["staleness"] == 1 and dream["staleness"] == 3  # updates behind, on the first stage
    assert dream["weight_versions_bytes"] == pytest.approx(4 * dream["params_bytes"])
    assert two["memory_bytes"] == pytest.approx(base["memory_bytes"] + two["weight_versions_bytes"])


# --- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (layout("2bw", 4, 2), "parallel.microbatches: 2bw needs at least pp=4 micro-batches per step, got 2"),
    (layout("pipedream", 2, 4), "parallel.microbatches: pipedream takes one optimizer step per micro-batch"),
    (layout("2bw", 2, 4, 2, 1, "parallel.zero=3"), "parallel.zero: 2bw keeps whole copies of each stage's weights"),
    (layout("pipedream", 2, 1, 1, 1, "parallel.cp=2"), "parallel.cp: pipedream with context parallelism"),
])
def test_bad_input_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_bad_input_exits_2_before_any_process_starts():
    args = [sys.executable, "-m", "threefold.cli", "train", "--nproc", "2", "--no-progress"]
    args += [f"--set={o}" for o in layout("pipedream", 2, 4)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "pipedream takes one optimizer step" in done.stderr


def test_the_trainer_reads_ahead_up_to_the_next_flush():
    """The next steps' batches (as the sampler will give them), none past an evaluation, a
    checkpoint or the end of the run."""
    import numpy as np
    from types import SimpleNamespace

    from threefold.data import BatchSampler
    from threefold.train.trainer import flushes_after, upcoming_batches

    cfg = load_config(None, list(layout("pipedream", 4, 1)) + ["train.steps=10", "train.eval_every=4",
                                                               "train.checkpoint_dir=/tmp/x", "train.checkpoint_every=0"])
    assert [n for n in range(1, 11) if flushes_after(n, cfg)] == [4, 8, 10]
    sampler = BatchSampler(np.arange(10_000) % 64, 16, 2, 0)
    engine = SimpleNamespace(lookahead=3, dp_rank=0, dp_size=1, device=torch.device("cpu"))
    sampler.next_batch()  # step 1's batch
    ahead = upcoming_batches(engine, sampler, cfg, 1)
    assert len(ahead) == 3 and torch.equal(ahead[0][0][0], sampler.local_batch_at(1, 0, 1)[0])
    assert len(upcoming_batches(engine, sampler, cfg, 3)) == 1  # step 4 evaluates: nothing past it
    assert upcoming_batches(engine, sampler, cfg, 4) == []


def run_stopped(overrides: tuple[str, ...]) -> tuple[float, int, int]:
    """Two steps, the second handed the third's batch, then a stop (as SIGTERM does): what was in
    flight for the third step is settled (rank 0's send waited for, rank 1's receive taken), its
    forwards dropped; the pipeline still evaluates (its messages arrive where they should)."""
    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    mine = [my_micro_batches(tokens, cfg, 0, 1) for tokens in global_batches(cfg, 3)]
    for step in range(2):
        engine.forward_backward(mine[step], mine[step + 1:step + 2])
        engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(cfg.train.lr)
        engine.zero_grad()
    runtime = engine.runtime
    carried = len(runtime.carried_sends) + sum(map(len, runtime.pre_posted.values())) + len(runtime.carried_forwards)
    engine.discard_pipeline_carry()
    left = len(runtime.carried_sends) + sum(map(len, runtime.pre_posted.values())) + len(runtime.carried_forwards)
    loss = engine.eval_loss(mine[0][:1])
    engine.shutdown()
    return loss, carried, left


def test_a_stop_mid_run_settles_what_is_in_flight(distributed):
    (loss0, carried0, left0), (loss1, carried1, left1) = distributed.run(2, run_stopped, layout("2bw", 2, 4))
    assert carried0 == 2 and carried1 == 1  # rank 0: a send and a forward's graph; rank 1: a receive
    assert left0 == left1 == 0 and loss0 == loss1 and 0 < loss0 < 10


# --- checkpoints: the older weight versions saved and resumed ----------------------------------------
def train_segment(overrides: tuple[str, ...], folder: str, start: int, stop: int, save_at: tuple[int, ...] = (),
                  forget_versions: bool = False) -> dict:
    """One rank: resume from ``folder``'s checkpoint of step ``start`` (none at 0), train up to
    step ``stop`` as ``run_async`` does, draining and saving after the steps in ``save_at``.
    ``forget_versions``: after the load, drop the older versions (what a resume did before
    checkpoints held them), to show that the comparison can tell."""
    from threefold.train import checkpoint

    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    if start:
        checkpoint.load(checkpoint.step_dir(folder, start), engine, cfg)
    if forget_versions:
        for versions in engine.runtime.versions.values():
            versions.versions, versions.updates = {}, 0
    mine = [my_micro_batches(tokens, cfg, engine.dp_rank, engine.dp_size) for tokens in global_batches(cfg, stop)]
    losses = []
    for step in range(start, stop):
        ahead = 0 if step + 1 in save_at else min(engine.lookahead, stop - 1 - step)
        losses.append(engine.forward_backward(mine[step], mine[step + 1:step + 1 + ahead]))
        engine.clip_grad_norm(cfg.train.grad_clip)
        engine.optimizer_step(cfg.train.lr)
        engine.zero_grad()
        if step + 1 in save_at:
            checkpoint.save(folder, step + 1, engine, cfg, sampler_state={})
    state = engine.model_state_dict()
    engine.shutdown()
    return {"losses": losses, "state": state}


@pytest.mark.parametrize("schedule,pp,m,dp,tp", [("2bw", 2, 4, 1, 1), ("pipedream", 2, 1, 1, 1), ("2bw", 2, 2, 2, 1)])
def test_a_resumed_run_continues_exactly(distributed, tmp_path, schedule, pp, m, dp, tp):
    """4 steps, saved; a new engine resumes from the checkpoint for 4 more: the losses of steps
    5-8 and the weights after step 8 are those of the 8 steps run through, bit for bit (fp32, the
    same layout). The checkpoint holds W(3) as the version one update older than the newest, on
    every stage for 2bw, on stage 0 only for pipedream on 2 stages (stage 1 keeps only the newest);
    resumed without it, the run goes another way."""
    from threefold.train import checkpoint

    overrides = layout(schedule, pp, m, dp, tp)
    whole = distributed_run(distributed, overrides)
    world = pp * dp * tp
    distributed.run(world, train_segment, overrides, str(tmp_path), 0, 4, (3, 4))
    resumed = distributed.run(world, train_segment, overrides, str(tmp_path), 4, STEPS)
    for rank, got in zip(whole, resumed):
        assert got["losses"] == rank["losses"][4:]
        assert all(torch.equal(got["state"][key], value) for key, value in rank["state"].items())

    stashed = checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 4), "version")
    before = checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 3), "model/")
    spans = partition(load_config(None, list(overrides)).model, pp, 1, None)
    expected = {key for key in before if schedule == "2bw" or stage_of_key(key.removeprefix("model/"), spans) == 0}
    assert {name.replace("version1/", "model/") for name in stashed} == expected
    assert all(torch.equal(value, before[name.replace("version1/", "model/")]) for name, value in stashed.items())

    forgotten = distributed.run(world, train_segment, overrides, str(tmp_path), 4, STEPS, (), True)
    assert forgotten[0]["losses"][0] != whole[0]["losses"][4]  # step 5 computed on W(4), not W(3)
    assert not torch.equal(forgotten[0]["state"]["blocks.0.attn.wq.weight"], whole[0]["state"]["blocks.0.attn.wq.weight"])


def test_2bw_resumes_on_another_number_of_stages(distributed, tmp_path):
    """2BW's delay is 2 on every stage, so its update rule does not depend on pp: saved on 2
    stages after 4 steps, resumed on 4, the run is 2BW's on 4 stages (up to fp32 rounding: the
    stages cut the blocks differently, not the arithmetic), its older versions read from the
    pieces the 2-stage run wrote."""
    two, four = layout("2bw", 2, 4), layout("2bw", 4, 4)
    whole = distributed_run(distributed, four)
    distributed.run(2, train_segment, two, str(tmp_path), 0, 4, (4,))
    resumed = distributed.run(4, train_segment, four, str(tmp_path), 4, STEPS)
    assert resumed[0]["losses"] == pytest.approx(whole[0]["losses"][4:], rel=1e-6, abs=0)
    for key, value in whole[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][key], value, rtol=equivalence.PARAM_RTOL, atol=1e-7)


def resume_into(overrides: tuple[str, ...], folder: str, start: int) -> str:
    from threefold.train import checkpoint

    cfg = load_config(None, list(overrides))
    engine = new_engine(cfg)
    try:
        checkpoint.load(checkpoint.step_dir(folder, start), engine, cfg)
        return "loaded"
    except ConfigError as err:
        return str(err)
    finally:
        engine.shutdown()


def test_resuming_without_the_versions_the_run_keeps_is_refused(distributed, tmp_path):
    """A 1F1B checkpoint holds no older versions, so 2bw cannot continue from it as its run would."""
    from threefold.train import checkpoint

    distributed.run(2, train_segment, layout("1f1b", 2, 4), str(tmp_path), 0, 1, (1,))
    messages = distributed.run(2, resume_into, layout("2bw", 2, 4), str(tmp_path), 1)
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert messages[0] == (f"checkpoint: {str(checkpoint.step_dir(tmp_path, 1))!r} lacks older weight versions "
                           "(\"version<j>/<key>\") that 2bw on pp=2 resumes with, which the run that saved it (1f1b "
                           "on pp=2) did not keep; resume it with the schedule and pp that saved it")
