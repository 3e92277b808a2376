"""The dry run (threefold/train/dryrun.py) and construction at any scale: a rank builds only its
share of the model (threefold/train/engine.py's cut_model), the engine runs one real step of
any rank of a large world on fake tensors, and on the meta device every layout of the
equivalence matrix runs without a tensor created on a fixed device."""
from __future__ import annotations

import math

import pytest
import torch

from tests.equivalence import CASES, dry_run, dry_run_case, matrix_config
from threefold.cli import main
from threefold.distributed.comm import Comm
from threefold.distributed.mesh import ParallelMesh
from threefold.models.llama import Llama
from threefold.parallel.pipeline.schedule import Kind
from threefold.plan.dryrun_predict import predict_rank
from threefold.train import engine as engine_module
from threefold.train.dryrun import dry_run_config, dry_run_rank, result_table

# The tiny model at world 256: tp2 (sequence parallel) × pp4 (1F1B) × dp32 (ZeRO-1), four
# micro-batches of two sequences per replica.
WORLD_256 = ["model.preset=tiny", "model.vocab_size=4096", "model.seq_len=128", "parallel.tp=2", "parallel.pp=4",
             "parallel.dp=auto", "parallel.zero=1", "parallel.sequence_parallel=true", "train.global_batch=256",
             "train.micro_batch=2"]


@pytest.mark.parametrize("name", list(CASES))
def test_meta_device_runs_every_layout_of_the_matrix(name):
    """On the meta device, a tensor the engine made on the CPU meets a meta one and fails. Each
    layout's states and bytes are also the planner's (predict_rank), exactly. (Not its
    activations: meta tensors have no storage for the meter to tell views apart by.)"""
    cfg = dry_run_case(name)
    # the first and the last pipeline stage; without a pipeline every rank plays the same part
    for rank in sorted({0, cfg.parallel.world_size - 1}) if cfg.parallel.pp > 1 else [0]:
        result, want = dry_run_rank(cfg, rank, device="meta"), predict_rank(cfg, rank)
        assert result["memory"]["params"] > 0 and result["memory"]["optimizer"] > 0
        assert result["comm_bytes"]  # every layout here has more than one rank
        for key in ("params", "grads", "optimizer"):
            assert result["memory"][key] == want["memory"][key], key
        for key, value in want["comm_bytes"].items():
            assert result["comm_bytes"][key] == value, key


# One layout of the matrix for each way of saving tensors: ZeRO-3's gathers, tp with SP, the
# pipeline schedules (interleaved, ZB-H1's deferred W, DualPipeV's two ends on rank 0), each CP
# method with tp, pp and hybrid sharding, and full recomputation.
ACTIVATION_CASES = ["dp2-zero3", "tp2-sp", "dp2-pp2-interleaved-zero1", "dp2-pp2-zb-h1-zero1", "dp2-pp2-zb-h1-zero3",
                    "pp2-dualpipev",
                    "dp2-tp2-pp2-1f1b-zero1", "tp2-cp2-sp-allgather", "tp2-cp2-ulysses", "pp2-cp2-ring",
                    "dp4-cp2-hsdp2-ring", "cp2-ulysses-full"]


@pytest.mark.parametrize("name", ACTIVATION_CASES)
def test_a_layouts_activations_are_the_planners_to_the_byte(name):
    """On CPU fake tensors the activation meter sees storages: the first and the last stage's
    peak is predict_rank's to the byte (the blocks, the head, each CP method's own saves, and the
    engine's token ids, masks and gathered rotary tables: bookkeeping_activation_bytes; before
    those the matrix measured 0.996–1.005 of the prediction, and the rotary buffers' views counted
    as activations)."""
    cfg = dry_run_case(name)
    for rank in sorted({0, cfg.parallel.world_size - 1}) if cfg.parallel.pp > 1 else [0]:  # else all alike
        assert dry_run(cfg, rank)["memory"]["activations"] == predict_rank(cfg, rank)["memory"]["activations"]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_full_recomputation_under_cp_and_pp_saves_the_steps_positions_once(schedule):
    """The blocks save the step's one positions tensor as an input, whatever the micro-batches
    and stages in flight (predicted per pair, GPipe's last stage was 384 bytes over)."""
    cfg = dry_run_config(load(["model.preset=tiny", "model.vocab_size=256", "model.seq_len=64", "parallel.pp=2",
                               "parallel.cp=2", "train.recompute=full", f"parallel.schedule={schedule}",
                               "train.global_batch=4", "train.micro_batch=1"]), 4)
    for rank in (0, 3):
        assert dry_run_rank(cfg, rank)["memory"]["activations"] == predict_rank(cfg, rank)["memory"]["activations"]


