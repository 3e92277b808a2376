"""Checkpoints that any layout can save and any other layout can load.

A checkpoint is a folder ``<checkpoint_dir>/step_000120/`` holding

    .metadata, __*_*.distcp  torch.distributed.checkpoint (DCP): the full tensors of the plain
                             model, "model/<key>", and of Adam's moments, "exp_avg/<key>" and
                             "exp_avg_sq/<key>" (2bw, pipedream: and the older weight
                             versions, "version<j>/<key>"), each stored as the pieces the ranks held,
                             described by their place in the full tensor; and each rank's RNG
                             state, "rng/rank<r>"
    tokenizer.json           the tokenizer, so ``threefold generate`` needs nothing else
    trainer.json             step, Adam's step count, sampler state, config and the layout
                             that saved it, and what the run keeps of the model it started
                             from (tokenizer settings, context); written last

Every rank saves the pieces it holds (``Engine.checkpoint_shards``, views into its live
states; DCP writes a piece held by several replicas once). Loading on another layout, each
rank asks for the pieces it holds there, and DCP reads from the saved pieces the parts that
overlap them. Nothing is gathered on one rank, and no layout needs to know another. The
learning rate is a function of the step (``train.engine.lr_at``) and the data sampler of (seed,
step), so both resume from trainer.json on any layout.

The folder is written under a temporary name and renamed when complete, so a folder named
``step_*`` is always whole: a crash mid-save leaves the previous checkpoint as the latest. The
last ``keep`` checkpoints are kept. A save that fails (a full disk: it says how many bytes were
needed) stops the run on every rank with one line and removes the half-written folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import math
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from threefold.config import WEIGHT_DEFINING_KEYS, Config, ConfigError, ModelConfig, check_output_path
from threefold.data.tokenizer import EOS, load_tokenizer, save_tokenizer
from threefold.models.sizes import count_parameters
from threefold.parallel.placements import Placement, Shard, whole_shards
from threefold.words import plural

FORMAT = "threefold-checkpoint-2"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; one line, raised on every rank."""


# --- folders ------------------------------------------------------------------------------------
def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def tmp_dir(root: str | Path, step: int) -> Path:
    """Where the ranks write the checkpoint of ``step`` before rank 0 renames it to ``step_dir``."""
    return step_dir(root, step).with_name(f"{step_dir(root, step).name}.tmp")


def unfinished_saves(root: str | Path) -> list[Path]:
    """The ``step_*.tmp`` folders under ``root``: saves cut short (a crash, a kill) before rank 0
    published them, which no command reads. A resume writes over one when it saves that step again."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name.endswith(".tmp")
             and p.name[5:-4].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:-4]))


def remove_unfinished(found: list[Path]) -> str:
    """Remove an earlier run's unfinished saves (a run that does not resume never saves into them,
    and move_aside keeps checkpoints only); what went, for the run's log."""
    size = megabytes(sum(map(folder_bytes, found)))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    names = ", ".join(path.name for path in found)
    if len(found) == 1:
        return f"an unfinished save of an earlier run ({names}, {size}; no command reads it): removed it"
    return f"{len(found)} unfinished saves of an earlier run ({names}; {size}; no command reads them): removed them"


def move_aside(found: list[Path]) -> Path:
    """Move checkpoints of an earlier run into ``earlier-<time>/`` of their folder, where
    ``list_checkpoints`` does not look; returns that folder."""
    stamp = time.strftime("earlier-%Y%m%d-%H%M%S")
    aside, n = found[0].parent / stamp, 1
    while aside.exists():  # two runs within a second
        aside, n = found[0].parent / f"{stamp}-{n}", n + 1
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside


