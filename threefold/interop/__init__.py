"""Interoperability: weights out to Hugging Face's LlamaForCausalLM format, and in from it or from
llama.cpp's GGUF files (``hf.py``, ``gguf.py``; the commands in ``commands.py``).

``load_hf_weights(folder) -> (ModelConfig, state_dict)`` is what ``[model] init_from`` uses.
"""
from threefold.interop.hf import load_hf_weights

__all__ = ["load_hf_weights"]
