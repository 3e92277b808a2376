"""Checkpoints move between layouts: train k steps on one layout, save, resume on another, train
on; the losses and weights are those of the single-process run that never stopped.

Two checks per pair of layouts:

* Exact: after loading, every piece every rank holds (weights and both Adam moments, tp
  slices, ZeRO's flat ranges, pipeline stages) equals, bit for bit, the same region of the full
  tensors read back from the checkpoint on one process. Resharding itself adds no error.
* Equivalence: the losses of the steps after the resume, and the final weights, match the
  single-process run. Each layout differs from one process only in summation order (see
  test_pipeline.py): measured over the six pairs, losses agree to ≤ 1.2e-7 relative and
  weights to ≤ 1.2e-6 per tensor. We assert 1e-6 on losses and 1e-4 per tensor. The check
  sees lost optimizer states: resuming with Adam's moments zeroed moves the losses 9e-5 and
  3e-4 relative one and two steps later (``test_lost_moments_are_caught``).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from equivalence import global_batches, train_steps
from test_train import config as trainer_config
from test_train import corpus  # noqa: F401  (the corpus fixture)
from threefold.config import ConfigError
from threefold.configure import load_config
from threefold.models.llama import Llama
from threefold.train import checkpoint
from threefold.train.engine import Engine
from threefold.parallel.placements import region

BEFORE, AFTER = 3, 3  # steps on the saving layout, then on the loading one
TINY = ["model.layers=4", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.vocab_size=63",
        "model.seq_len=16", "train.global_batch=8", "train.micro_batch=2", "train.lr=1e-3", "train.grad_clip=1.0",
        "train.warmup_steps=0", "parallel.bucket_mb=0.002", "parallel.timeout_s=60"]
LAYOUTS = {
    "single": [],
    "dp2·zero3": ["parallel.dp=2", "parallel.zero=3"],
    "dp2·tp2": ["parallel.dp=2", "parallel.tp=2", "parallel.zero=1", "parallel.sequence_parallel=true"],
    "pp2·dp2": ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1"],
    "dp2·tp2·pp2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
                    "parallel.sequence_parallel=true"],
    "cp2": ["parallel.cp=2", "parallel.cp_method=allgather"],
    "dp2·cp2·zero1": ["parallel.dp=2", "parallel.cp=2", "parallel.zero=1"],  # ZeRO chunks over dp × cp
    "dp4·hsdp2": ["parallel.dp=4", "parallel.zero=3", "parallel.dp_shard=2"],  # two pairs hold the same chunks
    "dp4·zero2·shard2": ["parallel.dp=4", "parallel.zero=2", "parallel.dp_shard=2"],  # the moments' chunks likewise
    # rank 0 holds both ends of the tied embedding, a copy each: saved once, both loaded
    "dp2·pp2·dualpipev·zero3": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.schedule=dualpipev",
                                "train.micro_batch=1"],
    # ZeRO-3 kept gathered through the step: between steps, the same shards as resharding's
    "dp2·pp2·zero3·keep": ["parallel.dp=2", "parallel.pp=2", "parallel.zero=3", "parallel.reshard_after_forward=false"],
}
PAIRS = [("single", "dp2·zero3"), ("dp2·zero3", "single"), ("dp2·tp2", "pp2·dp2"), ("pp2·dp2", "dp2·tp2"),
         ("dp2·tp2·pp2", "single"), ("single", "dp2·tp2·pp2"), ("dp2·cp2·zero1", "single"), ("cp2", "dp2·zero3"),
         ("dp4·hsdp2", "single"), ("dp2·zero3", "dp4·hsdp2"), ("dp4·zero2·shard2", "dp2·zero3"),
         ("dp4·hsdp2", "dp4·zero2·shard2"), ("dp2·pp2·dualpipev·zero3", "single"),
         ("dp2·zero3", "dp2·pp2·dualpipev·zero3"), ("dp2·pp2·zero3·keep", "dp2·tp2")]


def make_config(layout: str, *extra):
    return load_config(None, TINY + LAYOUTS[layout] + list(extra))


def new_engine(cfg):
    model = Llama(cfg.model)
    model.init_weights(cfg.train.seed)
    if cfg.parallel.world_size == 1:
        return Engine(model, cfg)
    from threefold.train.engine import build_engine

    return build_engine(model, cfg)


# --- what every rank runs ----------------------------------------------------------------------
def segment(layout: str, folder: str, start: int, steps: int, extra: tuple = ()) -> dict:
    """Resume from ``folder``'s checkpoint of step ``start`` (if any), train ``steps`` steps, save."""
    cfg = make_config(layout, *extra)
    engine = new_engine(cfg)
    out = {"loaded": None}
    if start:
        checkpoint.load(checkpoint.step_dir(folder, start), engine, cfg)
        out["loaded"] = [(s.name, s.offsets, s.tensor.clone()) for s in engine.checkpoint_shards()]
    out.update(train_steps(engine, cfg, global_batches(cfg, start + steps)[start:]))
    checkpoint.save(folder, start + steps, engine, cfg, sampler_state={})
    out["state"] = engine.model_state_dict()
    engine.shutdown()
    return out


