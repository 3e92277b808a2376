"""``threefold estimate`` (one layout, or a JSONL file of them) and ``threefold plan`` (search).

Flags and JSON keys are documented in docs/planner.md ("Commands and their inputs"). In ``--batch`` mode each
input line is an object whose keys are the flags' long names with underscores; flags given on
the command line are the defaults every line starts from.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import re

import click
import numpy as np
from rich.console import Console

from threefold.config import INT_MAX, ConfigError, ModelConfig, check_output_path, note_once, notes_after_checks
from threefold.models.presets import PRESETS, get_preset
from threefold.parallel.pipeline.schedule import SCHEDULE_REGISTRY
from threefold.plan import costs, report, search
from threefold.plan.hardware import CATALOG, DTYPES, compute_dtype, get_gpu, load_cluster
from threefold.plan.pictures import check_picture_path, draw_breakdown
from threefold.words import plural

# Flag → ModelConfig field, for the model's shape.
MODEL_FIELDS = {"arch": "arch", "layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
                "ffn": "ffn", "vocab": "vocab_size", "seq_len": "seq_len", "tie_embeddings": "tie_embeddings",
                "moe_experts": "moe_experts", "moe_top_k": "moe_top_k", "moe_ffn": "moe_ffn",
                "moe_shared_experts": "moe_shared_experts", "moe_first_dense": "moe_first_dense",
                "moe_every": "moe_every"}
MOE_FLAGS = ("moe_top_k", "moe_ffn", "moe_shared_experts", "moe_first_dense", "moe_every", "moe_imbalance")
REQUIRED_WITHOUT_PRESET = ("layers", "hidden", "heads", "vocab", "seq_len")


class _Choice(click.Choice):
    """A flag's choices in any case and with '_' or ' ' for '-' (a published run's row may say
    "1F1B", "Selective" or "zb_h1"), and the other names frameworks give them."""

    def __init__(self, values, synonyms: dict[str, str] | None = None):
        super().__init__(list(values), case_sensitive=False)
        self.synonyms = synonyms or {}

    def convert(self, value, param, ctx):
        key = str(value).strip().lower()
        if key not in self.choices:
            key = key.replace("_", "-").replace(" ", "-")
        key = self.synonyms.get(key, key)
        return super().convert(key if key in self.choices else value, param, ctx)  # refused: as it was given


def choice(values, synonyms: dict[str, str] | None = None) -> click.Choice:
    """A flag's choices, read as _Choice reads them (any case, other frameworks' names)."""
    return _Choice(values, synonyms)


# Megatron's "interleaved 1F1B" (PyTorch's ScheduleInterleaved1F1B); PipeDream-Flush is 1F1B.
SCHEDULE_SYNONYMS = {"interleaved-1f1b": "interleaved", "1f1b-interleaved": "interleaved", "interleaved1f1b": "interleaved",
                     "zbh1": "zb-h1", "zero-bubble": "zb-h1", "dualpipe-v": "dualpipev", "pipedream-flush": "1f1b"}
# Mixed precision as trainers name it (llm-foundry's amp_bf16, Lightning's bf16-mixed and 16-mixed,
# a paper's "fp16 mixed"): the products run in the 16-bit type, so its peak.
DTYPE_SYNONYMS = {f"{prefix}{name}{suffix}": name for name in ("bf16", "fp16") for prefix, suffix in
                  (("amp-", ""), ("", "-mixed"), ("mixed-", ""), ("", "-amp"), ("", "-true"))}
DTYPE_SYNONYMS |= {"16-mixed": "fp16", "fp8-hybrid": "fp8", "fp8-e4m3": "fp8", "e4m3": "fp8"}
# A boolean for activation checkpointing (DeepSpeed's and Megatron's switch: every block's input
# kept, the block rerun in the backward).
RECOMPUTE_SYNONYMS = {"true": "full", "false": "none", "off": "none", "no": "none", "block": "full"}


def _model_options(command):
    options = [
        click.option("--model", type=choice(PRESETS), help="A named model; the shape flags below override it."),
        click.option("--arch", type=choice(["llama", "gpt"]),
                     help="llama: RMSNorm, SwiGLU, rotary (default). gpt: LayerNorm, GELU MLP, learned positions."),
        click.option("--layers", type=int, help="Transformer blocks (required without --model)."),
        click.option("--hidden", type=int, help="Model width (required without --model)."),
        click.option("--heads", type=int, help="Attention heads (required without --model)."),
        click.option("--kv-heads", type=int, help="Key/value heads (grouped-query attention); default: --heads."),
        click.option("--ffn", type=int, help="FFN width; default 4·hidden (gpt) or Llama's ~8/3·hidden."),
        click.option("--vocab", type=int, help="Vocabulary size (required without --model)."),
        click.option("--seq-len", type=int, help="Tokens per sequence (required without --model)."),
        click.option("--tie-embeddings/--no-tie-embeddings", default=None,
                     help="The output head shares the input embedding's weights; default: the preset's, else tied."),
        click.option("--moe-experts", type=int, help="Routed experts per MoE layer (0: dense); makes any shape MoE."),
        click.option("--moe-top-k", type=int, help="Experts per token (default 2)."),
        click.option("--moe-ffn", type=int, help="Each expert's SwiGLU width (default --ffn)."),
        click.option("--moe-shared-experts", type=int, help="Experts every token passes through (DeepSeek)."),
        click.option("--moe-first-dense", type=int, help="Leading layers that stay dense (DeepSeek-V3: 3)."),
        click.option("--moe-every", type=int, help="After them, every n-th layer is MoE (default 1)."),
        click.option("--moe-imbalance", type=float,
                     help="The busiest expert-parallel rank's routed rows over the mean (default 1: balanced "
                          "routing; a run's metrics report its ep_max_over_mean): under --ep every rank waits "
                          "for that rank's experts and exchanges."),
        click.option("--global-batch", type=int, help="Sequences per optimizer step (required)."),
        click.option("--gpu", help="A GPU from --list-gpus, or 'local' (measured by `threefold calibrate`); "
                                   "required unless --cluster describes one."),
        click.option("--cluster", type=click.Path(dir_okay=False),
                     help="A TOML file describing a GPU that is not in the catalog and its nodes (docs/planner.md)."),
        click.option("--num-gpus", type=int, help="GPUs in the job (required by plan; estimate's default: "
                                                  "--tp × --pp × --cp × --dp)."),
        click.option("--gpus-per-node", type=int, help="Default: the GPU's usual node size."),
        click.option("--inter-node-gbps", type=float,
                     help="Network bandwidth per GPU in Gbit/s, one direction (200: DGX A100 HDR; 400: DGX H100 "
                          "NDR); a collective with k members in a node uses their k NICs at once."),
        click.option("--intra-node-gbps", type=float, help="Link bandwidth per GPU inside a node in Gbit/s."),
        click.option("--power-limit-w", type=float,
                     help="Board power limit the GPUs run at, in watts (nvidia-smi -pl): below the rated power "
                          "their products run at the clock it allows, (limit/rated)^(1/3)."),
        click.option("--dtype", type=choice(DTYPES, DTYPE_SYNONYMS), default=None,
                     help="Compute type: the GPU's 16-bit peak (default; bf16, or fp16 as the 2021-22 runs trained, "
                          "at the same tensor-core peak) or its fp32 peak (the engine's default on CPUs: use it with "
                          "--gpu local for fp32 runs), or float8: the blocks' linear layers at the fp8 peak "
                          "(Transformer Engine, torchao), MFU still against the 16-bit peak."),
        click.option("--overlap-dp/--no-overlap-dp", default=True, show_default=True,
                     help="Data-parallel reductions and ZeRO gathers run behind compute (DDP's and FSDP's way)."),
        click.option("--tp-comm-overlap/--no-tp-comm-overlap", default=False, show_default=True,
                     help="Tensor-parallel collectives pipelined with the GEMMs (Megatron-Core's option)."),
        click.option("--attention", type=choice(costs.ATTENTION), default="flash", show_default=True,
                     help="flash never stores the s×s scores; eager stores them (Megatron 2021-22)."),
        click.option("--grad-dtype", type=choice(["fp32", "bf16"]), default="fp32", show_default=True,
                     help="Gradients kept in fp32 (18 bytes of model state per parameter) or bf16 (16)."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def build_model(o: dict) -> ModelConfig:
    if o.get("model"):
        cfg = get_preset(o["model"])
        if o.get("moe_experts") == 0:  # an MoE preset made dense: its other expert settings go too
            dense = ModelConfig()
            cfg = dataclasses.replace(cfg, **{f.name: getattr(dense, f.name) for f in dataclasses.fields(cfg)
                                              if f.name.startswith("moe_")})
    else:
        missing = [flag for flag in REQUIRED_WITHOUT_PRESET if o.get(flag) is None]
        if missing:
            raise ConfigError(f"--{missing[0].replace('_', '-')}: required unless --model PRESET is given")
        cfg = ModelConfig(arch=o.get("arch") or "llama")
    cfg = dataclasses.replace(cfg, **{field: o[flag] for flag, field in MODEL_FIELDS.items() if o.get(flag) is not None})
    if not cfg.moe_experts:
        for flag in MOE_FLAGS:
            if o.get(flag) is not None:
                raise ConfigError(f"--{flag.replace('_', '-')}: set without --moe-experts (a dense model)")
    if cfg.moe_experts < 0:
        raise ConfigError(f"--moe-experts: must not be negative (0 = dense), got {cfg.moe_experts}")
    if cfg.moe_experts and not 1 <= cfg.moe_top_k_experts <= cfg.moe_experts:
        raise ConfigError(f"--moe-top-k: must be between 1 and --moe-experts {cfg.moe_experts}, "
                          f"got {cfg.moe_top_k_experts}{'' if cfg.moe_top_k else ' (the default)'}")
    try:
        cfg.validate()
    except ConfigError as err:  # the config's words, in the flags the user typed ("model.hidden" → "--hidden")
        message = str(err)
        for flag, field in sorted(MODEL_FIELDS.items(), key=lambda item: -len(item[1])):  # moe_ffn before ffn
            message = re.sub(rf"\bmodel\.{field}\b", f"--{flag.replace('_', '-')}", message)
        raise ConfigError(message) from None
    if cfg.vocab_size is None:
        raise ConfigError("--vocab: required: the preset leaves the vocabulary to the tokenizer")
    return cfg


def build_workload(o: dict) -> tuple[costs.Workload, object]:
    """The model, batch and GPU of a command's options."""
    check_sizes(o)
    if o.get("global_batch") is None:
        raise ConfigError("--global-batch: required (sequences per optimizer step)")
    if o["global_batch"] < 1:
        raise ConfigError(f"--global-batch: must be a positive integer (sequences per step), got {o['global_batch']}")
    if o.get("gpu") is None and o.get("cluster") is None:
        raise ConfigError(f"--gpu: required (or --cluster FILE.toml), one of {', '.join([*CATALOG, 'local'])}")
    if o.get("gpu") is not None and o.get("cluster") is not None:
        raise ConfigError("--cluster: describes the GPU itself; give --gpu or --cluster, not both")
    dtype = compute_dtype(o.get("dtype"))
    work = costs.Workload(build_model(o), o["global_batch"], attention=o.get("attention") or "flash",
                          grad_bytes=4 if (o.get("grad_dtype") or "fp32") == "fp32" else 2,
                          overlap_dp=True if o.get("overlap_dp") is None else bool(o["overlap_dp"]),
                          tp_comm_overlap=bool(o.get("tp_comm_overlap")),
                          precision={"float32": "fp32", "float8": "fp8"}.get(dtype, "mixed"),
                          moe_imbalance=_given(o, "moe_imbalance", 1.0))
    gpu = load_cluster(o["cluster"]).with_dtype(dtype) if o.get("cluster") else get_gpu(o["gpu"], dtype)
    gpu = gpu.with_links(o.get("intra_node_gbps"), o.get("inter_node_gbps"))
    gpu = gpu.with_power_limit(o.get("power_limit_w"))
    if o.get("power_limit_w") and gpu.rated_power_w and o["power_limit_w"] > gpu.rated_power_w:
        note_once(f"note: --power-limit-w {o['power_limit_w']:g} is above {gpu.name}'s rated "
                   f"{gpu.rated_power_w:g} W: its clock stays at the rated one")
    return work, gpu.with_gpus_per_node(o.get("gpus_per_node"))


