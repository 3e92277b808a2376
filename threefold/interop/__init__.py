"""Interoperability: weights out to Hugging Face's LlamaForCausalLM format, and in from it or from
llama.cpp's GGUF files (``hf.py``, ``gguf.py``; the commands in ``commands.py``).

``load_hf_weights(folder) -> (ModelConfig, state_dict)`` reads an HF folder;
``init_from_state(model_cfg) -> state_dict`` is what ``[model] init_from`` uses: it also checks
that the folder's model is the run's.
"""
from threefold.interop.hf import init_from_state, load_hf_weights

__all__ = ["init_from_state", "load_hf_weights"]