def aside_note(found: list[Path], aside: Path) -> str:
    """What ``move_aside`` did, for the run's log: where the checkpoints went, how large they are
    and, since nothing deletes these folders, what all of them there hold together."""
    earlier = earlier_runs(aside.parent)
    moved = f"{plural(len(found), 'checkpoint')}, {megabytes(folder_bytes(aside))}"
    if len(earlier) == 1:
        return f"moved them to {aside} ({moved}; nothing deletes it)"
    return (f"moved them to {aside} ({moved}); the {len(earlier)} earlier-* folders there hold "
            f"{megabytes(sum(map(folder_bytes, earlier)))}, and nothing deletes them")


def earlier_runs(root: str | Path) -> list[Path]:
    """The ``earlier-*`` folders of ``root`` that move_aside made, oldest first."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("earlier-")) if root.is_dir() else []


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def megabytes(n: int) -> str:
    """Decimal, as the docs count checkpoints: 48.0 MB is 48,000,000 bytes."""
    return f"{n / 1e9:,.2f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def check_root(root: str | Path) -> None:
    """Refuse a ``train.checkpoint_dir`` that is a file, or one checkpoint rather than their folder
    (saves would land inside it and a resume would not find it)."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"train.checkpoint_dir: {str(root)!r} is a file, not a folder")
    check_output_path("train.checkpoint_dir", root, made="folder")  # not at the first save, steps later
    if (root / "trainer.json").is_file():
        if read_meta(root).get("weights_only"):  # `threefold import`'s: nothing to resume, weights to start from
            raise ConfigError(f"train.checkpoint_dir: {str(root)!r} holds imported weights, not a run to resume; "
                              f"start a new run from them with model.init_from = {json.dumps(str(root))} and a "
                              "checkpoint_dir of its own")
        raise ConfigError(f"train.checkpoint_dir: {str(root)!r} is one checkpoint, not a folder of them; set it to "
                          f"{str(root.parent)!r} (train.resume continues from the latest there)")


def resolve(path: str | Path) -> Path:
    """A checkpoint folder, or a checkpoint_dir whose latest checkpoint is meant."""
    path = Path(path)
    if (path / "trainer.json").is_file():
        return path
    if not path.exists():
        raise ConfigError(f"checkpoint: {str(path)!r} does not exist")
    if path.name.startswith("step_") and path.name[5:].isdigit():
        read_meta(path)  # its trainer.json is missing: one line saying so
    latest = list_checkpoints(path)
    if not latest:
        earlier = earlier_runs(path)  # what a fresh run in this checkpoint_dir moved aside
        hint = f"; an earlier run's are in {str(earlier[-1])!r}, name that folder" if earlier else ""
        raise ConfigError(f"checkpoint: {str(path)!r} holds no threefold checkpoint (no step_*/trainer.json){hint}")
    return latest[-1]


def read_meta(path: Path) -> dict:
    """trainer.json, checked: a JSON object of this format whose config holds every section, each
    key of the type its field has (converted as ``--set`` converts it) and a valid model; anything
    else is one line naming the file and what is wrong with it."""
    file = path / "trainer.json"
    if not file.exists() and path.is_dir() and path.name.startswith("step_"):
        raise ConfigError(f"checkpoint: {str(path)!r} lacks trainer.json (a save that did not finish, or damage); "
                          f"remove {path.name} to use the checkpoint before it")
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"checkpoint: cannot read {file} ({err.__class__.__name__})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"checkpoint: {file} is not a {FORMAT} checkpoint's metadata (a JSON "
                          f"{_json_kind(meta)}, not an object)")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint: {str(path)!r} is not a {FORMAT} checkpoint (format {meta.get('format')!r})")
    for key, least in (("step", 0), ("world_size", 1)):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"checkpoint: {file} has {key}={value!r}; expected an integer of at least {least}")
    adam_step = meta.get("adam_step")
    if adam_step is not None and (not isinstance(adam_step, (int, float)) or isinstance(adam_step, bool)
                                  or not math.isfinite(adam_step) or adam_step < 0):
        raise ConfigError(f"checkpoint: {file} has adam_step={adam_step!r}; expected a number of at least 0")
    for key in ("imported_from", *TOKENIZER_META_KEYS):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise ConfigError(f"checkpoint: {file} has {key}={meta[key]!r}; expected a string")
    context = meta.get(CONTEXT_KEY)
    if context is not None and (not isinstance(context, int) or isinstance(context, bool) or context < 1):
        raise ConfigError(f"checkpoint: {file} has {CONTEXT_KEY}={context!r}; expected an integer of at least 1")
    if not meta.get("weights_only"):  # a training checkpoint: resuming reads where the sampler was
        _check_sampler(meta.get("sampler"), file)
    meta["config"] = _saved_config(meta, file)
    return meta


