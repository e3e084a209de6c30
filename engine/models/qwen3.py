"""Qwen3 dense decoder: the Llama block with an RMSNorm (size head_dim, its own weight)
on every query and key head before RoPE, and no q/k/v bias.

    q, k = q_norm(q_proj(x) per head), k_norm(k_proj(x) per head);  then RoPE, attention

Its config states head_dim, which may differ from hidden_size / num_heads. Both paths run
it: the kernel path normalises the head rows with the RMSNorm kernel before the fused
RoPE + cache write (engine/models/layers.py).
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.decoder import DecoderLayer
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        return LlamaDecoderLayer(config, config.window_of(n), qk_norm=True)

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(config, prefix)
        shapes[prefix + "self_attn.q_norm.weight"] = (config.head_dim,)
        shapes[prefix + "self_attn.k_norm.weight"] = (config.head_dim,)
        return shapes
