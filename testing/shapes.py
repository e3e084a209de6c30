"""The model shapes benchmarks run at, in one table (random weights: speed does not depend
on their values). `tiny` is for a plumbing check on a CPU: the same code at toy sizes."""

from __future__ import annotations

from engine.config import Llama3RopeScaling, ModelConfig


def _llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           head_dim: int, theta: float, rope_scaling: Llama3RopeScaling | None = None
           ) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=intermediate, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=theta, max_position_embeddings=8192,
                       tie_word_embeddings=False, rope_scaling=rope_scaling)


SHAPES: dict[str, ModelConfig] = {
    "tiny": _llama(512, 256, 688, 4, 4, 2, 64, 10000.0),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 64, 100000.0),
    "llama3-1b": _llama(128256, 2048, 8192, 16, 32, 8, 64, 500000.0),
    "llama3-8b": _llama(128256, 4096, 14336, 32, 32, 8, 128, 500000.0,
                        Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
}