def _check_sampler(state, file: Path) -> None:
    """The sampler's state as ``BatchSampler.state_dict`` writes it: four integers (none when the
    checkpoint was saved outside ``train``, which resuming then refuses)."""
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint: {file} has sampler={state!r}; expected an object with seed, step, "
                          f"seq_len and global_batch")
    for key, least in (("seed", 0), ("step", 0), ("seq_len", 1), ("global_batch", 1)):
        value = state.get(key, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"checkpoint: {file} has sampler.{key}={value!r}; expected an integer of at least {least}")


def _json_kind(value) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _saved_config(meta: dict, file: Path) -> dict:
    """The config a checkpoint was saved with, every key checked as a TOML file's would be."""
    from threefold.config import SECTIONS, apply_values

    if "config" not in meta:
        raise ConfigError(f"checkpoint: {file} lacks the key 'config' (the run's config)")
    saved = meta["config"]
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint: {file} has a config that is a JSON {_json_kind(saved)}, not an object")
    missing = [section for section in SECTIONS if section not in saved]
    if missing:
        raise ConfigError(f"checkpoint: {file} has a config without the section {missing[0]!r}")
    cfg = Config()
    try:
        apply_values(cfg, saved, origin=str(file))
        cfg.model.validate()
        if cfg.model.vocab_size is None:
            raise ConfigError("model.vocab_size: must be set in a checkpoint, got None")
    except ConfigError as err:
        raise ConfigError(f"checkpoint: {file}: {err}") from None
    return cfg.to_dict()


def describe(path: Path, meta: dict) -> str:
    """``runs/x/step_000040 (step 40)``, or ``… (weights imported from smollm2)``: what was loaded."""
    if meta.get("imported_from"):
        return f"{path} (weights imported from {meta['imported_from']})"
    return f"{path} (step {meta['step']})"


# What a checkpoint's meta may record of its tokenizer beyond tokenizer.json: the end-of-text
# token generation stops at, the begin-of-text token an export names, the chat template.
TOKENIZER_META_KEYS = ("eos_token", "bos_token", "chat_template")


def tokenizer_meta(meta: dict) -> dict:
    """The TOKENIZER_META_KEYS a checkpoint's meta records (an imported chat model's): a run
    started or resumed from it saves them again, so that ``generate --chat`` and ``export`` work
    on what it trained."""
    return {key: meta[key] for key in TOKENIZER_META_KEYS if meta.get(key) is not None}


# A fine-tune trains at its own model.seq_len, often far shorter than the context its pretrained
# model was made for (SmolLM2: 8,192). The checkpoint keeps that context apart, as transformers
# keeps max_position_embeddings through a fine-tune; config.model.seq_len stays the training's,
# which the sampler resumes with.
CONTEXT_KEY = "context"


def model_config(meta: dict) -> ModelConfig:
    """The model a checkpoint holds, to use it (generate, export, init_from): its config, with the
    context it keeps where that is longer than the sequences it was trained on."""
    model = ModelConfig(**meta["config"]["model"])
    return dataclasses.replace(model, seq_len=max(model.seq_len, meta.get(CONTEXT_KEY) or 0))


def read_tokenizer(path: Path, meta: dict):
    """The checkpoint's tokenizer, with the end- and begin-of-text tokens and the chat template it
    was saved with."""
    try:
        return load_tokenizer(path / "tokenizer.json", meta["config"]["data"]["tokenizer"],
                              meta.get("eos_token", EOS), meta.get("chat_template"), meta.get("bos_token"))
    except Exception:
        raise ConfigError(f"checkpoint: {path / 'tokenizer.json'} is missing or unreadable") from None


