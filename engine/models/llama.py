"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) over a paged KV cache.

Parameter names follow the Hugging Face checkpoints (`model.layers.3.self_attn.q_proj.weight`)
so loaders copy tensors by name and validate shapes against `expected_shapes()`.

Tokens of every sequence in a step are flattened into one dimension T; `positions[t]` is the
position of token t inside its own sequence and `AttentionMetadata` says which rows belong
to which sequence. The torch path follows transformers' numerics exactly (RMSNorm in fp32;
RoPE angles in fp32, cos/sin then rounded to the model dtype and the rotation done in it).
The kernel path rotates in fp32 from fp32 tables and rounds once: in bf16 it is at least as
accurate, and differs from the torch path by rounding only (about 1% of the logits' norm
for a small random model), enough to swap greedy picks between near-equal logits.

Two paths share the parameters. The torch path (the CPU path) is the reference. The kernel
path (chosen when `AttentionMetadata.kernels` is set, i.e. on CUDA) runs the Triton ops of
engine/kernels: fused residual-add + RMSNorm, RoPE in place from precomputed tables, fused
SiLU-and-multiply, RoPE fused with the KV-cache write, paged attention, and at batch 1..8
a matrix-vector kernel for the linear layers it was measured faster on (engine/kernels/gemv.py);
it needs `prepare_kernels()` first, which fuses q/k/v and gate/up into one matmul each:

    qkv_weight      [q_out + 2 * kv_out, hidden]   q_proj/k_proj/v_proj.weight are views
    gate_up_weight  [2 * intermediate, hidden]     gate_proj/up_proj.weight are views

so checkpoint names and `state_dict()` are unchanged and no weight is stored twice. Every
op of the kernel path is free of host syncs, so a decode step can be captured in a graph.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention_kernels import attend_cached_kernels
from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
from engine.attention_reference import paged_attention
from engine.config import Llama3RopeScaling, ModelConfig
from engine.kernels.gemv import GemvWorkspace, linear
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