def check_sizes(o: dict) -> None:
    """ConfigError, one line, for an integer option too large to be a real size (config's bound:
    beyond it numpy's 64-bit arithmetic overflows, and no cluster or model comes near it)."""
    for key, value in o.items():
        if isinstance(value, int) and not isinstance(value, bool) and value > INT_MAX:
            raise ConfigError(f"--{key.replace('_', '-')}: {value} is too large (at most {INT_MAX:,})")


def _given(o: dict, key: str, default):
    """The option's value, or ``default`` when it was not given (0 is given: it is refused later)."""
    return default if o.get(key) is None else o[key]


def check_positive(o: dict, keys) -> None:
    """ConfigError, one line, for a size flag given as zero or less."""
    for key in keys:
        if o.get(key) is not None and o[key] < 1:
            raise ConfigError(f"--{key.replace('_', '-')}: must be a positive integer, got {o[key]}")


LAYOUT_SIZES = ("tp", "pp", "dp", "cp", "ep", "micro_batch", "virtual_stages", "num_gpus")


def reconciled(o: dict, tp: int | None, pp: int | None, cp: int | None, ep: int | None = None) -> dict:
    """The options with the knobs that mean something else at these sizes (None: not fixed, as
    plan's search leaves them) read as the engine and Megatron read them, a note for each:
    Megatron's 1F1B with virtual stages is its interleaved schedule and interleaved with one
    chunk a rank is 1F1B (a published run may state either); a schedule at pp 1, a CP method at
    cp 1, sequence parallelism at tp 1 and a routing imbalance at ep 1 have nothing to act on
    (Megatron turns SP off too)."""
    o = dict(o)
    schedule, virtual = o.get("schedule"), o.get("virtual_stages")
    if schedule == "1f1b" and (virtual or 1) > 1 and pp != 1:
        note_once("note: 1f1b with --virtual-stages > 1 is Megatron's interleaved 1F1B; estimating interleaved")
        o["schedule"] = "interleaved"
    elif schedule == "interleaved" and virtual == 1:
        note_once("note: interleaved with one model chunk a rank is 1F1B; estimating 1f1b")
        o["schedule"] = "1f1b"
    if pp == 1 and o["schedule"] not in (None, "1f1b") and not SCHEDULE_REGISTRY[o["schedule"]].chunked:
        note_once(f"note: --schedule {o['schedule']} has no effect at --pp 1 (no pipeline); estimating 1f1b")
        o["schedule"] = "1f1b"
    if cp == 1 and o.get("cp_method") not in (None, "ring"):
        note_once(f"note: --cp-method {o['cp_method']} has no effect at --cp 1")
    if o.get("sequence_parallel") and tp == 1:
        note_once("note: --sequence-parallel has no effect at --tp 1; estimating without it")
        o["sequence_parallel"] = False
    if o.get("reshard_after_forward") is False and o.get("zero") not in (None, 3):
        note_once("note: --no-reshard-after-forward has no effect without --zero 3 (it keeps ZeRO-3's gathered "
                  "weights through the step)")
        o["reshard_after_forward"] = True
    if ep == 1 and (o.get("moe_imbalance") or 1) != 1:
        note_once("note: --moe-imbalance has no effect at --ep 1 (each rank runs every expert on its own tokens, "
                  "however they are routed)")
    if o.get("tp_comm_overlap") and (tp == 1 or o.get("sequence_parallel") is False):
        note_once("note: --tp-comm-overlap has no effect without tensor parallelism and --sequence-parallel (it "
                  "pipelines their all-gathers and reduce-scatters with the products, as Megatron-Core's does)")
    return o


