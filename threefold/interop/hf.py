"""Hugging Face's Llama and Mixtral formats, both ways.

An HF folder holds ``config.json`` (a ``LlamaConfig``), the weights in ``model.safetensors``
(or in shards listed by ``model.safetensors.index.json``) and the tokenizer in ``tokenizer.json``.
``LlamaForCausalLM`` is the same network as our plain model under other names, with rotary
embeddings in the same rotate-half convention, so every tensor maps to one tensor unchanged.
What our model cannot represent (biases, rope scaling, another architecture or activation) is
refused with one line, never silently dropped.

A model with experts (``moe_experts``) is a ``MixtralForCausalLM``: the same attention, and in
every layer a softmax top-k router (``block_sparse_moe.gate``) over SwiGLU experts stored one
by one (``block_sparse_moe.experts.{e}.w1/w3/w2`` = our gate/up/down, each our stacked tensor's
row e), the layout Mistral's checkpoints have and transformers writes. transformers runs it
dropless, so an exported model gives its logits without a capacity limit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from threefold.config import WEIGHT_DEFINING_KEYS, ConfigError, ModelConfig
from threefold.data.tokenizer import EOS, Tokenizer, load_tokenizer, save_tokenizer
from threefold.models.sizes import is_moe_layer
from threefold.parallel.placements import Placement, held_range, zero_padded

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"

# Names inside blocks.{i} (ours) → inside model.layers.{i} (Hugging Face's).
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn.wq": "self_attn.q_proj",
    "attn.wk": "self_attn.k_proj",
    "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "mlp.w_gate": "mlp.gate_proj",
    "mlp.w_up": "mlp.up_proj",
    "mlp.w_down": "mlp.down_proj",
}
MIXTRAL_EXPERTS = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}  # ours → Mixtral's, inside experts.{e}


def hf_names(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name → Hugging Face's, for every tensor an HF folder stores.

    With tied embeddings HF stores no ``lm_head.weight``: the head is the embedding.
    """
    names = {"embed.weight": "model.embed_tokens.weight"}
    for i in range(cfg.layers):
        moe = is_moe_layer(cfg, i)
        for ours, theirs in BLOCK_NAMES.items():
            if not (moe and ours.startswith("mlp.")):
                names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        if moe:
            names[f"blocks.{i}.mlp.router.weight"] = f"model.layers.{i}.block_sparse_moe.gate.weight"
    names["norm.weight"] = "model.norm.weight"
    if not cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    return names


def expert_names(cfg: ModelConfig) -> dict[str, list[str]]:
    """Our stacked expert tensor → Mixtral's tensors of experts 0, 1, …, E−1."""
    return {f"blocks.{i}.mlp.experts.{ours}": [f"model.layers.{i}.block_sparse_moe.experts.{e}.{theirs}.weight"
                                               for e in range(cfg.moe_experts)]
            for i in range(cfg.layers) if is_moe_layer(cfg, i) for ours, theirs in MIXTRAL_EXPERTS.items()}


def check_mixtral(cfg: ModelConfig, where: str) -> None:
    """Refuse, in one line, an MoE model that Mixtral's format cannot represent."""
    refused = {"moe_shared_experts": cfg.moe_shared_experts and "shared experts",
               "moe_router": cfg.moe_router != "softmax" and "a sigmoid router",
               "moe_renormalize": not cfg.moe_renormalize and "top-k weights that are not renormalised",
               "moe_first_dense": (cfg.moe_first_dense or cfg.moe_every > 1) and "dense layers among the MoE ones"}
    for key, what in refused.items():
        if what:
            raise ConfigError(f"{where}: model.{key}: Mixtral's format cannot hold {what}")


def parameter_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """The shape of every tensor of ``Llama(cfg)``, without allocating it."""
    from threefold.models.llama import Llama

    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in Llama(cfg).state_dict().items()}


