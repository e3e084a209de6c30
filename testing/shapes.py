"""The model shapes benchmarks run at, in one table (random weights: speed does not depend
on their values). `tiny` and `tiny-moe` are for a plumbing check on a CPU: the same code at
toy sizes. Qwen3-8B and Qwen3-30B-A3B as their Hub configs give them (30B-A3B: 128 experts
of 768, 8 per token, every layer sparse; 61 GB of bf16 weights)."""

from __future__ import annotations

import dataclasses

from engine.config import Llama3RopeScaling, ModelConfig, MoEConfig


def _llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, theta: float, rope_scaling: Llama3RopeScaling | None = None
           ) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=theta, max_position_embeddings=8192,
                       tie_word_embeddings=False, rope_scaling=rope_scaling)


def _qwen3(vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
           kv_heads: int, moe: MoEConfig | None = None) -> ModelConfig:
    architecture = "Qwen3ForCausalLM" if moe is None else "Qwen3MoeForCausalLM"
    return dataclasses.replace(
        _llama(vocab, hidden, intermediate, layers, heads, kv_heads, 128, 1000000.0),
        architecture=architecture, rms_norm_eps=1e-6, max_position_embeddings=40960,
        moe=moe)


def _experts(num: int, top_k: int, width: int, layers: int) -> MoEConfig:
    return MoEConfig(num_experts=num, top_k=top_k, intermediate_size=width, renormalize=True,
                     layers=tuple(range(layers)))


SHAPES: dict[str, ModelConfig] = {
    "tiny": _llama(512, 256, 688, 4, 4, 2, 64, 10000.0),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 64, 100000.0),
    "llama3-1b": _llama(128256, 2048, 8192, 16, 32, 8, 64, 500000.0),
    "llama3-8b": _llama(128256, 4096, 14336, 32, 32, 8, 128, 500000.0,
                        Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
    "tiny-moe": dataclasses.replace(_qwen3(512, 256, 688, 4, 4, 2, _experts(8, 2, 128, 4)),
                                    head_dim=64),
    "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8),
    "qwen3-30b-a3b": _qwen3(151936, 2048, 6144, 48, 32, 4, _experts(128, 8, 768, 48)),
    # OLMoE-1B-7B's sizes (64 experts of 1024, 8 per token, 16 layers; 14 GB of bf16) in the
    # Qwen3-MoE family: where the 30B-A3B shape does not fit with the engine beside it.
    "olmoe-1b-7b": _qwen3(50304, 2048, 1024, 16, 16, 16, _experts(64, 8, 1024, 16)),
}