# --- pieces by tensor name -----------------------------------------------------------------------
def _by_name(shards: list[Shard]) -> dict[str, list[Shard]]:
    named: dict[str, list[Shard]] = {}
    for shard in shards:
        named.setdefault(shard.name, []).append(shard)
    return named


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns on every call without a process group; one process is what we mean there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- save ----------------------------------------------------------------------------------------
def save(root: str | Path, step: int, engine, cfg: Config, sampler_state: dict, tokenizer=None,
         keep: int = 2, kept_meta: dict | None = None) -> Path | None:
    """Every rank calls this; rank 0 publishes the folder. Returns the folder on rank 0.
    ``kept_meta``: what the run keeps of the model it started from (tokenizer_meta, CONTEXT_KEY),
    saved again."""
    tmp = _begin(root, step, engine)
    meta = _meta(step, engine, cfg, sampler_state, kept_meta)
    final = _write_and_publish(root, step, tmp, _this_ranks_shards(engine), meta, engine, tokenizer, keep, group=None)
    engine.barrier()  # nobody goes on until the checkpoint is published
    return final


class Checkpointer:
    """Saves every ``checkpoint_every`` steps, in the foreground or (``asynchronous``) in a
    background thread. Asynchronous: the training loop pays for a copy of this rank's states
    (the snapshot); writing them, and rank 0's publishing of the folder, happen in the thread,
    whose DCP collectives run over a process group of their own so that they never interleave
    with the training's. One save is in flight at a time: the next waits for it."""

    def __init__(self, engine, asynchronous: bool = False, timeout_s: float = 300.0, kept_meta: dict | None = None,
                 say=None):
        self.engine, self.asynchronous, self.kept_meta = engine, asynchronous, kept_meta
        self.say = say  # rank 0's log: one line per published checkpoint (a bar or --no-progress alike)
        self.group = None
        if asynchronous and not _no_dist():  # collective: every rank creates it, at the same point
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint") if asynchronous else None
        self.pending: Future | None = None

    def save(self, root, step: int, cfg: Config, sampler_state: dict, tokenizer=None, keep: int = 2):
        """Returns the published folder (rank 0, foreground) or the folder it will become."""
        if not self.asynchronous:
            began = time.perf_counter()
            final = save(root, step, self.engine, cfg, sampler_state, tokenizer, keep, self.kept_meta)
            self._said(final, time.perf_counter() - began)
            return final
        stopped = time.perf_counter()
        self.wait()  # the training waits for the save in flight too
        began = time.perf_counter()
        tmp = _begin(root, step, self.engine)
        snapshot = [Shard(s.name, s.full_shape, s.offsets, s.tensor.to("cpu", copy=True))
                    for s in _this_ranks_shards(self.engine)]
        meta = _meta(step, self.engine, cfg, sampler_state, self.kept_meta)
        self.pending = self.executor.submit(self._in_background, began, time.perf_counter() - stopped, root, step,
                                            tmp, snapshot, meta, self.engine, tokenizer, keep, self.group)
        return step_dir(root, step) if self.engine.is_main else None

    def _in_background(self, began: float, paused: float, *write_and_publish) -> Path | None:
        final = _write_and_publish(*write_and_publish)
        self._said(final, time.perf_counter() - began, paused)
        return final

    def _said(self, final: Path | None, seconds: float, paused: float | None = None) -> None:
        """``saved checkpoint runs/x/step_000100 (12.3 MB) in 0.41 s``, on rank 0, once it is published."""
        if final is not None and self.say is not None:
            background = f", in the background (training paused {paused:.2f} s)" if paused is not None else ""
            self.say(f"saved checkpoint {final} ({megabytes(folder_bytes(final))}) in {seconds:.2f} s{background}")

    def wait(self) -> None:
        """Until the save in flight is complete (and published, on rank 0); raises its error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.executor is not None:
            self.executor.shutdown()
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def _begin(root, step: int, engine) -> Path:
    """The temporary folder the ranks write into (rank 0 makes it empty first)."""
    tmp = tmp_dir(root, step)
    if engine.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.barrier()
    return tmp


def _this_ranks_shards(engine) -> list[Shard]:
    rng = torch.get_rng_state()
    return engine.checkpoint_shards() + [Shard(f"rng/rank{engine.rank}", tuple(rng.shape), (0,), rng)]


def _meta(step: int, engine, cfg: Config, sampler_state: dict, kept_meta: dict | None = None) -> dict:
    return {"format": FORMAT, "step": step, "adam_step": engine.adam_step(), "sampler": sampler_state,
            "world_size": engine.world_size, "config": cfg.to_dict(), **(kept_meta or {})}


def _write_and_publish(root, step: int, tmp: Path, shards: list[Shard], meta: dict, engine, tokenizer, keep: int,
                       group) -> Path | None:
    """Write every rank's pieces into ``tmp``, then (rank 0) publish it. If writing fails (a full
    disk, above all), every rank raises CheckpointError, the same line (DCP gathers the ranks'
    write errors), and rank 0 removes the half-written folder, which no listing would return
    anyway, to give its bytes back."""
    from threefold.train.dcp_pieces import CheckpointException

    try:
        _write(tmp, shards, group)  # returns on rank 0 once every rank has written its pieces
        return _publish(root, step, tmp, engine, meta, tokenizer, keep)
    except (OSError, CheckpointException) as err:
        errors = [e for e, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        needed = checkpoint_bytes(ModelConfig(**meta["config"]["model"]), shards, engine.world_size)
        # A full disk shows as ENOSPC or, where torch.save's zip writer met it, as a short write.
        full = (any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors)
                or shutil.disk_usage(tmp.parent).free < needed)
        if engine.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = list_checkpoints(root)
        kept = f"{latest[-1]} stays the latest checkpoint" if latest else "no checkpoint was saved before"
        if full:
            raise CheckpointError(f"checkpoint: no space left on the device of {tmp}: the checkpoint of step {step} "
                                  f"needs at least {needed:,} bytes, {shutil.disk_usage(root).free:,} are free there; "
                                  f"{kept}") from None
        first = str(errors[0]).strip().splitlines()[-1] if str(errors[0]).strip() else type(errors[0]).__name__
        raise CheckpointError(f"checkpoint: writing {tmp} failed ({first[:160]}); {kept}") from None
    except RuntimeError as err:  # DCP's own collectives timed out or broke: a rank is gone or stuck
        raise engine.comm.library_error(f"saving the checkpoint of step {step}", err, f"checkpoint-{step}") from None


def checkpoint_bytes(model: ModelConfig, shards: list[Shard], world: int) -> int:
    """Bytes of the tensors of a whole checkpoint: every weight and its two Adam moments once
    (fp32, as the engines keep them), and each rank's RNG state. The files add DCP's framing
    of each piece (7% for the tiny test model, less for larger tensors)."""
    rng = next(s.tensor for s in shards if s.name.startswith("rng/"))
    return 3 * 4 * count_parameters(model) + world * rng.numel() * rng.element_size()


def _write(tmp: Path, shards: list[Shard], group) -> None:
    from threefold.train.dcp_pieces import save_pieces

    with _single_process_is_meant():
        save_pieces(tmp, _by_name(shards), no_dist=_no_dist(), group=group)


def _publish(root, step: int, tmp: Path, engine, meta: dict, tokenizer, keep: int) -> Path | None:
    """Rank 0: write trainer.json last, flush, rename the folder into place, drop old ones."""
    if not engine.is_main:
        return None
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp / "tokenizer.json")
    (tmp / "trainer.json").write_text(json.dumps(meta, indent=1))
    for written in (tmp / "trainer.json", tmp / "tokenizer.json", tmp):  # DCP flushed its own files
        if written.exists():
            _fsync(written)
    final = step_dir(root, step)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync(final.parent)  # the rename itself
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _whole_weights(model) -> list[Shard]:
    """A plain model's weights as pieces, one whole tensor each (a tied weight once)."""
    return [s for key, p in model.named_parameters()
            for s in whole_shards(f"model/{key}", p.data, Placement(tuple(p.shape)))]