def run_layout(distributed, layout: str, *args) -> list[dict]:
    world = make_config(layout).parallel.world_size
    if world == 1:
        return [segment(layout, *args)]
    return distributed.run(world, segment, layout, *args)


def reference(folder, steps: int) -> dict:
    return segment("single", str(folder), 0, steps)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return reference(tmp_path_factory.mktemp("reference"), BEFORE + AFTER)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("saver, loader", PAIRS, ids=[f"{a}→{b}" for a, b in PAIRS])
def test_resume_on_another_layout(distributed, tmp_path, uninterrupted, saver, loader):
    run_layout(distributed, saver, str(tmp_path), 0, BEFORE)
    saved = checkpoint.read_tensors(checkpoint.step_dir(tmp_path, BEFORE))
    assert {n.split("/")[0] for n in saved} == {"model", "exp_avg", "exp_avg_sq", "rng"}
    resumed = run_layout(distributed, loader, str(tmp_path), BEFORE, AFTER)

    for rank in resumed:  # exact: each rank holds the checkpoint's values at its pieces' places
        for name, offsets, tensor in rank["loaded"]:
            assert torch.equal(tensor, region(saved[name], offsets, tensor.shape)), (name, offsets)
    covered = {name for rank in resumed for name, _, _ in rank["loaded"]}
    assert covered == {n for n in saved if not n.startswith("rng/")}

    want = uninterrupted["losses"][BEFORE:]
    for got in (rank["losses"] for rank in resumed):
        assert got == pytest.approx(want, rel=1e-6, abs=0)
    for key, value in uninterrupted["state"].items():
        assert relative(resumed[0]["state"][key], value) < 1e-4, key


def test_lost_moments_are_caught(tmp_path, uninterrupted):
    """The equivalence check can tell: zero Adam's moments in the checkpoint and the losses move."""
    segment("single", str(tmp_path), 0, BEFORE)
    cfg = make_config("single")
    engine = new_engine(cfg)
    checkpoint.load(checkpoint.step_dir(tmp_path, BEFORE), engine, cfg)
    for shard in engine.checkpoint_shards():
        if not shard.name.startswith("model/"):
            shard.tensor.zero_()
    out = train_steps(engine, cfg, global_batches(cfg, BEFORE + AFTER)[BEFORE:])
    assert out["losses"][0] == pytest.approx(uninterrupted["losses"][BEFORE], rel=1e-6)  # same weights
    # Zeroed moments make Adam's first update after the load a unit step of lr on every weight:
    # the weights move far beyond the 1e-4 the resharding tests allow, and so does the loss.
    state = engine.model_state_dict()
    moved = max(relative(state[key], value) for key, value in uninterrupted["state"].items())
    assert moved > 1e-2
    assert abs(out["losses"][-1] / uninterrupted["losses"][-1] - 1) > 1e-5


