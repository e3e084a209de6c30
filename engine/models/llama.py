"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM): pre-norm blocks, SiLU gated MLP.

    x = x + attn(input_layernorm(x))
    x = x + mlp(post_attention_layernorm(x))

Qwen2 adds a bias to the q/k/v projections (`ModelConfig.attention_bias`); Mistral (and
Qwen2 with `use_sliding_window`) slides a window over some or all layers
(`ModelConfig.window_of`). The layers are engine/models/layers.py's; the decoder around
them engine/models/decoder.py's.

The kernel path fuses each block's residual add with the next RMSNorm (Triton
`add_rms_norm_`), rotates q/k and writes the cache in one kernel, and at batch 1..8 runs
a matrix-vector kernel for the linear layers it was measured faster on
(engine/kernels/gemv.py). The kernel path rotates in fp32 from fp32 tables and rounds
once: in bf16 it is at least as accurate as the torch path, and differs from it by
rounding only (about 1% of the logits' norm for a small random model), enough to swap
greedy picks between near-equal logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
from engine.config import ModelConfig
from engine.kv_storage import KVStorage
from engine.models.decoder import DecoderForCausalLM, DecoderLayer
from engine.models.layers import Attention, GatedMLP, RMSNorm
from engine.models.moe import MoEBlock


class LlamaDecoderLayer(DecoderLayer):
    """`mlp`: the layer's feed-forward (a mixture-of-experts block, engine/models/moe.py);
    None: the dense gated MLP."""

    def __init__(self, config: ModelConfig, window: int | None, qk_norm: bool = False,
                 mlp: MoEBlock | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, window=window, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config) if mlp is None else mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.reduce(self.self_attn(self.input_layernorm(x), cos, sin, kv_k, kv_v, attn))
        return x + self.reduce(self.mlp(self.post_attention_layernorm(x)))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama, Mistral and Qwen2 checkpoints (their config says which)."""

    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        return LlamaDecoderLayer(config, config.window_of(n))

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(config, prefix)
        shapes[prefix + "input_layernorm.weight"] = (config.hidden_size,)
        shapes[prefix + "post_attention_layernorm.weight"] = (config.hidden_size,)
        return shapes

    @classmethod
    def kernel_path_refusal(cls, config: ModelConfig) -> str | None:
        return None

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                         meta: KernelAttentionMetadata,
                         on_layer: Callable[[int], None] | None) -> torch.Tensor:
        from engine.kernels.rmsnorm import add_rms_norm_triton_, rms_norm_triton

        if self.rope_tables is None:
            raise RuntimeError("the kernel path needs prepare_kernels() first")
        # The residual stream lives in `residual`; each add_rms_norm_ call adds a block's
        # output to it and leaves the next block's normalised input in its first argument.
        residual = self.embed(input_ids)
        layers = self.model.layers
        x = rms_norm_triton(residual, layers[0].input_layernorm.weight,
                            layers[0].input_layernorm.eps)
        for n, layer in enumerate(layers):
            kv_k, kv_v = kv.layer(n)
            x = layer.self_attn.forward_kernels(x, positions, self.rope_tables, kv_k, kv_v, meta,
                                                self.gemv_workspace)
            if on_layer is not None:
                on_layer(n)
            norm = layer.post_attention_layernorm
            add_rms_norm_triton_(x, residual, norm.weight, norm.eps)
            x = layer.mlp.forward_kernels(x, self.gemv_workspace)
            norm = layers[n + 1].input_layernorm if n + 1 < len(layers) else self.model.norm
            add_rms_norm_triton_(x, residual, norm.weight, norm.eps)
        return x

