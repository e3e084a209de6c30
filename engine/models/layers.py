"""Layers the decoder families share: RMSNorm, RoPE helpers, attention, the gated MLP.

Parameter names follow the Hugging Face checkpoints (`self_attn.q_proj.weight`,
`self_attn.q_norm.weight`, `mlp.gate_proj.weight`), so a family module composes these and
the loader copies tensors by name. Each layer has a torch path (the reference, on any
device) and, where the Triton kernels cover it, a kernel path (`forward_kernels`) that
needs `fuse_projections()` first, which fuses q/k/v and gate/up into one matmul each:

    qkv_weight      [q_out + 2 * kv_out, hidden]   q_proj/k_proj/v_proj.weight are views
    gate_up_weight  [2 * intermediate, hidden]     gate_proj/up_proj.weight are views

so checkpoint names and `state_dict()` are unchanged and no weight is stored twice.

What a family may choose, and where each choice runs:

    choice                         torch path   kernel path
    per-head q/k RMSNorm (Qwen3)   yes          the RMSNorm kernel, one row per head
    RMSNorm scaled by (1 + w)      yes          torch ops (no kernel of its own)
    GELU-tanh gate (Gemma)         yes          torch ops on the fused gate/up output
    attention logit soft-cap       yes          the attention kernels' HAS_SOFTCAP
    sliding-window attention       yes          the attention kernels' HAS_WINDOW
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_kernels import attend_cached_kernels
from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
from engine.attention_reference import paged_attention
from engine.config import Activation, Llama3RopeScaling, ModelConfig
from engine.kernels.gemv import GemvWorkspace, linear
from engine.kv_quant import CacheView


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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def fuse_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0. The caller then re-points the inputs' parameters at views
    of the result, which frees the inputs: fusing layer by layer needs one layer's worth of
    extra memory, never a second copy of the model."""
    with torch.no_grad():
        return torch.cat([t.detach() for t in tensors])


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, normalised in float32 whatever the weights' dtype.

    `unit_offset=False` (Llama, Qwen): weight * round(normed), as transformers' LlamaRMSNorm.
    `unit_offset=True` (Gemma): round(normed * (1 + weight)), all in float32, as
    transformers' GemmaRMSNorm; its checkpoints store the weight around 0."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention with RoPE over the paged KV cache.

    `window`: this layer's sliding window (None: the whole context). `qk_norm`: an RMSNorm
    of size head_dim on every query and key head before RoPE (Qwen3). Scale and soft-cap
    come from the config (`attention_scale`, `attn_logit_softcap`)."""

    def __init__(self, config: ModelConfig, window: int | None, qk_norm: bool) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if qk_norm else None
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcap
        self.window = window

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: CacheView, kv_v: CacheView, attn: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = paged_attention(q, k, v, kv_k, kv_v, attn, self.scale, softcap=self.softcap,
                              window=self.window)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def fuse_projections(self) -> None:
        """One [q|k|v] weight (and bias); the three projections become views of it."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = fuse_rows([p.weight for p in projections])
        self.qkv_bias = (fuse_rows([p.bias for p in projections])
                         if self.q_proj.bias is not None else None)
        sizes = [p.weight.shape[0] for p in projections]
        for proj, weight in zip(projections, self.qkv_weight.split(sizes)):
            proj.weight = nn.Parameter(weight, requires_grad=False)
        if self.qkv_bias is not None:
            for proj, bias in zip(projections, self.qkv_bias.split(sizes)):
                proj.bias = nn.Parameter(bias, requires_grad=False)

    def forward_kernels(self, x: torch.Tensor, positions: torch.Tensor,
                        rope_tables: tuple[torch.Tensor, torch.Tensor], kv_k: CacheView,
                        kv_v: CacheView, meta: KernelAttentionMetadata,
                        workspace: GemvWorkspace | None) -> torch.Tensor:
        from engine.kernels.rmsnorm import rms_norm_triton
        from engine.kernels.rope_kv_write import rope_write_kv_triton_

        t = x.shape[0]
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, workspace)
        # Strided views into the one projection output: the kernels take strides.
        q = qkv[:, :q_out].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_out:q_out + kv_out].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_out + kv_out:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # One row per head; the norms write fresh contiguous q and k.
            q = rms_norm_triton(q, self.q_norm.weight, self.q_norm.eps)
            k = rms_norm_triton(k, self.k_norm.weight, self.k_norm.eps)
        # One kernel rotates q and k and writes this step's K/V into the cache.
        rope_write_kv_triton_(q, k, v, positions, *rope_tables, kv_k, kv_v, meta.slot_mapping)
        out = attend_cached_kernels(q, kv_k, kv_v, meta, self.scale, self.softcap, self.window)
        return linear(out.view(t, q_out), self.o_proj.weight, self.o_proj.bias, workspace)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); the activation is the config's `hidden_act`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.activation = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.activation is Activation.GELU_TANH:
            gate = F.gelu(gate, approximate="tanh")
        else:
            gate = F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))

    def fuse_projections(self) -> None:
        """One [gate|up] weight; gate_proj and up_proj become views of it."""
        self.gate_up_weight = fuse_rows([self.gate_proj.weight, self.up_proj.weight])
        gate, up = self.gate_up_weight.chunk(2)
        self.gate_proj.weight = nn.Parameter(gate, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up, requires_grad=False)

    def forward_kernels(self, x: torch.Tensor, workspace: GemvWorkspace | None) -> torch.Tensor:
        hidden = gated_kernels(linear(x, self.gate_up_weight, workspace=workspace),
                               self.activation)
        return linear(hidden, self.down_proj.weight, workspace=workspace)


def gated_kernels(gate_up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The kernel path's act(gate) * up for a fused [gate | up] projection output [T, 2I]."""
    from engine.kernels.silu_mul import silu_mul_triton

    size = gate_up.shape[1] // 2
    gate, up = gate_up[:, :size], gate_up[:, size:]
    if activation is Activation.GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    return silu_mul_triton(gate, up)