def test_untied_model_moves_between_pipeline_and_tensor_parallel(distributed, tmp_path):
    untied = ("model.tie_embeddings=false",)
    want = segment("single", str(tmp_path / "reference"), 0, BEFORE + AFTER, untied)
    run_layout(distributed, "pp2·dp2", str(tmp_path), 0, BEFORE, untied)
    resumed = run_layout(distributed, "dp2·tp2", str(tmp_path), BEFORE, AFTER, untied)
    assert resumed[0]["losses"] == pytest.approx(want["losses"][BEFORE:], rel=1e-6, abs=0)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    segment("single", str(tmp_path), 0, 1)
    cfg = make_config("single", "model.hidden=64")
    with pytest.raises(ConfigError, match="model.hidden=32, this run has 64"):
        checkpoint.load(checkpoint.step_dir(tmp_path, 1), new_engine(cfg), cfg)
    # trainer.json agrees but the tensors do not: the shapes in DCP's metadata are checked too
    meta_path = checkpoint.step_dir(tmp_path, 1) / "trainer.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["model"]["hidden"] = 64
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"has model/embed.weight of shape \(63, 32\), this run has \(63, 64\)"):
        checkpoint.load(checkpoint.step_dir(tmp_path, 1), new_engine(cfg), cfg)


def test_trainer_resumes_a_single_process_run_on_two_ranks(distributed, tmp_path, corpus):  # noqa: F811
    """The whole trainer: step, learning-rate schedule (warm-up, cosine), sampler position and
    Adam's step count continue on another layout (dp=2, ZeRO-3: the two ranks a torchrun job
    runs, on the session's gloo pool)."""
    from test_train import train_rank
    from threefold.train.trainer import train

    ckpt = tmp_path / "ckpt"
    common = ["train.steps=6", "train.lr=1e-3", f"train.checkpoint_dir={json.dumps(str(ckpt))}"]
    whole = train(trainer_config(tmp_path, corpus, *common, "train.checkpoint_every=3"), progress=False)
    checkpoint.step_dir(ckpt, 6).rename(tmp_path / "step_6_moved")  # the run now stopped at step 3
    resume = trainer_config(tmp_path, corpus, *common, "train.resume=true", "parallel.dp=2", "parallel.zero=3",
                            "parallel.timeout_s=60", "train.threads=1")  # torchrun's 1 thread a rank on 2 cores
    said = distributed.run(2, train_rank, resume, str(tmp_path / "resumed.jsonl"), timeout=240)[0]
    said = " ".join(said.split())  # rich wraps long lines
    assert "step_000003 at step 3 (saved on dp=1 tp=1 pp=1 zero=0, resharded to dp=2 tp=1 pp=1 zero=3)" in said
    records = [json.loads(line) for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 5, 6]
    assert [r["loss"] for r in records] == pytest.approx(whole.losses[3:], rel=1e-6, abs=0)
    lrs = [r["lr"] for r in records]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] < 1e-3  # past warm-up, cosine decay


# --- asynchronous save -----------------------------------------------------------------------------
def save_both_ways(folder: str) -> None:
    """3 steps on dp2·ZeRO-1; the same states saved in the foreground and in the background. The
    background save must write the states of its step: the engine's states are wiped right
    after it starts, and two more steps run while it writes."""
    cfg = make_config("dp2·tp2", "parallel.tp=1", "parallel.sequence_parallel=false")
    engine = new_engine(cfg)
    batches = global_batches(cfg, BEFORE + 2)
    train_steps(engine, cfg, batches[:BEFORE])
    checkpoint.save(f"{folder}/foreground", BEFORE, engine, cfg, sampler_state={})
    saver = checkpoint.Checkpointer(engine, asynchronous=True, timeout_s=60)
    saver.save(f"{folder}/background", BEFORE, cfg, sampler_state={})
    for shard in engine.checkpoint_shards():
        shard.tensor.zero_()
    train_steps(engine, cfg, batches[BEFORE:])
    saver.close()
    engine.shutdown()