def save_weights(folder: Path, model, meta: dict, tokenizer) -> None:
    """A weights-only checkpoint written by one process (``threefold import``): the model's
    tensors as one piece each, no optimizer states. ``generate``, ``export`` and
    ``[model] init_from`` read it; resuming a run from it is refused."""
    from threefold.train.dcp_pieces import save_pieces

    with _single_process_is_meant():
        save_pieces(folder, _by_name(_whole_weights(model)), no_dist=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, folder / "tokenizer.json")
    meta = {"format": FORMAT, "step": 0, "weights_only": True, "world_size": 1, **meta}
    (folder / "trainer.json").write_text(json.dumps(meta, indent=1))


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to disk (a folder must be flushed too for a
    file created or renamed in it to survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- load ----------------------------------------------------------------------------------------
def check_model(meta: dict, cfg: Config, path: Path) -> None:
    """Refuse a checkpoint of another model (or another sequence length: the data stream would
    change), naming the difference. A vocabulary left to the tokenizer (None) is checked once
    the tokenizer has set it."""
    saved = ModelConfig(**meta["config"]["model"])
    for key in (*WEIGHT_DEFINING_KEYS, "seq_len"):
        now = getattr(cfg.model, key)
        if key == "vocab_size" and now is None:
            continue
        if getattr(saved, key) != now:
            raise ConfigError(f"checkpoint: {str(path)!r} has model.{key}={getattr(saved, key)}, this run has {now}")


SAMPLER_KEYS = {"seed": "train.seed", "seq_len": "model.seq_len", "global_batch": "train.global_batch"}


def check_resumable(path: Path, cfg: Config) -> dict:
    """Before any rank starts: the checkpoint a resume would read is a training run's (not
    imported weights) of this model (check_model), and this run continues its stream of batches
    (the sampler's seed, sequence length and global batch); its metadata."""
    meta = read_meta(path)
    if meta.get("weights_only"):
        raise ConfigError(f"checkpoint: {str(path)!r} holds weights only, no optimizer states to resume; "
                          f"start a new run from it with model.init_from = {json.dumps(str(path))}")
    for key, flag in SAMPLER_KEYS.items():
        saved, now = meta["sampler"].get(key), getattr(cfg.model if flag.startswith("model") else cfg.train, key)
        if saved is None:
            raise ConfigError(f"checkpoint: {str(path)!r} holds no sampler {key} (it was not saved by train), so a run "
                              "cannot resume from it")
        if saved != now:
            raise ConfigError(f"{flag}: {str(path)!r} was saved with {flag}={saved}, this run has {now}; the batches "
                              f"it continues follow from it: resume with --set {flag}={saved}")
    check_model(meta, cfg, path)
    return meta


def check_tokenizer(path: Path, tokenizer, key: str) -> None:
    """Refuse a checkpoint whose token ids mean other tokens than this run's tokenizer gives them
    (another corpus or tokenizer): its embedding's rows would be read as other tokens. Tokens one
    of them adds (a chat template's, padding) change no id; nothing to compare where the
    checkpoint was saved without a tokenizer."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return
    saved = {i: token for token, i in load_tokenizer(file, "checkpoint").hf.get_vocab().items()}
    now = {i: token for token, i in tokenizer.hf.get_vocab().items()}
    moved = sum(1 for i in saved.keys() & now.keys() if saved[i] != now[i])
    if moved:
        raise ConfigError(f"{key}: {str(path)!r} was trained with another tokenizer: {moved:,} of the {len(saved):,} "
                          "token ids it knows mean another token in this run's, so its embedding would read other "
                          f"tokens; tokenize with its own (copy {file.name} out of the checkpoint, which "
                          "keep_checkpoints may delete, and set data.tokenizer to the copy)")


def _metadata(path: Path):
    from threefold.train.dcp_pieces import read_metadata

    try:
        return read_metadata(path)
    except Exception as err:
        raise ConfigError(f"checkpoint: {path / '.metadata'} is missing or unreadable ({err.__class__.__name__})") from None


def damage(path: Path) -> str | None:
    """What is wrong with the files of the checkpoint at ``path``, in one line, or None when every
    piece its metadata lists is there in full. Reads nothing but the metadata and the files'
    sizes, so every rank finds the same answer before any of them starts reading."""
    metadata = _metadata(path)
    needed: dict[str, int] = {}  # file → the bytes its pieces span
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"checkpoint: {str(file)!r} is missing (the metadata lists pieces in it)"
        if file.stat().st_size < size:
            return (f"checkpoint: {str(file)!r} is truncated: {file.stat().st_size:,} bytes, its pieces need "
                    f"{size:,}; remove {path.name} to use the checkpoint before it")
    return None


def _read(path: Path, state: dict[str, list[Shard]], no_dist: bool) -> None:
    """Fill every piece in ``state`` from the checkpoint at ``path`` (every rank calls this,
    unless ``no_dist``)."""
    from threefold.train.dcp_pieces import CheckpointException, TensorStorageMetadata, load_pieces

    metadata = _metadata(path)
    problem = damage(path)
    if problem:
        raise ConfigError(problem)
    for name, shards in state.items():
        saved = metadata.state_dict_metadata.get(name)
        if not isinstance(saved, TensorStorageMetadata):
            raise ConfigError(f"checkpoint: {str(path)!r} holds no tensor {name!r}")
        if tuple(saved.size) != shards[0].full_shape:
            raise ConfigError(f"checkpoint: {str(path)!r} has {name} of shape {tuple(saved.size)}, "
                              f"this run has {shards[0].full_shape}")
    try:
        with _single_process_is_meant():
            load_pieces(path, state, no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # a truncated or missing piece file, on any rank: one line on every rank
        if isinstance(err, RuntimeError) and not no_dist:
            raise  # among ranks DCP reports a bad piece as CheckpointException: this is a collective that failed
        first = str(err).strip().splitlines()[-1] if str(err).strip() else err.__class__.__name__
        raise ConfigError(f"checkpoint: {str(path)!r} is unreadable: reading its pieces failed ({first[:160]})") from None


def load(path: Path, engine, cfg: Config) -> dict:
    """Restore weights, Adam's states and RNG into ``engine``, whatever layout saved them;
    return the checkpoint's metadata (step, sampler)."""
    meta = read_meta(path)
    if meta.get("weights_only"):
        raise ConfigError(f"checkpoint: {str(path)!r} holds weights only, no optimizer states to resume; "
                          f"start a new run from it with model.init_from = {json.dumps(str(path))}")
    check_model(meta, cfg, path)
    engine.set_adam_step(meta["adam_step"])  # first: the weight versions kept (2bw, pipedream) follow from it
    state = _by_name(engine.checkpoint_shards())
    check_weight_versions(path, meta, cfg, state)
    saved_world = meta["world_size"]
    rng = torch.get_rng_state()  # a rank the saving layout did not have takes rank r mod its size
    name = f"rng/rank{engine.rank % saved_world}"
    state[name] = [Shard(name, tuple(rng.shape), (0,), rng)]
    _read_on_every_rank(path, state, engine)
    torch.set_rng_state(rng)
    return meta


def _read_on_every_rank(path: Path, state: dict[str, list[Shard]], engine) -> None:
    """``_read`` by every rank of the job; a collective of DCP's that times out or breaks (a rank
    gone or stuck) is one line naming the ranks that did not come, as a save's is."""
    try:
        _read(path, state, no_dist=_no_dist())
    except RuntimeError as err:
        raise engine.comm.library_error(f"loading the checkpoint {path.name}", err, f"load-{path.name}") from None


def check_weight_versions(path: Path, meta: dict, cfg: Config, state: dict) -> None:
    """Refuse, in one line, to resume 2bw or pipedream from a checkpoint without the older
    weight versions the run keeps (saved by a schedule that flushes, or by pipedream on fewer
    stages): without them the resumed updates would not be the run's."""
    stored = _metadata(path).state_dict_metadata
    if any(name.startswith("version") and name not in stored for name in state):
        saved, p = meta["config"]["parallel"], cfg.parallel
        raise ConfigError(f"checkpoint: {str(path)!r} lacks older weight versions (\"version<j>/<key>\") that "
                          f"{p.schedule} on pp={p.pp} resumes with, which the run that saved it ({saved['schedule']} "
                          f"on pp={saved['pp']}) did not keep; resume it with the schedule and pp that saved it")


def read_model(path: Path):
    """(ModelConfig, the full plain-model state dict) of a checkpoint, read by this process
    alone (export, generate)."""
    from threefold.models.llama import Llama

    model_cfg = model_config(read_meta(path))
    with torch.device("meta"):
        shapes = Llama(model_cfg)
    weights = dict(shapes.named_parameters(remove_duplicate=False))
    # DCP fills every weight (a tied one once: from_state_dict ties the head to the embedding), so
    # their storage starts uninitialised rather than random; the persistent buffers it does not read
    # (the MoE expert_bias) are zeros, as __init__ makes them
    model = Llama.from_state_dict(model_cfg, {
        key: (torch.empty if key in weights else torch.zeros)(t.shape, dtype=t.dtype)
        for key, t in shapes.state_dict().items()})
    _read(path, _by_name(_whole_weights(model)), no_dist=True)
    return model_cfg, model.state_dict()


def piece_reader(path: Path):
    """(the checkpoint's ModelConfig, a reader of pieces of its weights): each request, our key →
    (placement, local shape), is read as that box of the saved tensor, whatever layout saved it
    (DCP reads the stored pieces that overlap it, nothing else)."""
    model_cfg = model_config(read_meta(path))

    def read(requests: dict[str, tuple[Placement, tuple]]) -> dict[str, torch.Tensor]:
        pieces = {key: torch.zeros(shape) for key, (_, shape) in requests.items()}  # padding stays zero
        boxes = {f"model/{key}": whole_shards(f"model/{key}", pieces[key], placement)
                 for key, (placement, _) in requests.items()}
        _read(path, {name: shards for name, shards in boxes.items() if shards}, no_dist=True)
        return pieces

    return model_cfg, read


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every full tensor of a checkpoint whose name starts with ``prefix``, read whole by this
    process alone ("model/<key>", "exp_avg/<key>", "exp_avg_sq/<key>", "rng/rank<r>")."""
    from threefold.train.dcp_pieces import TensorStorageMetadata

    tensors = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
               for name, md in _metadata(path).state_dict_metadata.items()
               if name.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
    _read(path, {name: [Shard(name, tuple(t.shape), (0,) * t.dim(), t)] for name, t in tensors.items()}, no_dist=True)
    return tensors


def pieces(path: Path) -> dict[str, dict]:
    """What a checkpoint stores, tensor by tensor: full shape, dtype, and each piece's offsets,
    sizes and the rank that wrote it (from DCP's metadata; nothing is read but that)."""
    from threefold.train.dcp_pieces import MetadataIndex, TensorStorageMetadata

    metadata = _metadata(path)
    found = {}
    for name, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        stored = []
        for chunk in md.chunks:
            file = metadata.storage_data[MetadataIndex(name, chunk.offsets)].relative_path
            stored.append({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                           "rank": int(file.split("_")[2]), "file": file})
        found[name] = {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch."),
                       "pieces": stored}
    return found