def test_sequence_parallel_at_tp_1_is_predicted_as_the_engine_runs_it():
    """The engine runs without it at tp 1; predict_rank had priced it on, 2× under in bf16."""
    overrides = ["model.preset=tiny", "model.vocab_size=256", "model.seq_len=64", "parallel.dp=2",
                 "parallel.sequence_parallel=true", "train.dtype=bfloat16", "train.global_batch=4",
                 "train.micro_batch=2"]
    cfg = dry_run_config(load(overrides), 2)
    assert dry_run_rank(cfg, 0)["memory"]["activations"] == predict_rank(cfg, 0)["memory"]["activations"]


def test_trains_memory_check_is_the_dry_runs_fullest_rank():
    """``threefold train`` refuses a run that will not fit by this model (train/preflight.py). It
    had scaled the planner's activations by dtype, 17.5 GiB where the dry run measures 29.8 for
    llama3-8b dp2·cp4 bf16; now it is the fullest stage's measured bytes and its backward's working
    set, plus the sampler's ids and the process itself."""
    from threefold.plan.dryrun_predict import rank_share
    from threefold.train.preflight import INPUT_BYTES_PER_TOKEN, rank_memory, working_bytes

    cfg = dry_run_config(load(["model.preset=tiny", "model.vocab_size=512", "model.seq_len=64", "parallel.pp=2",
                               "parallel.cp=2", "parallel.dp=2", "parallel.zero=1", "train.dtype=bfloat16",
                               "train.global_batch=8", "train.micro_batch=1"]), 8)
    totals = []
    for rank in (0, 7):  # the first and the last stage, whose backward also holds the loss's softmax
        measured = dry_run_rank(cfg, rank)["memory"]
        totals.append(sum(measured[k] for k in ("params", "grads", "optimizer", "activations"))
                      + working_bytes(cfg, rank_share(cfg, rank // 4), measured["activations"]))
    assert totals[0] != totals[1]  # the stages differ: the fuller one counts
    need = rank_memory(cfg, process_bytes=1e6, cuda=False)
    assert need.pop("batch") == 8 // 2 * 64 * INPUT_BYTES_PER_TOKEN and need.pop("process") == 1e6
    assert sum(need.values()) == max(totals)


def test_a_pipedream_stage_holds_the_steady_states_weight_versions():
    """PipeDream keeps pp − s versions of stage s's weights once the run is going; the first
    step's stage 0 holds two. The dry run is a step in the middle of the run, as the planner
    prices it: stage 0 of pp 4 holds 4 copies (it measured 2), the last stage 1."""
    cfg = dry_run_config(load(["model.preset=tiny", "model.vocab_size=256", "model.seq_len=32", "parallel.pp=4",
                               "parallel.schedule=pipedream", "model.layers=4", "train.global_batch=1",
                               "train.micro_batch=1"]), 4)
    for rank, copies in ((0, 4), (1, 3), (3, 1)):
        result = dry_run_rank(cfg, rank)
        got, want = result["memory"], predict_rank(cfg, rank)["memory"]
        assert got["weight_versions"] == want["weight_versions"] == copies * got["params"], rank
    assert result["steps_run"] == 2 and "2 steps in" in result_table(cfg, result).title
    assert "the last (a steady one) shown" in result_table(cfg, result).title


def test_meta_device_catches_a_tensor_made_on_the_cpu(monkeypatch):
    """What the mode is for: the runtime's receive buffers made without a device fail."""
    from threefold.parallel.pipeline import runtime

    class TorchWithCpuEmpty:  # the runtime's torch, whose empty() forgets the device it is given
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, device=None, **kwargs):
            return torch.empty(*args, **kwargs)

    monkeypatch.setattr(runtime, "torch", TorchWithCpuEmpty())
    cfg = dry_run_config(matrix_config(*CASES["pp2-1f1b"]), 2)
    with pytest.raises(RuntimeError, match="device"):
        dry_run_rank(cfg, 1, device="meta")


def load(overrides):
    from threefold.configure import load_config

    return load_config(None, overrides)


def test_a_step_at_256_ranks_equals_the_planner():
    cfg = dry_run_config(load(WORLD_256), 256)
    assert cfg.parallel.dp == 32
    first, last = 0, 192  # pipeline rank 0, and the first rank of pipeline rank 3 (pp is outermost)
    for rank in (first, last):
        result = dry_run_rank(cfg, rank)
        want = predict_rank(cfg, rank)
        for key in ("params", "grads", "optimizer"):
            assert result["memory"][key] == want["memory"][key], key
        for key, value in want["comm_bytes"].items():
            assert result["comm_bytes"][key] == value, key
        # the actions this rank executed are its schedule's, in order
        from threefold.parallel.pipeline.schedule import build_schedule

        schedule = build_schedule("1f1b", 4, cfg.microbatches)
        pp_rank = rank // 64
        assert [(a[2], a[3], a[4]) for a in result["actions"]] == \
            [(a.kind.value, a.microbatch, a.stage) for a in schedule.actions[pp_rank]]
        assert Kind.FORWARD.value in {a[2] for a in result["actions"]}
        # to the byte: the blocks, the head and the engine's token ids and masks (bookkeeping_activation_bytes)
        assert result["memory"]["activations"] == want["memory"]["activations"]
    assert set(predict_rank(cfg, last)["comm_bytes"]) == {"dp", "tp", "tp.loss", "pp"}  # ZeRO-1 cuts the partial gradients


def test_llama3_8b_at_256_ranks_equals_the_planner():
    """A mid-size preset at a few hundred ranks in the suite: the last stage of Llama 3 8B on
    tp8 · pp4 · dp8 with sequence parallelism (2,048 tokens, 4 micro-batches; about 10 s)."""
    cfg = dry_run_config(load(["model.preset=llama3-8b", "model.seq_len=2048", "parallel.tp=8", "parallel.pp=4", "parallel.dp=auto",
                               "parallel.sequence_parallel=true", "train.global_batch=32", "train.micro_batch=1"]), 256)
    result, want = dry_run_rank(cfg, 192), predict_rank(cfg, 192)
    assert cfg.parallel.dp == 8 and set(want["comm_bytes"]) == {"dp", "tp", "tp.loss", "tp.partial_grads", "pp"}
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    assert result["memory"]["activations"] == want["memory"]["activations"]  # 1.0028 before the token ids and masks


@pytest.mark.parametrize("zero", [2, 3])
def test_hybrid_sharding_at_256_ranks_equals_the_planner(zero):
    """HSDP at scale: ZeRO-3 (and ZeRO-2, Megatron-Core's distributed optimizer instances) over
    groups of 8 dp ranks and their cp pair (16 ranks), the 16 groups all-reduced: states 1/16 a
    rank, not 1/256; the gathers and reduce-scatters under "dp+cp", the all-reduce between the
    groups, over dp ranks alone, under "dp" (ZeRO-2: once a step, the step's shards)."""
    cfg = dry_run_config(load(["model.preset=tiny", "model.vocab_size=4096", "model.seq_len=128", "parallel.dp=auto",
                               "parallel.cp=2", f"parallel.zero={zero}", "parallel.dp_shard=8", "train.global_batch=256",
                               "train.micro_batch=2"]), 256)
    assert (cfg.parallel.dp, cfg.parallel.dp_replicate) == (128, 16)
    result, want = dry_run_rank(cfg, 255), predict_rank(cfg, 255)
    assert set(want["comm_bytes"]) == {"dp", "dp+cp", "cp"}
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == pytest.approx(value, rel=1e-9, abs=1), key
    plain = predict_rank(dry_run_config(load(["model.preset=tiny", "model.vocab_size=4096", "model.seq_len=128",
                                              "parallel.dp=auto", "parallel.cp=2", f"parallel.zero={zero}",
                                              "train.global_batch=256", "train.micro_batch=2"]), 256), 255)
    assert want["memory"]["optimizer"] == pytest.approx(16 * plain["memory"]["optimizer"])


@pytest.mark.parametrize("method", ["ring", "allgather", "ulysses"])
def test_a_context_parallel_step_equals_the_planner(method):
    """tp2 · cp2 · dp2 with sequence parallelism, each method, selective recomputation (which
    repeats the ring's and the all-gather's sends): states and bytes on every axis exact, the
    gradients' under "dp+cp"; activations those of a rank's seq_len / cp tokens."""
    cfg = dry_run_config(load(["model.preset=tiny", "model.vocab_size=512", "parallel.tp=2", "parallel.cp=2",
                               "parallel.dp=2", "parallel.sequence_parallel=true", f"parallel.cp_method={method}",
                               "train.recompute=selective", "train.global_batch=4", "train.micro_batch=1"]), 8)
    result, want = dry_run_rank(cfg, 5), predict_rank(cfg, 5)
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    assert set(want["comm_bytes"]) == {"dp+cp", "cp", "tp", "tp.loss", "tp.partial_grads"}  # one replica: whole
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    # Each method's own saves: the ring and the all-gather keep k and v without the grouped-query
    # repeats, Ulysses its output twice (predict_rank; before it counted them, 0.96 and 1.05 of
    # the measured), with the rotary tables gathered at the rank's positions and Ulysses' two
    # orderings of the sequence (bookkeeping_activation_bytes): to the byte.
    assert result["memory"]["activations"] == want["memory"]["activations"]


# Ledger keys of bookkeeping the planner leaves out (scalars, the tied embedding's gradient, the
# timeline, the partial gradients summed over tp under SP where ZeRO shards them): everything
# else must be predicted.
UNMODELLED = (".scalar", ".tied", ".timeline", ".partial_grads")
CP_BF16 = ["model.preset=tiny", "model.vocab_size=512", "parallel.tp=2", "parallel.cp=2", "parallel.dp=2",
           "parallel.sequence_parallel=true", "parallel.cp_method=ring", "train.recompute=selective",
           "train.global_batch=4", "train.micro_batch=1"]
MOE_BF16 = ["model.preset=tiny-moe", "model.vocab_size=512", "parallel.dp=2", "parallel.ep=2", "train.global_batch=8",
            "train.micro_batch=2"]


@pytest.mark.parametrize("overrides, world, ranks", [
    (WORLD_256, 256, (0, 255)),  # pp, tp with SP
    (WORLD_256 + ["parallel.sequence_parallel=false"], 256, (0, 255)),  # tp without SP, its scatter/gather
    (WORLD_256 + ["parallel.tp_overlap=true"], 256, (255,)),  # SP's collectives as rings of sends
    (WORLD_256 + ["train.recompute=full"], 256, (255,)),
    (CP_BF16, 8, (5,)),  # cp ring, tp2 · cp2 · dp2
    (MOE_BF16, 2, (1,)),  # ep2
    (MOE_BF16 + ["parallel.tp=2", "parallel.sequence_parallel=true"], 4, (3,)),  # ep2 with tp2 SP
    (["model.preset=mixtral-8x7b", "parallel.dp=8", "parallel.ep=8", "parallel.zero=1", "train.global_batch=8",
      "train.micro_batch=1"], 8, (7,)),  # a published MoE at ep8 (about 10 s)
    # dp 1: the experts' own sync (their learning-rate scale) reduces over cp, under "cp" as the dense one's
    (["model.preset=tiny-moe", "model.vocab_size=512", "parallel.cp=2", "model.moe_expert_lr_scale=0.5",
      "train.global_batch=4", "train.micro_batch=2"], 2, (1,)),
], ids=["pp-tp-sp", "tp", "tp-overlap", "full-recompute", "cp-ring", "ep", "ep-tp-sp", "mixtral-ep8", "cp-expert-sync"])
def test_a_bf16_step_equals_the_planner(overrides, world, ranks):
    """The engine's bf16 is autocast over fp32 weights: bf16 products, an fp32 residual stream
    (costs.ENGINE_BYTES). Every key of the ledger's bulk traffic is predicted to the byte with
    those widths; activations to the byte where dense (within 0.2% with MoE blocks), the fp32
    stream and the weights' bf16 copies included (costs.autocast_activation_bytes)."""
    cfg = dry_run_config(load(overrides + ["train.dtype=bfloat16"]), world)
    for rank in ranks:
        result, want = dry_run(cfg, rank), predict_rank(cfg, rank)
        for key in ("params", "grads", "optimizer"):
            assert result["memory"][key] == want["memory"][key], key
        bulk = {key for key, value in result["comm_bytes"].items()
                if value and (not key.endswith(UNMODELLED) or key in want["comm_bytes"])}
        assert bulk and set(want["comm_bytes"]) == bulk, (rank, bulk)
        for key, value in want["comm_bytes"].items():
            assert result["comm_bytes"][key] == value, (rank, key)
        # dense: to the byte; an MoE block's routing bookkeeping is estimated (moe_activation_bytes)
        tolerance = 0.002 if cfg.model.moe_experts else 0
        assert result["memory"]["activations"] == pytest.approx(want["memory"]["activations"], rel=tolerance), rank


def test_bf16_widths_are_the_engines():
    """What the widths mean at 256 ranks: the pipeline's messages are the fp32 stream (as in an
    fp32 run), tp's collectives lie between all-bf16 and all-fp32, and the activations are above
    a pure-bf16 count (5,242,880 tp bytes on rank 0: 3,145,728 if every activation were bf16)."""
    bf16 = dry_run_config(load(WORLD_256 + ["train.dtype=bfloat16"]), 256)
    fp32 = dry_run_config(load(WORLD_256), 256)
    got, same_in_fp32 = predict_rank(bf16, 0)["comm_bytes"], predict_rank(fp32, 0)["comm_bytes"]
    assert got["pp"] == same_in_fp32["pp"]
    assert same_in_fp32["tp"] / 2 < got["tp"] == 5_242_880 < same_in_fp32["tp"]
    assert dry_run_rank(bf16, 0)["comm_bytes"]["tp"] == got["tp"]


def test_values_read_from_fake_tensors_are_nan():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(())
    assert math.isnan(engine_module.value_of(fake))
    assert engine_module.values_of(torch.ones(2, device="meta")) is None
    assert engine_module.value_of(torch.tensor(2.5)) == 2.5


@pytest.mark.parametrize("args, message", [
    (["--set", "parallel.tp=2", "--world-size", "3"], "--world-size: the layout"),
    (["--set", "parallel.tp=2", "--set", "parallel.dp=auto", "--world-size", "3"], 'parallel.dp: "auto" on 3'),
    (["--set", "parallel.tp=2", "--world-size", "2", "--rank", "2"], "--rank: 2 is outside a world of 2"),
    (["--set", "model.preset=llama3-9b", "--world-size", "1"], "model.preset: unknown preset 'llama3-9b'"),
    (["--set", "model.preset=gpt3-175b", "--world-size", "1"], "model.arch: 'gpt' is planner-only"),
    (["--set", "model.preset=tiny-moe", "--set", "model.moe_capacity_factor=0.5", "--world-size", "1"],
     "model.moe_capacity_factor: 0.5 drops tokens"),  # it had died in aten.bincount on fake tensors
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(["dryrun", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_json_shape(capsys):
    import json

    overrides = [x for o in ["model.preset=tiny", "model.vocab_size=512", "model.layers=2", "parallel.dp=2",
                             "train.global_batch=4", "train.micro_batch=1"] for x in ("--set", o)]
    assert main(["dryrun", *overrides, "--world-size", "2", "--rank", "1", "--compare", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["rank"] == 1 and record["steps_run"] == 1
    # the title's layout names every axis over 1, so that it multiplies to the world size
    from threefold.config import ParallelConfig

    assert ParallelConfig(dp=2, cp=2, ep=2).sizes_text() == "dp=2 × tp=1 × pp=1 × cp=2 × ep=2"
    assert ParallelConfig(tp=2, ep=2, expert_tp=1).sizes_text() == "dp=1 × tp=2 × pp=1 × ep=2 folded"
    assert set(record["memory"]) == {"params", "grads", "optimizer", "activations"}
    assert set(record["predicted"]) == {"memory", "comm_bytes", "live_peak"}
    assert record["comm_bytes"]["dp"] == record["predicted"]["comm_bytes"]["dp"]
    # the [parallel] section the ranks ran, so that a reader can tell two dry runs' layouts apart
    assert record["parallel"]["dp"] == 2 and record["parallel"]["zero"] == 0
    assert record["parallel"]["reshard_after_forward"] is True
    # resolved as estimate's JSON says it: under a pipeline ZeRO-3 keeps its units (the default),
    # and below ZeRO-3 nothing is kept, so a section fed back as a config is accepted
    for zero, resharding in ((1, True), (3, False)):
        sets = [x for o in ["model.preset=tiny", "model.vocab_size=512", "model.layers=2", "parallel.dp=2",
                            "parallel.pp=2", f"parallel.zero={zero}", "train.global_batch=8", "train.micro_batch=1"]
                for x in ("--set", o)]
        assert main(["dryrun", *sets, "--world-size", "4", "--rank", "0", "--json", "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)["parallel"]["reshard_after_forward"] is resharding


# --- construction: a rank draws and keeps only its share --------------------------------------
def cut_for(overrides, sizes, rank, monkeypatch):
    """This rank's cut of the tiny model built on meta, recording every tensor drawn."""
    cfg = load(["model.preset=tiny", "model.vocab_size=512"] + overrides)
    drawn = []
    real = engine_module.initial_value

    def recording(model_cfg, name, shape, seed):
        drawn.append(name)
        return real(model_cfg, name, shape, seed)

    monkeypatch.setattr(engine_module, "initial_value", recording)
    with torch.device("meta"):
        model = Llama(cfg.model)
    mesh = ParallelMesh(sizes, rank)  # coordinates only: no process group
    return cfg, engine_module.cut_model(model, cfg, mesh, Comm(mesh)), drawn


def test_a_rank_of_pp4_draws_only_its_stages_tensors(monkeypatch):
    cfg, cut, drawn = cut_for(["parallel.pp=4"], {"pp": 4}, 2, monkeypatch)  # 4 layers: stage 2 is block 2
    assert list(cut.parts) == [2]
    assert drawn and all(name.startswith("blocks.2.") for name in drawn), drawn
    assert sorted(drawn) == sorted(k for k, _ in cut.parts[2].named_parameters())
    assert not any(q.is_meta for q in cut.parts[2].parameters())


def test_a_rank_of_tp2_holds_only_its_shards(monkeypatch):
    cfg, cut, drawn = cut_for(["parallel.tp=2"], {"tp": 2}, 1, monkeypatch)
    model = cut.parts[0]
    single = Llama(cfg.model)
    single.init_weights(cfg.train.seed)
    full = single.state_dict()
    sharded = 0
    for key, q in model.named_parameters():
        placement = cut.placements[key]
        assert not q.is_meta
        if placement.dim is not None:  # a tp shard: half the rows or columns, rank 1's half
            sharded += 1
            assert q.shape[placement.dim] * 2 >= placement.full_shape[placement.dim]
            assert q.numel() < math.prod(placement.full_shape)
            want = full[key].narrow(placement.dim, placement.start, min(q.shape[placement.dim],
                                    full[key].shape[placement.dim] - placement.start))
            assert torch.equal(q.narrow(placement.dim, 0, want.shape[placement.dim]), want), key
        else:
            assert torch.equal(q, full[key]), key
    assert sharded == 4 * 7 + (1 if cfg.model.tie_embeddings else 2)  # every block's 7 matrices, embedding, head
    held = sum(q.numel() for q in model.parameters())
    assert held < 0.6 * sum(v.numel() for v in full.values())


def test_a_long_steps_actions_are_shown_by_their_ends():
    """512 micro-batches printed 2,000 actions on one line; the table shows the first 36 and last 12."""
    from threefold.train.dryrun import SHOWN_ACTIONS, actions_line

    actions = [[0.0, 0.0, kind, mb, 0] for mb in range(512) for kind in ("F", "B", "W")]
    line = actions_line(actions).split(" ")
    assert line[:3] == ["F0", "B0", "W0"] and line[-3:] == ["F511", "B511", "W511"]
    assert f"{len(actions) - SHOWN_ACTIONS:,}" in " ".join(line) and len(line) < SHOWN_ACTIONS + 5
    assert actions_line(actions[:6]) == "F0 B0 W0 F1 B1 W1"


@pytest.mark.parametrize("schedule", ["2bw", "pipedream"])
def test_compare_predicts_the_weight_versions_the_engine_keeps(schedule):
    """2bw and pipedream keep whole copies of each stage's weights; --compare had no figure for them."""
    from threefold.configure import load_config
    from threefold.plan.dryrun_predict import predict_rank

    sets = ['model.preset="tiny"', "model.vocab_size=256", "model.seq_len=32", "parallel.pp=2", "parallel.dp=2",
            f'parallel.schedule="{schedule}"', f"train.global_batch={8 if schedule == '2bw' else 4}",
            "train.micro_batch=2"]  # pipedream steps once a micro-batch
    cfg = dry_run_config(load_config(None, sets), 4)
    for rank in (0, 2):
        got, want = dry_run_rank(cfg, rank)["memory"], predict_rank(cfg, rank)["memory"]
        assert got.get("weight_versions", 0) == want.get("weight_versions", 0)
        if rank == 0:  # the first stage's batches use more than one version
            assert want["weight_versions"] >= 2 * got["params"]


@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("ep, expert_lr, dp, dp_shard, zero", [(1, 1.0, 4, 2, 3), (1, 0.5, 4, 2, 3), (2, 1.0, 8, 4, 3),
                                                             (2, 1.0, 4, 2, 3), (2, 1.0, 8, 4, 2), (2, 0.5, 4, 2, 1)])
def test_hybrid_sharding_of_an_moe_model_equals_the_planner(cp, ep, expert_lr, dp, dp_shard, zero):
    """At ep = 1 the experts are sharded like the rest (pairs of dp ranks × cp), by the dense
    sync or by their own (expert_lr 0.5: their own group); at ep = 2 the dense weights over
    groups of dp_shard dp ranks (ep pairs) and the experts over the dp_shard / ep of them that
    hold the same experts (× cp): 2 at dp_shard 4; at dp_shard 2 one rank at cp 1, which the
    engine runs as plain data parallelism between the groups. The dry run's states and bytes
    are the planner's, the all-reduce between the groups under "dp" where cp > 1. ZeRO-1 and 2
    shard over the same groups, and all-reduce the step's shards once."""
    cfg = dry_run_config(load(['model.preset="tiny"', "model.vocab_size=256", "model.seq_len=32", "model.layers=4",
                               "model.moe_experts=4", "model.moe_top_k=2", f"model.moe_expert_lr_scale={expert_lr}",
                               f"parallel.dp={dp}", f"parallel.ep={ep}", f"parallel.cp={cp}", f"parallel.zero={zero}",
                               f"parallel.dp_shard={dp_shard}", f"train.global_batch={4 * dp}",
                               "train.micro_batch=2"]), dp * cp)
    rank = dp * cp - 1
    result, want = dry_run_rank(cfg, rank), predict_rank(cfg, rank)
    for key in ("params", "grads", "optimizer"):
        assert result["memory"][key] == want["memory"][key], key
    assert ("dp" in want["comm_bytes"]) and (("dp+cp" in want["comm_bytes"]) == (cp > 1))
    for key, value in want["comm_bytes"].items():
        assert result["comm_bytes"][key] == value, key
    if dp_shard == ep and cp == 1:  # the experts: one all-reduce a step between the dp / ep groups, not one a micro-batch
        from threefold.models.sizes import rank_expert_param_count
        from threefold.plan import costs
        from threefold.plan.dryrun_predict import rank_share

        share, groups = rank_share(cfg, 0), dp // ep
        dense = costs.dp_bytes_per_step(share.numel, dp, zero, cfg.microbatches, shard=dp_shard)
        experts = share.moe_blocks * rank_expert_param_count(cfg.model, ep)
        assert cfg.microbatches > 1 and result["comm_bytes"]["dp"] == dense + 2 * (groups - 1) / groups * experts * 4


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1", "1f1b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_head_stage_holds_the_head_tensors_of_each_micro_batch_its_schedule_keeps(schedule, dtype):
    """The last stage of pp 2 × tp 2 (no SP), 4 micro-batches: GPipe holds the final norm's tensors
    and log-probabilities of all 4, ZB-H1 the norms of 2 (until their deferred W) and one
    micro-batch's log-probabilities, 1F1B one of each; in bf16 also autocast's copy of the head's
    weight per micro-batch. The planner's figure was 2.2× short for GPipe's last stage and 7.7%
    for ZB-H1's at pp 4 when it counted one micro-batch's."""
    cfg = dry_run_config(load(['model.preset="tiny"', "model.layers=8", "model.vocab_size=8192", "model.seq_len=256",
                               "parallel.pp=2", "parallel.tp=2", f"parallel.schedule={schedule}",
                               f"train.dtype={dtype}", "train.global_batch=8", "train.micro_batch=2"]), 4)
    result, want = dry_run_rank(cfg, 3), predict_rank(cfg, 3)
    assert result["memory"]["activations"] == want["memory"]["activations"]