def test_background_save_writes_the_states_of_its_step(distributed, tmp_path):
    distributed.run(2, save_both_ways, str(tmp_path))
    foreground = checkpoint.read_tensors(checkpoint.step_dir(tmp_path / "foreground", BEFORE))
    background = checkpoint.read_tensors(checkpoint.step_dir(tmp_path / "background", BEFORE))
    assert foreground.keys() == background.keys()
    assert all(torch.equal(foreground[name], background[name]) for name in foreground)
    meta = checkpoint.read_meta(checkpoint.step_dir(tmp_path / "background", BEFORE))
    assert meta["adam_step"] == BEFORE and meta["world_size"] == 2


def test_trainer_with_background_saves_resumes_exactly(tmp_path, corpus):  # noqa: F811
    from threefold.train.trainer import train

    ckpt = tmp_path / "ckpt"
    common = ["train.steps=6", f"train.checkpoint_dir={json.dumps(str(ckpt))}", "train.async_checkpoint=true"]
    whole = train(trainer_config(tmp_path, corpus, *common, "train.checkpoint_every=2", "train.keep_checkpoints=3"),
                  progress=False)
    assert [p.name for p in checkpoint.list_checkpoints(ckpt)] == ["step_000002", "step_000004", "step_000006"]
    for step in (4, 6):
        shutil.rmtree(checkpoint.step_dir(ckpt, step))
    resumed = train(trainer_config(tmp_path, corpus, *common, "train.resume=true"), progress=False)
    assert resumed.losses == whole.losses[2:]  # fp32, same layout: bit-identical


# --- weights only: import, init_from ---------------------------------------------------------------
def test_a_run_starts_from_a_checkpoint_of_any_layout(distributed, tmp_path):
    """``[model] init_from`` reads a checkpoint saved by dp2·tp2·pp2 whole, on one process."""
    import dataclasses

    from threefold.interop.hf import init_from_state

    run_layout(distributed, "dp2·tp2·pp2", str(tmp_path), 0, 1)
    saved = checkpoint.read_tensors(checkpoint.step_dir(tmp_path, 1), "model/")
    cfg = make_config("single").model
    state = init_from_state(dataclasses.replace(cfg, init_from=str(checkpoint.step_dir(tmp_path, 1))))
    model = Llama(cfg)
    model.load_state_dict(state)
    assert all(torch.equal(p, saved[f"model/{key}"]) for key, p in model.named_parameters())
    with pytest.raises(ConfigError, match="model.init_from: .* has hidden=32, the run's model has 64"):
        init_from_state(dataclasses.replace(cfg, hidden=64, init_from=str(checkpoint.step_dir(tmp_path, 1))))


def test_weights_only_checkpoints_are_not_resumed(tmp_path):
    cfg = make_config("single")
    model = Llama(cfg.model)
    model.init_weights(0)
    folder = tmp_path / "imported"
    folder.mkdir()
    checkpoint.save_weights(folder, model, {"config": cfg.to_dict()}, tokenizer=None)
    read_cfg, state = checkpoint.read_model(folder)
    assert read_cfg == cfg.model and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match="holds weights only, no optimizer states to resume; start a new run "
                                          "from it with model.init_from"):
        checkpoint.load(folder, new_engine(cfg), cfg)


