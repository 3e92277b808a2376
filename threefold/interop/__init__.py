"""Interoperability: weights out to Hugging Face's LlamaForCausalLM format, and in from it or from
llama.cpp's GGUF files (``hf.py``, ``gguf.py``; the commands in ``commands.py``).

``load_hf_weights(folder) -> (ModelConfig, state_dict)`` reads an HF folder;
``init_from_state(model_cfg) -> state_dict`` is what ``[model] init_from`` uses: it also checks
that the folder's model is the run's.

The names are imported on first use, so that ``threefold --help``, which finds every command's
module and so imports this package, does not pay for torch.
"""
import importlib

_EXPORTS = {"init_from_state": "threefold.interop.hf", "load_hf_weights": "threefold.interop.hf"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