def build_layout(o: dict, work: costs.Workload) -> tuple[costs.Layout, int]:
    """The layout and GPU count of estimate's options; --dp or --num-gpus may be left out."""
    check_positive(o, LAYOUT_SIZES)
    tp, pp, cp, ep = _given(o, "tp", 1), _given(o, "pp", 1), _given(o, "cp", 1), _given(o, "ep", 1)
    check_imbalance(work, ep)
    dp, num_gpus = o.get("dp"), o.get("num_gpus")
    if num_gpus is None:
        dp = _given(o, "dp", 1)
        num_gpus = tp * pp * cp * dp
    elif dp is None:
        if num_gpus % (tp * pp * cp):
            raise ConfigError(f"--num-gpus: {num_gpus} is not divisible by --tp × --pp × --cp = {tp * pp * cp}")
        dp = num_gpus // (tp * pp * cp)
    expert_tp = expert_tp_of(o, work.model, tp, dp, cp)
    if work.model.moe_experts and expert_tp >= 1 and tp > 1 and not o.get("sequence_parallel"):
        if o.get("sequence_parallel") is False and o.get("expert_tp") is not None:
            raise ConfigError(f"--no-sequence-parallel: Megatron-Core's expert grid (--expert-tp {expert_tp}) runs an "
                              "MoE model under --tp only with sequence parallelism; --expert-tp 0 for threefold's "
                              "engine, which runs without")
        note_once("note: Megatron-Core runs an MoE model under --tp only with --sequence-parallel; estimating with "
                  "it (--expert-tp 0 prices threefold's engine, which runs without)")
        o = {**o, "sequence_parallel": True}
    o = reconciled({**o, "schedule": _given(o, "schedule", "1f1b"), "sequence_parallel": bool(o.get("sequence_parallel"))},
                   tp, pp, cp, ep)
    schedule = o["schedule"]
    chunked = schedule in SCHEDULE_REGISTRY and SCHEDULE_REGISTRY[schedule].chunked
    virtual = _given(o, "virtual_stages", 2 if chunked else 1)
    sequence_parallel = bool(o.get("sequence_parallel"))
    layout = costs.Layout.named(recompute=_given(o, "recompute", "none"), schedule=schedule, tp=tp, pp=pp, dp=dp,
                                cp=cp, ep=ep, cp_method=_given(o, "cp_method", "ring"),
                                zero=_given(o, "zero", 0), micro_batch=_given(o, "micro_batch", 1),
                                virtual_stages=virtual, sequence_parallel=sequence_parallel,
                                dp_shard=_given(o, "dp_shard", 0),
                                reshard_after_forward=o.get("reshard_after_forward"),  # None: by --pp
                                expert_tp=expert_tp)
    layout.recompute = costs.recompute_policy(layout.recompute, layout.zero, work.attention)  # selective at ZeRO-3: op
    costs.check_layout(work.model, layout, work.global_batch, num_gpus)
    if work.model.moe_experts and tp > 1 and not sequence_parallel:
        note_once(f"note: without --sequence-parallel each of the --tp {tp} ranks runs the experts on the whole "
                  "sequence, repeating their work; with it each runs them on its own positions (Megatron-LM "
                  "requires it for MoE under TP)")
    return layout, num_gpus