def test_inspect_shows_which_rank_wrote_which_piece(distributed, tmp_path, capsys):
    """`threefold inspect`: a dp2·ZeRO-3 checkpoint's pieces of one tensor, and of its moments,
    cover it exactly; each rank wrote its own chunk."""
    from math import prod

    from threefold.cli import main

    run_layout(distributed, "dp2·zero3", str(tmp_path), 0, 1)
    key = "blocks.0.mlp.w_up.weight"  # the two ranks' chunks meet inside it (rows 0–16 and 17–127)
    assert main(["inspect", str(tmp_path), "--tensor", key, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 1 and shown["world_size"] == 2 and shown["layout"]["zero"] == 3
    assert set(shown["tensors"]) == {f"model/{key}", f"exp_avg/{key}", f"exp_avg_sq/{key}"}
    for info in shown["tensors"].values():
        assert sum(prod(p["sizes"]) for p in info["pieces"]) == prod(info["shape"]) == 128 * 32
        assert {p["rank"] for p in info["pieces"]} == {0, 1}
    assert main(["inspect", str(tmp_path)]) == 0
    assert "saved by 2 ranks, dp=2 tp=1 pp=1 zero=3" in " ".join(capsys.readouterr().out.split())
    assert main(["inspect", str(tmp_path), "--tensor", "blocks.0.nothing"]) == 2
    assert "holds no tensor 'blocks.0.nothing'" in capsys.readouterr().err


def save_while_rank_1_is_away(folder: str) -> str:
    """Rank 0 saves; rank 1 never joins (stuck elsewhere). DCP's own gathers time out inside the
    library, not in comm.py: the error must still be one line naming the missing rank."""
    import datetime
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    from threefold.config import ParallelConfig
    from threefold.distributed.comm import Comm, CommError
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.placements import Shard

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, timeout_s=2))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    if mesh.rank == 1:
        return "away"
    tmp = Path(folder) / "step_00000003.tmp"
    tmp.mkdir(parents=True)
    engine = SimpleNamespace(comm=Comm(mesh), is_main=True, world_size=2)
    try:
        checkpoint._write_and_publish(folder, 3, tmp, [Shard("w", (4,), (0,), torch.ones(4))], {}, engine, None, 2,
                                      group)
    except CommError as err:
        return str(err)
    return "saved without rank 1"


def test_a_rank_missing_from_a_save_is_named_in_one_line(distributed, tmp_path):
    message, away = distributed.run(2, save_while_rank_1_is_away, str(tmp_path))
    assert away == "away" and "\n" not in message
    assert message.startswith("saving the checkpoint of step 3 failed on rank 0 "), message
    assert message.endswith("rank 1 of the group [0, 1] did not reach it (dead, or stuck elsewhere)"), message


