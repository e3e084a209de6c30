"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Parameter names follow the Hugging Face checkpoints (`model.layers.3.self_attn.q_proj.weight`)
so loaders copy tensors by name and validate shapes against `expected_shapes()`.

Tokens of every sequence in a step are flattened into one dimension T; `positions[t]` is the
position of token t inside its own sequence and `AttentionMetadata` says which rows belong
to which sequence. The numerics follow the reference implementation (RMSNorm in float32,
rotate-half RoPE with cos/sin computed in float32) so float32 logits match it closely.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import Llama3RopeScaling, ModelConfig
from engine.kv_storage import KVStorage


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the model owns and its shape, by checkpoint name."""
    h, i = config.hidden_size, config.intermediate_size
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q_out,),
                           p + "self_attn.k_proj.bias": (kv_out,),
                           p + "self_attn.v_proj.bias": (kv_out,)})
    return shapes


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with Llama-3 scaling when given."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((old_len / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the reference does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_k, kv_v, attn, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_k, kv_v, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """The decoder. Parameters are uninitialised until a loader copies weights in."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        # Built on the meta device and then materialised empty: random initialisation of
        # every weight would cost seconds only to be overwritten by the checkpoint.
        with torch.device("meta"):
            self.model = LlamaModel(config)
            self.lm_head = (None if config.tie_word_embeddings
                            else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        self.to_empty(device=device)
        self.to(dtype)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta,
                                      config.rope_scaling).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                attn: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes K/V at attn.slot_mapping."""
        x = self.model.embed_tokens(input_ids)
        # cos/sin once per step in float32, shared by every layer; [T, 1, head_dim].
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for n, layer in enumerate(self.model.layers):
            kv_k, kv_v = kv.layer(n)
            x = layer(x, cos, sin, kv_k, kv_v, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