def expert_tp_of(o: dict, model, tp: int, dp: int, cp: int) -> int:
    """--expert-tp, or where it is not given Megatron-Core's default: the experts split over the tp
    ranks; whole experts with ep folded over tp·cp·dp (its MoE parallel folding) where only that
    runs (ep larger than cp·dp allows, or experts too narrow to split over tp), and at tp 1 where
    its grid is not the engine's (over cp, or past dp); 0 (threefold's engine) where they price
    alike (``costs.expert_grid_differs``)."""
    given = o.get("expert_tp")
    if not model.moe_experts:
        if given is not None:
            raise ConfigError("--expert-tp: set without --moe-experts (a dense model)")
        return 0
    if given is not None:
        return given
    ep = _given(o, "ep", 1)
    if tp > 1 and (cp * dp) % ep == 0 and model.moe_ffn_hidden % tp == 0:
        return tp
    if not costs.expert_grid_differs(tp, cp, dp, ep):
        return 0
    return 1 if (tp * cp * dp) % ep == 0 else 0  # where neither runs, the engine's check says why (ep over dp)


def stage_split(o: dict, work: costs.Workload, layout: costs.Layout) -> tuple[int, ...] | None:
    """--stage-layers (``3,2``, ``[3, 2]``, or a JSON list in --batch), checked against the layout:
    one count per model chunk, each at least one block, every block once."""
    text = o.get("stage_layers")
    if text is None:
        return None
    try:
        split = tuple(int(item) for item in str(text).strip().strip("[]").split(","))
    except ValueError:
        raise ConfigError(f"--stage-layers: {text!r} is not a list of block counts such as 3,2") from None
    if min(split) < 1:
        raise ConfigError(f"--stage-layers: {text!r}: every stage needs at least one block")
    chunks = SCHEDULE_REGISTRY[costs.SCHEDULES[int(layout.schedule)]].stages_per_rank or layout.virtual_stages
    if layout.pp == 1:
        raise ConfigError("--stage-layers: needs a pipeline (--pp 2 or more)")
    if len(split) != layout.pp * chunks or sum(split) != work.model.layers:
        raise ConfigError(f"--stage-layers: {','.join(map(str, split))} does not split {plural(work.model.layers, 'block')} "
                          f"over {layout.pp * chunks} stages (pp {layout.pp} × {chunks} per rank)")
    return split


# What a run tunes by measuring, where estimate is not told it: the micro-batch, and on a pipeline
# the schedule, among Megatron's two (1F1B; interleaved, 2 or 4 chunks a rank).
TUNED_MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64)
TUNED_SCHEDULES = (("1f1b", None), ("interleaved", 2), ("interleaved", 4))


def tuned_estimate(o: dict, work: costs.Workload, gpu) -> tuple[costs.Layout, int, tuple | None, dict, list[str]]:
    """(layout, GPU count, stage split, estimate, the knobs tuned) of estimate's options. A knob
    left out that runs tune by measuring (``--micro-batch``; with ``--pp`` > 1, ``--schedule`` and
    ``--virtual-stages``) is taken at the fastest choice that fits, as the authors of published
    runs tuned theirs. Where none fits, the first (micro-batch 1, 1F1B), which holds the least
    memory: what does not fit is reported as it is. Where none is a layout at all, the first's
    error."""
    open_batch = o.get("micro_batch") is None
    open_schedule = _given(o, "pp", 1) > 1 and o.get("schedule") is None and o.get("virtual_stages") is None
    batches = TUNED_MICRO_BATCHES if open_batch else (o["micro_batch"],)
    schedules = TUNED_SCHEDULES if open_schedule else ((o.get("schedule"), o.get("virtual_stages")),)
    tuned = ["micro_batch"] * open_batch + ["schedule", "virtual_stages"] * open_schedule
    first_error, best, best_est = None, None, None
    for batch, (schedule, virtual) in itertools.product(batches, schedules):
        options = dict(o, micro_batch=batch, schedule=schedule, virtual_stages=virtual)
        try:
            layout, num_gpus = build_layout(options, work)
            split = stage_split(options, work, layout)
        except ConfigError as err:
            first_error = first_error or err
            continue
        est = costs.estimate(work, layout, gpu, split)
        faster = best_est is not None and (not best_est["fits"] or est["tokens_per_s"] > best_est["tokens_per_s"])
        if best_est is None or (est["fits"] and faster):
            best, best_est = (layout, num_gpus, split), est
    if best is None:
        raise first_error
    return (*best, best_est, tuned)


def evaluate(o: dict) -> dict:
    """One layout's estimate as JSON, from estimate's options (the knobs tuned listed under "tuned")."""
    work, gpu = build_workload(o)
    layout, _, _, est, tuned = tuned_estimate(o, work, gpu)
    return dict(report.result_json(est, layout), **({"tuned": tuned} if tuned else {}))


def _title(o: dict, work: costs.Workload, num_gpus: int, gpu) -> str:
    name = o.get("model") or f"{work.model.arch} {costs.param_count(work.model) / 1e9:.1f}B"
    routing = f", busiest ep rank {work.moe_imbalance:g}× the mean" if work.moe_imbalance != 1 else ""
    return f"{name} on {num_gpus}× {gpu.name}, global batch {work.global_batch} × {work.model.seq_len} tokens{routing}"