def load_while_rank_1_is_away(folder: str) -> str:
    """Rank 0 resumes; rank 1 never joins. DCP's collectives failing inside a load (here: its
    reader made to raise what gloo raises on a timeout, which DCP lets through) must be one line
    naming the missing rank, not "unreadable"."""
    from pathlib import Path
    from types import SimpleNamespace

    from threefold.config import ParallelConfig
    from threefold.distributed.comm import Comm, CommError
    from threefold.distributed.mesh import ParallelMesh
    from threefold.parallel.placements import Shard
    from threefold.train import dcp_pieces

    mesh = ParallelMesh.from_config(ParallelConfig(dp=2, timeout_s=2))
    if mesh.rank == 1:
        return "away"
    path = Path(folder) / "step_00000003"
    dcp_pieces.save_pieces(path, {"w": [Shard("w", (4,), (0,), torch.ones(4))]}, no_dist=True)

    def gloo_timeout(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")

    dcp_pieces.load_pieces, saved = gloo_timeout, dcp_pieces.load_pieces
    try:
        checkpoint._read_on_every_rank(path, {"w": [Shard("w", (4,), (0,), torch.zeros(4))]},
                                       SimpleNamespace(comm=Comm(mesh)))
    except CommError as err:
        return str(err)
    finally:
        dcp_pieces.load_pieces = saved
    return "loaded without rank 1"


def test_a_rank_missing_from_a_resume_is_named_in_one_line(distributed, tmp_path):
    message, away = distributed.run(2, load_while_rank_1_is_away, str(tmp_path))
    assert away == "away" and "\n" not in message
    assert message.startswith("loading the checkpoint step_00000003 failed on rank 0 "), message
    assert "Timed out waiting 2000ms" in message
    assert message.endswith("rank 1 of the group [0, 1] did not reach it (dead, or stuck elsewhere)"), message


# --- what a resume refuses, before any rank starts (a new user's audit) ------------------------------
def test_a_checkpoint_read_with_another_tokenizer_is_refused(tmp_path):
    """A run on another corpus trains another BPE: the checkpoint's embedding rows would be read
    as other tokens. Its own tokenizer passes."""
    from threefold.data.tokenizer import save_tokenizer, train_bpe

    saved = train_bpe(iter(["to be or not to be, that is the question"] * 50), 300)
    other = train_bpe(iter(["the quick brown fox jumps over the lazy dog"] * 50), 300)
    save_tokenizer(saved, tmp_path / "tokenizer.json")
    checkpoint.check_tokenizer(tmp_path, saved, "train.resume")
    with pytest.raises(ConfigError, match=r"^train.resume: .* was trained with another tokenizer: 24 of the 281 "
                                          r"token ids it knows mean another token in this run's"):
        checkpoint.check_tokenizer(tmp_path, other, "train.resume")
    saved.hf.add_special_tokens(["<|pad|>"])  # a token added after the others moves no id: accepted
    checkpoint.check_tokenizer(tmp_path, saved, "model.init_from")


def test_a_resume_is_checked_before_the_ranks_start(tmp_path, corpus):  # noqa: F811
    """Another seed, a weights-only folder, a step folder without trainer.json: one line each,
    naming the key and what to do."""
    from threefold.train.preflight import check_run
    from threefold.train.trainer import train

    ckpt = tmp_path / "ckpt"
    common = ["train.steps=2", "train.checkpoint_every=2", f"train.checkpoint_dir={json.dumps(str(ckpt))}"]
    train(trainer_config(tmp_path, corpus, *common), progress=False)
    with pytest.raises(ConfigError, match=r"^train.seed: .*step_000002' was saved with train.seed=\d+, this run has "
                                          r"7; .* resume with --set train.seed="):
        check_run(trainer_config(tmp_path, corpus, *common, "train.resume=true", "train.seed=7"))
    cfg = make_config("single")
    model = Llama(cfg.model)
    checkpoint.save_weights(tmp_path / "imported", model, {"config": cfg.to_dict()}, tokenizer=None)
    with pytest.raises(ConfigError, match="holds imported weights, not a run to resume; start a new run from them "
                                          "with model.init_from"):
        checkpoint.check_root(tmp_path / "imported")
    (checkpoint.step_dir(ckpt, 2) / "trainer.json").unlink()
    for check in (lambda: check_run(trainer_config(tmp_path, corpus, *common, "train.resume=true")),
                  lambda: checkpoint.resolve(checkpoint.step_dir(ckpt, 2))):  # train, and generate or inspect
        with pytest.raises(ConfigError, match=r"step_000002' lacks trainer.json .*; remove step_000002 to use the "
                                              "checkpoint before it"):
            check()


def test_a_resumed_run_rewrites_the_steps_after_its_checkpoint_once(tmp_path, corpus):  # noqa: F811
    """Steps after the checkpoint that a failure cut short are in the metrics file once, as the
    resumed run wrote them, its first marked as a warm-up, which compare leaves out as it does the
    run's first; a resume with nothing left to train says so and changes nothing."""
    from threefold.plan.compare import read_steps
    from threefold.train.trainer import train

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = ["train.steps=3", "train.checkpoint_every=2", f"train.checkpoint_dir={json.dumps(str(ckpt))}"]
    train(trainer_config(tmp_path, corpus, *common), metrics_file=str(metrics), progress=False)
    shutil.rmtree(checkpoint.step_dir(ckpt, 3))  # as if the run had failed after step 3, before saving it
    with metrics.open("a") as file:
        file.write('{"step": 4, "lo')  # and been killed writing step 4's record
    train(trainer_config(tmp_path, corpus, *common, "train.resume=true"), metrics_file=str(metrics), progress=False)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(line).get("warmup", False) for line in metrics.read_text().splitlines()] == [True, False, True]
    assert [record["step"] for record in read_steps(metrics)] == [2]
    done = train(trainer_config(tmp_path, corpus, *common[1:], "train.steps=2", "train.resume=true"),
                 metrics_file=str(metrics), progress=False)
    assert done.losses == [] and [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
