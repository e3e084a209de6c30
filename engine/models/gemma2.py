"""Gemma 2 decoder: sandwich norms, GELU-tanh MLP, soft-capped logits, alternating
sliding-window and global attention layers.

    x = embed(ids) * sqrt(hidden)                     (the scale rounded to the model dtype)
    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    logits = cap * tanh(lm_head(norm(x)) / cap)       (final_logit_softcap)

Every RMSNorm scales by (1 + weight) in float32 (`RMSNorm(unit_offset=True)`). Attention
scores are scaled by query_pre_attn_scalar ** -0.5 and soft-capped by attn_logit_softcap;
the layers the config lists in `sliding_layers` see the last `sliding_window` positions
only (in transformers' configs, every even layer from 0).

On the kernel path (CUDA) the attention kernels soft-cap and window the scores
(engine/kernels/prefill_attention.py, paged_decode_attention.py) and q/k/v and gate/up are
fused matmuls as for Llama; the (1 + weight) norms, the residual adds and the GELU gate are
plain torch ops (no fused kernel of their own yet), all free of host syncs, so a step can
still be captured in a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
from engine.config import ModelConfig
from engine.kv_storage import KVStorage
from engine.models.decoder import DecoderForCausalLM, DecoderLayer
from engine.models.layers import Attention, GatedMLP, RMSNorm

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.self_attn = Attention(config, window=window, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps, unit_offset=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), cos, sin, kv_k, kv_v, attn)
        # The post-norms see the whole sum: under tensor parallelism, after the all-reduce.
        x = x + self.post_attention_layernorm(self.reduce(out))
        out = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(self.reduce(out))


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        return Gemma2DecoderLayer(config, config.window_of(n))

    @classmethod
    def make_norm(cls, config: ModelConfig, size: int) -> RMSNorm:
        return RMSNorm(size, config.rms_norm_eps, unit_offset=True)

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        shapes = super().layer_shapes(config, prefix)
        shapes.update({prefix + norm + ".weight": (config.hidden_size,) for norm in _NORMS})
        return shapes

    @classmethod
    def kernel_path_refusal(cls, config: ModelConfig) -> str | None:
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # transformers rounds the scale to the model dtype before multiplying.
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                         meta: KernelAttentionMetadata,
                         on_layer: Callable[[int], None] | None) -> torch.Tensor:
        if self.rope_tables is None:
            raise RuntimeError("the kernel path needs prepare_kernels() first")
        x = self.embed(input_ids)
        for n, layer in enumerate(self.model.layers):
            kv_k, kv_v = kv.layer(n)
            out = layer.self_attn.forward_kernels(layer.input_layernorm(x), positions,
                                                  self.rope_tables, kv_k, kv_v, meta,
                                                  self.gemv_workspace)
            if on_layer is not None:
                on_layer(n)
            x = x + layer.post_attention_layernorm(out)
            out = layer.mlp.forward_kernels(layer.pre_feedforward_layernorm(x),
                                            self.gemv_workspace)
            x = x + layer.post_feedforward_layernorm(out)
        return self.model.norm(x)