def _batch_line(text: str, defaults: dict, params: dict) -> dict:
    """Options of one --batch line: the command line's, overridden by the line's keys."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"not a JSON object ({err})") from None
    if not isinstance(line, dict):
        raise ConfigError("not a JSON object")
    options = dict(defaults)
    for key, value in line.items():
        if key not in params:
            raise ConfigError(f"{key}: unknown key (keys are estimate's flags with underscores)")
        if value is not None:
            _check_json_type(key, value, params[key])
        try:
            options[key] = None if value is None else params[key].type.convert(value, params[key], None)
        except click.BadParameter as err:
            raise ConfigError(f"{key}: {err.format_message()}") from None
    return options


def _check_json_type(key: str, value, param: click.Parameter) -> None:
    """ConfigError, one line, for a JSON value of the wrong kind for its flag: a size is a whole
    number (8, or 8.0; not 8.5, not true), a bandwidth a number, a switch true or false, anything
    else a string (the stage split may also be a list of whole numbers)."""
    kind = param.type
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(kind, click.types.IntParamType):
        ok = whole and not isinstance(value, bool) or isinstance(value, str)
    elif isinstance(kind, click.types.FloatParamType):
        ok = isinstance(value, (int, float, str)) and not isinstance(value, bool)
    elif isinstance(kind, click.types.BoolParamType):
        ok = isinstance(value, (bool, str))
    elif key == "stage_layers":
        ok = isinstance(value, str) or (isinstance(value, list) and all(
            isinstance(item, int) and not isinstance(item, bool) for item in value))
    else:  # names and choices (a boolean recompute, as Megatron's switch, is a choice too)
        ok = isinstance(value, str) or (isinstance(value, bool) and isinstance(kind, _Choice))
    if not ok:
        wanted = ("a whole number" if isinstance(kind, click.types.IntParamType) else
                  'a list of whole numbers, or "N,N,…"' if key == "stage_layers" else kind.name)
        raise ConfigError(f"{key}: {json.dumps(value)} is not a valid value ({wanted})")


@click.command()
@_model_options
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline stages.")
@click.option("--dp", type=int, help="Data-parallel size; default: --num-gpus / (tp·pp·cp).")
@click.option("--cp", type=int, default=1, show_default=True, help="Context-parallel size.")
@click.option("--cp-method", type=choice(costs.CP_METHODS), default="ring", show_default=True,
              help="Attention over the split sequence: ring, allgather (Llama 3) or ulysses (DeepSpeed).")
@click.option("--ep", type=int, default=1, show_default=True,
              help="Expert-parallel size (divides the experts): carved out of the data-parallel ranks on threefold's "
                   "engine (--expert-tp 0), out of cp × dp (or with --expert-tp 1, tp × cp × dp) on Megatron-Core's.")
@click.option("--expert-tp", type=int,
              help="An MoE model's experts over the tp ranks. 0: as threefold's engine and DeepSpeed-MoE run them, "
                   "whole on every tp rank, each running them on its own positions; 1 or --tp: Megatron-Core's "
                   "--expert-tensor-parallel-size, each expert whole (ep folded over tp × cp × dp) or split over the "
                   "tp ranks. Default: Megatron-Core's, --tp, or 1 where that cannot run (--ep not dividing cp × dp, "
                   "or experts --tp does not divide).")
@click.option("--micro-batch", type=int,
              help="Sequences per micro-batch; default: the fastest of 1, 2, 4, … 64 that fits, as a run tunes it.")
@click.option("--virtual-stages", type=int,
              help="Model chunks per pipeline rank (interleaved; default 2 there, else 1).")
@click.option("--sequence-parallel/--no-sequence-parallel", default=None,
              help="With --tp > 1, split the norms' activations over the tensor-parallel ranks along the sequence "
                   "(Megatron's sequence parallelism); default: off.")
@click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True,
              help="ZeRO stage over the dp ranks: 1 shards the optimizer's states (AdamW's moments and, in "
                   "mixed precision, the fp32 master weights), 2 also the gradients, 3 also the weights (FSDP's "
                   "FULL_SHARD).")
@click.option("--dp-shard", type=int, default=0, show_default=True,
              help="Hybrid sharding (HSDP, FSDP's HYBRID_SHARD; at ZeRO-1, 2 Megatron-Core's distributed optimizer "
                   "instances): ZeRO shards the states over groups of this many dp ranks, which dp / N groups hold "
                   "alike, all-reducing gradients between them; needs --zero 1, 2 or 3 (plan searches every N at "
                   "ZeRO-3 only, and this N at each stage). 0: one group of all dp ranks.")
@click.option("--reshard-after-forward/--no-reshard-after-forward", default=None,
              help="ZeRO-3: free each unit's gathered weights after its forward and gather them again for its "
                   "backward, every micro-batch; --no-reshard-after-forward keeps them gathered through the step "
                   "(FSDP2's reshard_after_forward=False): one gather and one reduction a step, priced as ZeRO-1. "
                   "Default: torchtitan's and the engine's, kept under a pipeline (--pp > 1), resharding without.")
@click.option("--recompute", type=choice(costs.RECOMPUTE, RECOMPUTE_SYNONYMS), default="none", show_default=True,
              help="selective: rerun the attention core (Korthikanti et al.; Megatron's), except on a ZeRO-3 "
                   "layout under flash attention, where it means op; op: torchtitan's op-level checkpointing "
                   "(keep every other product's output and the attention's, rerun the rest; docs/planner.md).")
@click.option("--schedule", type=choice(costs.SCHEDULES, SCHEDULE_SYNONYMS),
              help="Pipeline schedule, used with --pp > 1 (`threefold schedule` draws each); default there, "
                   "without --virtual-stages: the fastest that fits of 1f1b and interleaved with 2 or 4 chunks a "
                   "rank, as a run tunes it.")
@click.option("--stage-layers", metavar="N,N,…",
              help="Blocks per pipeline stage, first to last (every model chunk: pp × virtual stages of them), "
                   "e.g. 3,2; the schedule is then played on each stage's own cost. Default: ceil(layers/pp) "
                   "each, with the closed-form bubble.")
@click.option("--batch", "batch_file", type=click.File("r"),
              help="Evaluate every JSON line of this file; print one JSON line each, in order.")
@click.option("--list-gpus", is_flag=True, help="List the GPUs of the catalog and exit.")
@click.option("--out", type=click.Path(dir_okay=False), help="Draw the step-time and memory breakdown to this picture (.png, .svg or .pdf).")
@click.pass_context
def estimate(ctx, as_json, batch_file, list_gpus, out, **options):
    """Predict memory, communication and step time of one layout."""
    console = Console()
    if list_gpus:
        gpus = list(CATALOG.values())
        try:
            gpus.append(get_gpu("local"))
        except ConfigError:
            pass  # no calibrated profile: the table lists the catalog only
        console.print(report.gpu_table(gpus, console.width))
        if len(gpus) == len(CATALOG):
            console.print("local: not measured yet; run `threefold calibrate`")
        return
    if batch_file is not None:
        if out:
            raise ConfigError("--out: draws one layout; --batch answers in JSON lines only")
        check_positive(options, LAYOUT_SIZES)  # the command line's flags, before any line takes them
        check_sizes(options)
        try:
            lines = batch_file.readlines()
        except UnicodeDecodeError:
            raise ConfigError(f"--batch: {batch_file.name} is not UTF-8 text") from None
        if not any(text.strip() for text in lines):
            raise ConfigError(f"--batch: {batch_file.name} holds no lines (one JSON object a line, a layout each)")
        lines[0] = lines[0].removeprefix("\ufeff")  # the byte-order mark some editors write first
        params = {p.name: p for p in ctx.command.params if p.name in options}
        for text in lines:
            if not text.strip():
                continue
            try:
                result = evaluate(_batch_line(text, options, params))
            except ConfigError as err:
                result = {"error": str(err)}
            except Exception as err:  # a defect of ours: say so on this line, and answer the others
                result = {"error": f"internal error, please report it: {type(err).__name__}: {err}"}
            click.echo(json.dumps(result))
        return
    check_picture_path("--out", out)
    with notes_after_checks():
        work, gpu = build_workload(options)
        layout, num_gpus, split, est, tuned = tuned_estimate(options, work, gpu)
    result = dict(report.result_json(est, layout), **({"tuned": tuned} if tuned else {}))
    if tuned and not as_json:
        note_once(f"note: {_tuned_words(tuned, layout, est)}")
    if not as_json and options.get("expert_tp") is None and layout.expert_tp >= 1 and costs.expert_grid_differs(
            layout.tp, layout.cp, layout.dp, layout.ep):
        how = ("each expert split over the tp ranks" if layout.expert_tp > 1
               else "whole experts, ep over tp × cp × dp")
        note_once(f"note: --expert-tp not given: estimating Megatron-Core's expert grid, ETP={layout.expert_tp} ({how}); "
                  "--expert-tp 0 estimates threefold's engine's default, experts whole on every tp rank (it runs "
                  "ETP=1 too, parallel.expert_tp = 1, where ep is a multiple of tp × cp)")
    described = layout.describe() + (f" stages {'-'.join(map(str, split))}" if split else "")
    if out:
        draw_breakdown([result], [described], gpu.hbm_bytes / 2**30, out, _title(options, work, num_gpus, gpu))
    if as_json:
        click.echo(json.dumps(result))
        return
    for table in report.estimate_tables(result, f"{_title(options, work, num_gpus, gpu)}: {described}",
                                       gpu.hbm_bytes):
        console.print(table)
    if result["hfu"] > 1:  # HFU ≥ MFU: it adds the recomputed forward
        console.print(f"note: {'MFU' if result['mfu'] > 1 else 'HFU'} above 100%: the convention (PaLM's, "
                      "torchtitan's) counts attention's whole s × s score matrix, of which causal flash attention "
                      "computes half (HFU counts the recomputed forward's too); at this sequence length attention "
                      "is most of the FLOPs")


def _tuned_words(tuned: list[str], layout: costs.Layout, est: dict) -> str:
    """``--micro-batch not given: 2, the fastest that fits …``: what estimate chose, and why."""
    chosen = []
    if "micro_batch" in tuned:
        chosen.append(f"--micro-batch {int(layout.micro_batch)}")
    if "schedule" in tuned:
        schedule = costs.SCHEDULES[int(layout.schedule)]
        chosen.append(f"--schedule {schedule}" + (f" --virtual-stages {int(layout.virtual_stages)}"
                                                  if schedule == "interleaved" else ""))
    knobs = " and ".join("--" + k.replace("_", "-") for k in tuned if k != "virtual_stages")
    them = "them" if len(chosen) > 1 else "it"
    if not est["fits"]:
        return f"{knobs} not given: estimating {' '.join(chosen)}, the leanest; no choice fits"
    return (f"{knobs} not given: estimating {' '.join(chosen)}, the fastest that fits, as a run tunes {them}; "
            f"give {them} to estimate another")


def _fixed_knobs(command):
    """plan's layout flags: each one given fixes that knob; the search covers the rest."""
    options = [
        click.option("--tp", type=int, help="Fix the tensor-parallel size."),
        click.option("--pp", type=int, help="Fix the pipeline stages."),
        click.option("--dp", type=int, help="Fix the data-parallel size."),
        click.option("--cp", type=int, help="Fix the context-parallel size."),
        click.option("--cp-method", type=choice(costs.CP_METHODS), help="Fix the context-parallel method."),
        click.option("--ep", type=int, help="Fix the expert-parallel size."),
        click.option("--expert-tp", type=int, help="Fix how the experts sit over tp (estimate --help); default: "
                                                   "both of Megatron-Core's, split over tp and whole (--config-out "
                                                   "writes the fastest the engine runs: 0, or 1 where ep is a "
                                                   "multiple of tp × cp)."),
        click.option("--micro-batch", type=int, help="Fix the micro-batch."),
        click.option("--virtual-stages", type=int, help="Fix the model chunks per pipeline rank."),
        click.option("--sequence-parallel/--no-sequence-parallel", default=None, help="Fix sequence parallelism."),
        click.option("--zero", type=click.IntRange(0, 3), help="Fix the ZeRO stage."),
        click.option("--dp-shard", type=int, help="Fix hybrid sharding's shard group (dp ranks; ZeRO-3 only)."),
        click.option("--no-reshard-after-forward", "reshard_after_forward", flag_value=False, default=None,
                     help="Restrict the search to ZeRO-3 with its units kept gathered through the step (left out "
                          "otherwise: priced as ZeRO-1, they would repeat its rows)."),
        click.option("--recompute", type=choice(costs.RECOMPUTE, RECOMPUTE_SYNONYMS), help="Fix the recomputation."),
        click.option("--schedule", type=choice(costs.SCHEDULES, SCHEDULE_SYNONYMS), help="Fix the pipeline schedule."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


# When nothing fits: the GPU counts tried, as multiples of the one asked for.
LARGER = (2, 4, 8, 16, 32, 64, 128)


@click.command()
@_model_options
@_fixed_knobs
@click.option("--top", type=click.IntRange(1, 100), default=5, show_default=True, help="How many layouts to show.")
@click.option("--out", type=click.Path(dir_okay=False), help="Draw the top layouts' breakdowns side by side to this picture (.png, .svg or .pdf).")
@click.option("--config-out", type=click.Path(dir_okay=False),
              help="Write the fastest layout that threefold's engine runs as a config (TOML) for "
                   "`threefold dryrun` and `threefold train`.")
def plan(as_json, top, out, config_out, **options):
    """Search layouts for the fastest one that fits; any layout flag given fixes that knob."""
    check_picture_path("--out", out)
    if config_out is not None and not config_out.endswith(".toml"):
        raise ConfigError(f"--config-out: {config_out} is not a config; the file name must end in .toml")
    if config_out is not None:
        check_output_path("--config-out", config_out)
    if options.get("num_gpus") is None:
        raise ConfigError("--num-gpus: required")
    check_positive(options, LAYOUT_SIZES)
    work, gpu = build_workload(options)
    if config_out is not None:
        from threefold.plan.engine_config import check_model

        check_model(work)
    if options.get("reshard_after_forward") is False and options.get("zero") not in (None, 3):
        raise ConfigError(f"--no-reshard-after-forward: restricts the search to ZeRO-3 kept gathered through the "
                          f"step; it needs --zero 3 or no --zero, got {options['zero']}")
    knobs = reconciled(options, options.get("tp"), options.get("pp"), options.get("cp"), options.get("ep"))
    fixed = {knob: knobs.get(knob) for knob in search.KNOBS}
    _check_expert_placement(work.model, fixed)
    if fixed["ep"] is not None:
        check_imbalance(work, fixed["ep"])
    costs.check_hybrid_sharding(fixed["dp_shard"] or 0, fixed["zero"], fixed["dp"], fixed["ep"] or 1)
    num_gpus = options["num_gpus"]
    found = search.search(work, gpu, num_gpus, fixed)
    best = found.ranked(top)
    if config_out and not found.fitting:  # in JSON too: a config left from an earlier plan must not look like this one's
        raise ConfigError(f"{_nothing_fits(found, work, gpu, num_gpus, fixed)}; --config-out {config_out} not written")
    written = _write_config(config_out, options, work, gpu, found) if config_out else None
    if as_json:
        click.echo(json.dumps({"evaluated": found.count, "seconds": found.seconds, "layouts_per_s": found.rate,
                               "fitting": found.fitting, "meshes": found.meshes(),
                               "fixed": {k: v for k, v in fixed.items() if v is not None},
                               "layouts": [dict(r, why=why) for r, why in best],
                               **({"config_out": {k: v for k, v in written.items() if k != "index"}} if written else {})}))
        if not best:  # the JSON says so too ("fitting": 0); the exit status and the line as without --json
            raise ConfigError(_nothing_fits(found, work, gpu, num_gpus, fixed))
        return
    console = Console()
    given = _flags(fixed)
    console.print(f"Evaluated {plural(found.count, 'layout')}{f' with {given}' if given else ''} in {found.seconds:.3f} s "
                  f"({found.rate:,.0f} layouts/s); {found.fitting:,} fit in {report.capacity_gib(gpu.hbm_bytes)} GiB.")
    if not best:
        raise ConfigError(_nothing_fits(found, work, gpu, num_gpus, fixed))
    if len(best) < min(top, found.fitting):
        console.print(f"The {found.fitting:,} layouts that fit use {plural(found.meshes(), 'mesh')} "
                      "(tp × pp × dp × cp × ep); the table shows the fastest of each "
                      "(the others differ in ZeRO stage, hybrid sharding, recomputation, micro-batch or schedule).")
    console.print(report.plan_table([r for r, _ in best], [why for _, why in best],
                                    _title(options, work, num_gpus, gpu)))
    for line in found.notes() + found.what_would_change() + _routing_caveat(options, work, best[0][0]):
        console.print(line)
    if out:
        draw_breakdown([r for r, _ in best], [r["describe"] for r, _ in best], gpu.hbm_bytes / 2**30, out,
                       _title(options, work, num_gpus, gpu))
        console.print(f"drawn to {out}", highlight=False)
    if written:
        # the table shows one row a mesh; the search counts every variant (ZeRO stage, schedule, …)
        row, own = found.table_row(written["index"], top)
        where = ("not in the table" if row is None else f"#{row} in the table" if own
                 else f"a variant of #{row} in the table")
        faster = written["rank"] - 1
        skipped = (f"; the {plural(faster, 'faster layout')}, counting every variant, {'does' if faster == 1 else 'do'} "
                   f"not run on the engine (the fastest: {written['why']})" if faster else "")
        console.print(f"config of {written['layout']} ({where}, {written['step_time_s']:.3g} s){skipped}, written to "
                      f"{config_out}; one step of it on the engine: threefold dryrun --config {config_out} "
                      f"--world-size {num_gpus} --compare", highlight=False, markup=False)


def _routing_caveat(options: dict, work: costs.Workload, fastest: dict) -> list[str]:
    """A line under plan's table where its fastest layout splits the experts over ranks and no
    --moe-imbalance was given: it is priced at balanced routing, which learned routing is not."""
    ep = fastest["layout"]["ep"]
    if not work.model.moe_experts or ep == 1 or options.get("moe_imbalance") is not None:
        return []
    return [f"EP={ep} is priced at balanced routing: every rank waits at each MoE block for the busiest ep rank, "
            "which learned routing loads more; --moe-imbalance R (a threefold run's moe.ep_max_over_mean) prices it."]


def check_imbalance(work: costs.Workload, ep: int) -> None:
    """ConfigError, one line, for a --moe-imbalance the busiest of ``ep`` ranks cannot reach
    (``costs.imbalance_ceiling``). plan, searching ep, prices each at most at its ceiling."""
    if work.model.moe_experts and ep > 1 and work.moe_imbalance > costs.imbalance_ceiling(work.model, ep):
        raise ConfigError(f"--moe-imbalance: {work.moe_imbalance:g} is more than the busiest of --ep {ep} ranks can "
                          f"take, min(ep, experts / top-k) = {float(costs.imbalance_ceiling(work.model, ep)):g} "
                          "times the mean")


def _check_expert_placement(model, fixed: dict) -> None:
    """plan's --expert-tp, and --no-sequence-parallel beside Megatron-Core's grid: one line for a
    value no layout takes (N > 1 searches the layouts at --tp N only), a note for what the search
    leaves out."""
    expert_tp, tp, sp = fixed["expert_tp"], fixed["tp"], fixed["sequence_parallel"]
    if expert_tp is not None and not model.moe_experts:
        raise ConfigError("--expert-tp: set without --moe-experts (a dense model)")
    if expert_tp is not None and expert_tp < 0:
        raise ConfigError(f"--expert-tp: must be 0 (threefold's engine), 1 or a tp size, got {expert_tp}")
    if model.moe_experts and sp is False and expert_tp != 0:
        if (tp or 1) > 1:
            raise ConfigError("--no-sequence-parallel: Megatron-Core, whose experts plan prices by default, runs an "
                              "MoE model under tp only with sequence parallelism; add --expert-tp 0 for threefold's "
                              "engine")
        note_once("note: --no-sequence-parallel leaves out tp > 1 for this MoE model: Megatron-Core's expert grid, "
                  "which plan prices by default, needs SP under tp (--expert-tp 0 searches threefold's engine's)")
    if expert_tp in (None, 0, 1):
        return
    if tp not in (None, expert_tp):
        raise ConfigError(f"--expert-tp: must be 0 (threefold's engine), 1 or --tp {tp}, got {expert_tp}")
    widths = {"heads": model.heads, "kv heads": model.n_kv_heads, "FFN width": model.ffn_hidden,
              "experts' FFN width": model.moe_ffn_hidden}
    apart = [f"the {name} {n}" for name, n in widths.items() if n % expert_tp]
    if expert_tp & (expert_tp - 1) or apart:
        why = " or ".join(apart) if apart else "a tp size is a power of two"
        raise ConfigError(f"--expert-tp: {expert_tp} splits each expert over tp {expert_tp}, which this model "
                          f"does not take ({why}); give 0, 1 or a tp size")


def _nothing_fits(found, work: costs.Workload, gpu, num_gpus: int, fixed: dict) -> str:
    """Why a search shows no layout: the knobs given leave none, or none fits (the closest miss,
    and the smallest GPU count that fits)."""
    if not found.count and any(v is not None for v in fixed.values()):
        return _impossible_knobs(work, num_gpus, fixed)
    return (f"--num-gpus: no layout of this model fits on {num_gpus} × {gpu.name}"
            f"{found.closest_miss()}{_smallest_that_fits(work, gpu, num_gpus, fixed)}")


def _write_config(path: str, options: dict, work: costs.Workload, gpu, found) -> dict:
    """Write the fastest layout the engine runs (``engine_config``) to ``path``; what was written."""
    from threefold.plan import engine_config

    rank, keys, why = engine_config.first_runnable(work, found.layouts, found.order)
    i = int(found.order[rank])
    step, memory = (float(np.asarray(found.est[key])[i]) for key in ("step_time_s", "memory_bytes"))
    memory /= 2**30
    engine_config.write(path, keys, [
        f"threefold plan {_command_line(options)}",
        f"layout {rank + 1:,} of the search, fastest first, counting every variant (ZeRO stage, recomputation, "
        "micro-batch, schedule): the fastest that threefold's engine runs",
        f"the planner's estimate on {options['num_gpus']} × {gpu.name}: {step:.3g} s a step, {memory:.1f} GiB per GPU "
        "(a GPU framework's bf16 run; dryrun --compare puts the engine's own figures beside its model of them)",
        *(f"not carried over: {line}" for line in engine_config.not_carried(work)),
        f"one step on the engine: threefold dryrun --config {path} --world-size {options['num_gpus']} --compare"])
    return {"path": path, "rank": rank + 1, "index": i, "layout": found.layouts.describe(i), "step_time_s": step,
            "why": why}


def _command_line(options: dict) -> str:
    """The options given (those that differ from their defaults) as they are typed, so the line reruns."""
    return _flags({p.name: options[p.name] for p in click.get_current_context().command.params
                   if p.name in options and options[p.name] != p.default}, sep=" ")


def _flags(knobs: dict, sep: str = ", ") -> str:
    """Options as they are typed: ``--tp 2, --sequence-parallel, --no-overlap-dp``."""
    return sep.join(f"--{'' if v else 'no-'}{k.replace('_', '-')}" if isinstance(v, bool)
                    else f"--{k.replace('_', '-')} {v}" for k, v in knobs.items() if v is not None)


def _impossible_knobs(work: costs.Workload, num_gpus: int, fixed: dict) -> str:
    """Why the fixed knobs leave no layout: the first knob that no layout takes on its own, with
    the reason the layout check gives for it where it has one; else the knobs together."""
    given = {knob: value for knob, value in fixed.items() if value is not None}
    for knob, value in given.items():
        if len(np.atleast_1d(search.candidate_layouts(work, num_gpus, {knob: value}).tp)):
            continue
        if knob == "dp_shard":  # checked before the search: what is left is that no dp takes it
            return (f"--dp-shard {value}: no ZeRO layout of this model on {plural(num_gpus, 'GPU')} has a dp that "
                    f"{value} divides")
        try:  # the layout check's own words: "--tp: 3 does not divide the 32 heads …"
            layout = costs.Layout.named(**{knob: value})
            costs.check_layout(work.model, layout, work.global_batch,
                               int(layout.tp * layout.pp * layout.dp * layout.cp))
        except ConfigError as err:
            return str(err)
        return f"--{knob.replace('_', '-')} {value}: no layout of this model on {plural(num_gpus, 'GPU')} takes it"
    return (f"{_flags(given)}: each is possible alone, but together they leave no layout of this model on "
            f"{plural(num_gpus, 'GPU')}")


def _smallest_that_fits(work: costs.Workload, gpu, num_gpus: int, fixed: dict) -> str:
    """``; the smallest count that fits is N`` over 2×, 4×, … the GPUs asked for (with the
    knobs fixed as given, dp growing with the count unless it is fixed)."""
    for factor in LARGER:
        found = search.search(work, gpu, num_gpus * factor, fixed)
        if found.fitting:
            first = found.shown(1)[0]
            return (f"; the smallest of {', '.join(f'{f}×' for f in LARGER[:LARGER.index(factor) + 1])} that fits is "
                    f"{num_gpus * factor} GPUs ({found.layouts.describe(first)})")
    return f"; nor on up to {num_gpus * LARGER[-1]} GPUs"