# ---------------------------------------------------------------- config.json


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_id: int | None, bos_id: int | None = None) -> dict:
    """config.json of ``LlamaForCausalLM`` (``MixtralForCausalLM`` with experts) for ``cfg``;
    readable by transformers 4.x and 5.x. ``bos_id``: the model's own begin-of-text token, where
    it has one (Tokenizer.bos); else the end-of-text token."""
    if cfg.moe_experts:
        return dict(hf_config(dataclasses.replace(cfg, moe_experts=0, moe_top_k=None), dtype, eos_id, bos_id),
                    architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=cfg.moe_experts,
                    num_experts_per_tok=cfg.moe_top_k_experts, intermediate_size=cfg.moe_ffn_hidden,
                    router_aux_loss_coef=cfg.moe_aux_loss_coef, router_jitter_noise=0.0, sliding_window=None)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # Our documents are separated by one EOS token, which therefore also opens each document.
        "bos_token_id": eos_id if bos_id is None else bos_id,
        "eos_token_id": eos_id,
    }


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """A ``ModelConfig`` from an HF config.json, refusing what our model cannot represent.

    Absent keys take ``LlamaConfig``'s defaults, as transformers would.
    """
    architectures = config.get("architectures") or ["LlamaForCausalLM"]
    mixtral = (config.get("model_type"), architectures) == ("mixtral", ["MixtralForCausalLM"])
    if not mixtral and (config.get("model_type") != "llama" or architectures != ["LlamaForCausalLM"]):
        raise ConfigError(f"{where}: not a Llama model (model_type {config.get('model_type')!r}, architectures "
                          f"{architectures}); only LlamaForCausalLM and MixtralForCausalLM can be imported")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    if mixtral:
        required += ("num_local_experts", "num_experts_per_tok")
        if config.get("sliding_window") is not None:
            raise ConfigError(f"{where}: sliding_window {config['sliding_window']} is not supported "
                              "(the model attends to the whole sequence)")
    for key in required:
        if key not in config:
            raise ConfigError(f"{where}: config.json lacks {key!r}")
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise ConfigError(f"{where}: config.json has {key}={config[key]!r}; expected a positive integer")
    if config.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {config['hidden_act']!r} is not supported (the model uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if _flag(config, key, False, where):
            raise ConfigError(f"{where}: {key} is true; the model has no biases")
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta and rope_scaling.
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise ConfigError(f"{where}: config.json has {key}={config[key]!r}; expected an object or null")
    rope = config.get("rope_parameters") or dict(config.get("rope_scaling") or {},
                                                 rope_theta=config.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{where}: rope scaling {rope_type!r} is not supported (only plain rotary embeddings)")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    for key in ("head_dim", "num_key_value_heads", "max_position_embeddings"):
        _count(config, key, where)
    if config.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"{where}: head_dim {config['head_dim']} differs from hidden_size/num_attention_heads "
                          f"= {hidden // heads}; the model cannot represent that")
    cfg = ModelConfig(
        layers=config["num_hidden_layers"],
        hidden=hidden,
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        ffn=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        seq_len=config.get("max_position_embeddings") or 2048,
        tie_embeddings=_flag(config, "tie_word_embeddings", False, where),
        norm_eps=_number(config, "rms_norm_eps", 1e-6, where),
        rope_theta=_number(rope, "rope_theta", 10000.0, where),
    )
    if mixtral:  # every layer has experts as wide as intermediate_size (moe_ffn unset: the dense width)
        cfg = dataclasses.replace(cfg, moe_experts=config["num_local_experts"],
                                  moe_top_k=config["num_experts_per_tok"],
                                  moe_aux_loss_coef=_number(config, "router_aux_loss_coef", 0.001, where,
                                                            zero_ok=True))
    cfg.validate()
    return cfg


def _count(config: dict, key: str, where: str) -> None:
    """An optional integer key of config.json: absent, null, or a positive integer."""
    value = config.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{where}: config.json has {key}={value!r}; expected a positive integer")


def _number(config: dict, key: str, default: float, where: str, zero_ok: bool = False) -> float:
    """A float key of config.json (or of its rope parameters): a finite number above 0 (at least 0
    with ``zero_ok``), its default when absent or null."""
    value = config.get(key)
    if value is None:
        return default
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond float's range
        number = math.inf
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        expected = "a finite number of at least 0" if zero_ok else "a finite positive number"
        raise ConfigError(f"{where}: config.json has {key}={value!r}; expected {expected}")
    return number


def _flag(config: dict, key: str, default: bool, where: str) -> bool:
    """A boolean key of config.json: true or false (JSON's), its default when absent or null."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: config.json has {key}={value!r}; expected true or false")
    return value


# ---------------------------------------------------------------- weights


def to_hf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Our full state dict → Hugging Face's tensors, checking that every tensor is there in its shape."""
    shapes = parameter_shapes(cfg)
    if cfg.moe_experts:
        check_mixtral(cfg, where)
        biased = [key for key in shapes if key.endswith("expert_bias") and key in state and state[key].any()]
        if biased:
            raise ConfigError(f"{where}: {biased[0]} is not zero; Mixtral routes without a bias")
    tensors = {}
    for ours, theirs in {**hf_names(cfg), **expert_names(cfg)}.items():
        if ours not in state:
            raise ConfigError(f"{where}: the state dict lacks {ours!r}")
        if state[ours].shape != shapes[ours]:
            raise ConfigError(f"{where}: {ours} has shape {tuple(state[ours].shape)}, the config needs "
                              f"{tuple(shapes[ours])}")
        if isinstance(theirs, list):  # one stacked tensor → one tensor per expert
            tensors.update(zip(theirs, (e.contiguous() for e in state[ours].detach().unbind(0))))
        else:
            tensors[theirs] = state[ours].detach().contiguous()
    return tensors


def from_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors → our full state dict in fp32 (``head.weight`` is ``embed.weight`` when tied)."""
    biases = sorted(name for name in tensors if name.endswith(".bias"))
    if biases:
        raise ConfigError(f"{where}: holds a bias ({biases[0]}); the model has no biases")
    names, experts = hf_names(cfg), expert_names(cfg)
    # Older transformers saved the rotary inverse frequencies; with tied embeddings transformers
    # ignores a stored lm_head and uses the embedding, and so do we.
    ignored = {name for name in tensors if name.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        ignored.add("lm_head.weight")
    unexpected = sorted(set(tensors) - set(names.values()) - {n for each in experts.values() for n in each} - ignored)
    if unexpected:
        raise ConfigError(f"{where}: holds {unexpected[0]!r}, which a model of this config does not have")
    shapes = parameter_shapes(cfg)
    state = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ConfigError(f"{where}: lacks the tensor {theirs!r}")
        if tensors[theirs].shape != shapes[ours]:
            raise ConfigError(f"{where}: {theirs} has shape {tuple(tensors[theirs].shape)}, config.json needs "
                              f"{tuple(shapes[ours])}")
        state[ours] = tensors[theirs].float()
    for ours, theirs in experts.items():
        missing = [name for name in theirs if name not in tensors]
        if missing:
            raise ConfigError(f"{where}: lacks the tensor {missing[0]!r}")
        state[ours] = torch.stack([tensors[name] for name in theirs]).float()
        if state[ours].shape != shapes[ours]:
            raise ConfigError(f"{where}: {theirs[0]} has shape {tuple(tensors[theirs[0]].shape)}, config.json "
                              f"needs {tuple(shapes[ours][1:])}")
    for i in (i for i in range(cfg.layers) if is_moe_layer(cfg, i)):
        state[f"blocks.{i}.mlp.expert_bias"] = torch.zeros(cfg.moe_experts)  # Mixtral routes without one
    if cfg.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    return state


# ---------------------------------------------------------------- folders


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: not readable JSON ({err.__class__.__name__})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: ``model.safetensors``, or the shards its index lists."""
    if (folder / WEIGHTS).is_file():
        return [folder / WEIGHTS]
    if (folder / WEIGHTS_INDEX).is_file():
        weight_map = read_json(folder / WEIGHTS_INDEX).get("weight_map") or {}
        return [folder / name for name in sorted(set(weight_map.values()))]
    raise ConfigError(f"{folder}: no {WEIGHTS} (nor {WEIGHTS_INDEX}); only safetensors weights are read")


@contextlib.contextmanager
def readable(file: Path):
    """A safetensors file's trouble (missing, a bad header, a short file) as one line."""
    try:
        yield
    except FileNotFoundError:
        raise ConfigError(f"{file}: missing") from None
    except Exception as err:  # safetensors reports a bad header or a short file with its own error types
        reason = str(err).splitlines()[0][:100] if str(err) else err.__class__.__name__
        raise ConfigError(f"{file}: not a readable safetensors file ({reason})") from None


def read_safetensors(folder: Path, on_step=None) -> dict[str, torch.Tensor]:
    """Every tensor of the folder; ``on_step(description)`` is called before each file, for a progress display."""
    tensors = {}
    files = safetensors_files(folder)
    for i, file in enumerate(files, 1):
        if on_step is not None:
            on_step(f"reading {file.name}" + (f" ({i} of {len(files)})" if len(files) > 1 else ""))
        with readable(file):
            tensors.update(load_file(file))
    return tensors


def load_hf_weights(folder: str | Path, on_step=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The model config and our full fp32 state dict from an HF ``LlamaForCausalLM`` folder.

    ``Llama(cfg).load_state_dict(state)`` accepts the result as it is. ``on_step``: as ``read_safetensors``'.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder (expected a Hugging Face folder with {CONFIG} and {WEIGHTS})")
    cfg = model_config_from_hf(read_json(folder / CONFIG), str(folder))
    return cfg, from_hf_tensors(cfg, read_safetensors(folder, on_step), str(folder))


# What must agree between a run's [model] and the folder it starts from; seq_len may differ.


# ``[model] init_from``: each rank reads only the pieces it keeps. A reader takes requests, our
# key → (the placement of this rank's tensor, its local shape), and returns those local tensors.


def hf_piece_reader(folder: str | Path):
    """(the folder's ModelConfig, a reader of pieces of its weights). Names and shapes are checked
    from the safetensors headers first; a piece is then read alone, as a slice of the stored
    tensor (safetensors reads just those bytes), never the whole folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder (expected a Hugging Face folder with {CONFIG} and {WEIGHTS})")
    cfg = model_config_from_hf(read_json(folder / CONFIG), str(folder))
    located, headers = {}, {}
    for file in safetensors_files(folder):
        with readable(file), safe_open(file, "pt") as f:
            for name in f.keys():
                located[name] = file
                headers[name] = torch.empty(f.get_slice(name).get_shape(), device="meta")
    from_hf_tensors(cfg, headers, str(folder))  # every name and shape checked; on meta tensors, nothing read
    names = {**hf_names(cfg), **expert_names(cfg)}

    def stored(name: str, dim: int | None, start: int = 0, stop: int = 0) -> torch.Tensor:
        with readable(located[name]), safe_open(located[name], "pt") as f:
            if dim is None:
                return f.get_tensor(name)
            return f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]

    def read(requests: dict[str, tuple[Placement, tuple]]) -> dict[str, torch.Tensor]:
        pieces = {}
        for key, (placement, shape) in requests.items():
            theirs, dim = names[key], placement.dim
            start, stop = held_range(placement, shape) if dim is not None else (0, 0)
            if isinstance(theirs, str):
                piece = stored(theirs, dim, start, stop)
            elif dim == 0:  # experts [start, stop) of the stack, each whole
                piece = torch.stack([stored(name, None) for name in theirs[start:stop]])
            else:  # every expert, each sliced
                piece = torch.stack([stored(name, None if dim is None else dim - 1, start, stop) for name in theirs])
            pieces[key] = piece.float() if dim is None else zero_padded(piece.float(), dim, shape[dim])
        return pieces

    return cfg, read


def init_from_reader(cfg: ModelConfig):
    """The piece reader of ``[model] init_from``: a Hugging Face folder or a threefold checkpoint
    (saved by any layout); a folder whose model is not the run's model is refused."""
    from threefold.train import checkpoint

    found = init_from_checkpoint(cfg.init_from)
    pretrained, read = checkpoint.piece_reader(found) if found else hf_piece_reader(cfg.init_from)
    for key in WEIGHT_DEFINING_KEYS:
        if getattr(pretrained, key) != getattr(cfg, key):
            raise ConfigError(f"model.init_from: {cfg.init_from} has {key}={getattr(pretrained, key)}, "
                              f"the run's model has {getattr(cfg, key)}")
    return read


def init_from_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The whole state dict of ``[model] init_from``, read by one process (every piece whole)."""
    from threefold.models.llama import Llama

    read = init_from_reader(cfg)
    with torch.device("meta"):
        model = Llama(cfg)
    state = read({key: (Placement(tuple(p.shape)), tuple(p.shape)) for key, p in model.named_parameters()})
    saved = model.state_dict()
    for key, buffer in model.named_buffers():
        if key in saved:  # the experts' routing bias, a buffer saved with the model: it starts at zero
            state[key] = torch.zeros(buffer.shape, dtype=buffer.dtype)
    if cfg.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    return state


def init_from_checkpoint(source: str) -> Path | None:
    """The threefold checkpoint ``model.init_from`` names (a checkpoint, or the latest of a folder
    of them), or None for a Hugging Face folder."""
    from threefold.train import checkpoint

    path = Path(source)
    if (path / "trainer.json").is_file() or checkpoint.list_checkpoints(path):
        return checkpoint.resolve(path)
    return None


def describe_init_from(source: str) -> str:
    """Which weights ``model.init_from`` names: a checkpoint and its step, or a Hugging Face folder."""
    from threefold.train import checkpoint

    found = init_from_checkpoint(source)
    return checkpoint.describe(found, checkpoint.read_meta(found)) if found else f"{source} (a Hugging Face folder)"


def read_hf_folder(folder: str | Path, on_step=None) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, weights and tokenizer of an HF folder (its tokenizer.json is required)."""
    cfg, state = load_hf_weights(folder, on_step)
    tokenizer_file = Path(folder) / TOKENIZER
    if not tokenizer_file.is_file():
        raise ConfigError(f"{folder}: no {TOKENIZER}; the tokenizer is needed to use the model")
    eos, template, bos = chat_settings(Path(folder))
    try:
        tokenizer = load_tokenizer(tokenizer_file, str(tokenizer_file), eos, template, bos)
    except Exception as err:
        raise ConfigError(f"{tokenizer_file}: not a readable tokenizers file ({err.__class__.__name__})") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(f"{folder}: the tokenizer has {tokenizer.vocab_size} tokens, the model's vocabulary only "
                          f"{cfg.vocab_size}")
    return cfg, state, tokenizer


def chat_settings(folder: Path) -> tuple[str, str | None, str | None]:
    """(end-of-text token, chat template, begin-of-text token) from a folder's
    tokenizer_config.json, when it has them."""
    path = folder / "tokenizer_config.json"
    settings = read_json(path) if path.is_file() else {}

    def token(key: str) -> str | None:
        value = settings.get(key)
        value = value.get("content") if isinstance(value, dict) else value  # an AddedToken, serialised
        return value if isinstance(value, str) and value else None

    template = settings.get("chat_template")
    return token("eos_token") or EOS, (template if isinstance(template, str) else None), token("bos_token")


def write_hf_folder(folder: Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: Tokenizer) -> None:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into ``folder``.

    ``tensors`` are Hugging Face's, as ``to_hf_tensors`` returns them.
    """
    dtype = tensors["model.embed_tokens.weight"].dtype
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(hf_config(cfg, dtype, tokenizer.eos_id, tokenizer.bos_id), indent=2) + "\n")
    save_tokenizer(tokenizer, folder / TOKENIZER)
    # So that transformers' AutoTokenizer finds the tokenizer.json and its end-of-text token.
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.seq_len}
    if tokenizer.eos_id is not None:
        tokenizer_config.update(eos_token=tokenizer.eos, bos_token=tokenizer.bos)
    if tokenizer.chat_template:
        tokenizer_config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for written in folder.iterdir():  # safetensors writes 0600; the rest of the folder follows the umask
        written.chmod(0o666 & ~umask)