def _fuse_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along dim 0. The caller then re-points the inputs' parameters at views
    of the result, which frees the inputs: fusing layer by layer needs one layer's worth of
    extra memory, never a second copy of the model."""
    with torch.no_grad():
        return torch.cat([t.detach() for t in tensors])


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

    def fuse_projections(self) -> None:
        """One [q|k|v] weight (and bias); the three projections become views of it."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = _fuse_rows([p.weight for p in projections])
        self.qkv_bias = (_fuse_rows([p.bias for p in projections])
                         if self.q_proj.bias is not None else None)
        sizes = [p.weight.shape[0] for p in projections]
        for proj, weight in zip(projections, self.qkv_weight.split(sizes)):
            proj.weight = nn.Parameter(weight, requires_grad=False)
        if self.qkv_bias is not None:
            for proj, bias in zip(projections, self.qkv_bias.split(sizes)):
                proj.bias = nn.Parameter(bias, requires_grad=False)

    def forward_kernels(self, x: torch.Tensor, positions: torch.Tensor,
                        rope_tables: tuple[torch.Tensor, torch.Tensor], kv_k: torch.Tensor,
                        kv_v: torch.Tensor, meta: KernelAttentionMetadata,
                        workspace: GemvWorkspace | None) -> torch.Tensor:
        from engine.kernels.rope_kv_write import rope_write_kv_triton_

        t = x.shape[0]
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias, workspace)
        # Strided views into the one projection output: the kernels take strides.
        q = qkv[:, :q_out].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_out:q_out + kv_out].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_out + kv_out:].view(t, self.num_kv_heads, self.head_dim)
        # One kernel rotates q and k and writes this step's K/V into the cache.
        rope_write_kv_triton_(q, k, v, positions, *rope_tables, kv_k, kv_v, meta.slot_mapping)
        out = attend_cached_kernels(q, kv_k, kv_v, meta, self.scale)
        return linear(out.view(t, q_out), self.o_proj.weight, self.o_proj.bias, workspace)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_projections(self) -> None:
        """One [gate|up] weight; gate_proj and up_proj become views of it."""
        self.gate_up_weight = _fuse_rows([self.gate_proj.weight, self.up_proj.weight])
        gate, up = self.gate_up_weight.chunk(2)
        self.gate_proj.weight = nn.Parameter(gate, requires_grad=False)
        self.up_proj.weight = nn.Parameter(up, requires_grad=False)

    def forward_kernels(self, x: torch.Tensor, workspace: GemvWorkspace | None) -> torch.Tensor:
        from engine.kernels.silu_mul import silu_mul_triton

        gate_up = linear(x, self.gate_up_weight, workspace=workspace)
        size = gate_up.shape[1] // 2
        return linear(silu_mul_triton(gate_up[:, :size], gate_up[:, size:]),
                      self.down_proj.weight, workspace=workspace)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        # Tensor parallel: o_proj and down_proj output partial sums; this adds them up
        # across ranks (engine/tensor_parallel_group.py). None: the whole layer is here.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), cos, sin, kv_k, kv_v, attn)
        x = x + (out if self.all_reduce is None else self.all_reduce(out))
        out = self.mlp(self.post_attention_layernorm(x))
        return x + (out if self.all_reduce is None else self.all_reduce(out))


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
        # The kernel path's state, built by prepare_kernels(): cos/sin tables
        # [max_position_embeddings, head_dim / 2] fp32, and the fused projections.
        self.rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # Scratch of the split-K linear layers (engine/kernels/gemv.py), on the kernel path.
        self.gemv_workspace: GemvWorkspace | None = None
        # Ranks holding a shard each (config then describes the shard); see enable_tensor_parallel.
        self.tp_size = 1

    def enable_tensor_parallel(self, tp_size: int,
                               all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Mark this model as one of `tp_size` shards whose layers sum their partial
        outputs with `all_reduce`. Only the torch path supports it."""
        self.tp_size = tp_size
        for layer in self.model.layers:
            layer.all_reduce = all_reduce

    def prepare_kernels(self) -> None:
        """Make the model ready for the kernel path; idempotent. Called once at start-up,
        before any graph capture (it allocates and copies, which a capture may not do)."""
        from engine.kernels.rope import rope_cos_sin

        if self.tp_size > 1:
            raise ValueError("the kernel path does not support tensor parallelism; "
                             "a sharded model runs the torch path")
        device = self.model.embed_tokens.weight.device
        if self.rope_tables is None or self.rope_tables[0].device != device:
            self.rope_tables = rope_cos_sin(
                self.config.head_dim, self.config.max_position_embeddings,
                self.config.rope_theta, self.config.rope_scaling, device)
        workspace = self.gemv_workspace
        if workspace is None or workspace.partials.device != device:
            self.gemv_workspace = GemvWorkspace.for_shapes(self.linear_shapes_of(self.config),
                                                           device)
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = getattr(attn, "qkv_weight", None)
            # Fused weights stay valid while the projections still alias them (a later
            # .to() or a reload would have replaced the views with new tensors).
            if fused is None or attn.q_proj.weight.data_ptr() != fused.data_ptr():
                attn.fuse_projections()
            fused = getattr(mlp, "gate_up_weight", None)
            if fused is None or mlp.gate_proj.weight.data_ptr() != fused.data_ptr():
                mlp.fuse_projections()

    @staticmethod
    def linear_shapes_of(c: ModelConfig) -> list[tuple[int, int]]:
        """[n, k] of each linear layer the kernel path runs: fused q/k/v, attention output,
        fused gate/up, down, the vocabulary head."""
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return [(q_out + 2 * kv_out, c.hidden_size), (c.hidden_size, q_out),
                (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size),
                (c.vocab_size, c.hidden_size)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                attn: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; writes K/V at attn.slot_mapping.
        `on_layer(n)`, when given, runs right after layer n's attention wrote its K/V."""
        if attn.kernels is not None:
            return self._forward_kernels(input_ids, positions, kv, attn.kernels, on_layer)
        x = self.model.embed_tokens(input_ids)
        # cos/sin once per step in float32, shared by every layer; [T, 1, head_dim].
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        for n, layer in enumerate(self.model.layers):
            kv_k, kv_v = kv.layer(n)
            x = layer(x, cos, sin, kv_k, kv_v, attn)
            if on_layer is not None:
                on_layer(n)
        return self.model.norm(x)

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                         meta: KernelAttentionMetadata,
                         on_layer: Callable[[int], None] | None) -> torch.Tensor:
        from engine.kernels.rmsnorm import add_rms_norm_triton_, rms_norm_triton

        if self.rope_tables is None:
            raise RuntimeError("the kernel path needs prepare_kernels() first")
        # The residual stream lives in `residual`; each add_rms_norm_ call adds a block's
        # output to it and leaves the next block's normalised input in its first argument.
        residual = self.model.embed_tokens(input_ids)
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

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden]; written into `out`
        (float32 [N, vocab]) when given, which is returned."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, workspace=self.gemv_workspace)
        if out is None:
            return logits.float()
        return out.copy_(logits)
