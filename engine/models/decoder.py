"""The decoder-only causal LM every family builds on: embeddings, a stack of layers, the
final norm and the vocabulary head, run over a paged KV cache.

A family module (engine/models/llama.py, qwen3.py, gemma2.py) subclasses
`DecoderForCausalLM` and says what differs: its decoder layer (`make_layer`), the tensors
that layer owns (`layer_shapes`), and, where it has them, an embedding scale, a kernel
path, and the reason the kernel path cannot run a config (`kernel_path_refusal`).

Tokens of every sequence in a step are flattened into one dimension T; `positions[t]` is
the position of token t inside its own sequence and `AttentionMetadata` says which rows
belong to which sequence. The torch path follows transformers' numerics exactly (RMSNorm
in fp32; RoPE angles in fp32, cos/sin then rounded to the model dtype and the rotation
done in it); it is the reference and the CPU path. The kernel path (chosen when
`AttentionMetadata.kernels` is set, i.e. on CUDA) runs the Triton ops of engine/kernels
and needs `prepare_kernels()` first. Every op of the kernel path is free of host syncs,
so a decode step can be captured in a graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
from engine.attention_reference import soft_cap
from engine.config import ModelConfig
from engine.kernels.gemv import GemvWorkspace, linear
from engine.kv_storage import KVStorage
from engine.models.layers import Attention, GatedMLP, RMSNorm, rope_inv_freq
from engine.models.moe import BlockExchange, MoEBlock


class DecoderLayer(nn.Module):
    """One block: `self_attn` and `mlp` (engine/models/layers.py) and the family's norms.

    Tensor parallel: o_proj and down_proj output partial sums; `all_reduce` adds them up
    across ranks (engine/tensor_parallel_group.py). None: the whole layer is here."""

    self_attn: Attention
    mlp: GatedMLP | MoEBlock

    def __init__(self) -> None:
        super().__init__()
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_k: torch.Tensor, kv_v: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, layers: list[DecoderLayer], norm: RMSNorm) -> None:
        super().__init__()
        # A weight given up front: Embedding's own random init runs through torch's Python
        # reference kernels on the meta device, whose first use imports torch._dynamo (about
        # a second of every worker's start) only for the values to be overwritten.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size,
                                                             config.hidden_size))
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class DecoderForCausalLM(nn.Module):
    """The decoder. Parameters are uninitialised until a loader copies weights in."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        # Built on the meta device and then materialised empty: random initialisation of
        # every weight would cost seconds only to be overwritten by the checkpoint.
        with torch.device("meta"):
            self.model = DecoderModel(
                config, [self.make_layer(config, n) for n in range(config.num_layers)],
                self.make_norm(config, config.hidden_size))
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
        # The ranks of its group (tensor parallel: config then describes this rank's shard;
        # expert parallel: this is rank 0); see enable_tensor_parallel, enable_expert_parallel.
        self.tp_size = 1

    # --- what a family says ---------------------------------------------------------------

    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        """Decoder layer n of this family."""
        raise NotImplementedError

    @classmethod
    def make_norm(cls, config: ModelConfig, size: int) -> RMSNorm:
        """The family's RMSNorm (the final norm and the layers' norms)."""
        return RMSNorm(size, config.rms_norm_eps)

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every parameter of one decoder layer and its shape, names after `prefix`."""
        h, i = config.hidden_size, config.intermediate_size
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            prefix + "self_attn.q_proj.weight": (q_out, h),
            prefix + "self_attn.k_proj.weight": (kv_out, h),
            prefix + "self_attn.v_proj.weight": (kv_out, h),
            prefix + "self_attn.o_proj.weight": (h, q_out),
            prefix + "mlp.gate_proj.weight": (i, h),
            prefix + "mlp.up_proj.weight": (i, h),
            prefix + "mlp.down_proj.weight": (h, i),
        }
        if config.attention_bias:
            shapes.update({prefix + "self_attn.q_proj.bias": (q_out,),
                           prefix + "self_attn.k_proj.bias": (kv_out,),
                           prefix + "self_attn.v_proj.bias": (kv_out,)})
        return shapes

    @classmethod
    def kernel_path_refusal(cls, config: ModelConfig) -> str | None:
        """Why the Triton kernel path cannot run this config; None when it can."""
        return f"{config.architecture} has no kernel path"

    @classmethod
    def parameter_name(cls, checkpoint_name: str) -> str:
        """The model's parameter that a checkpoint tensor (named as in `expected_shapes`)
        fills; the same name unless the family stores it under another."""
        return checkpoint_name

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _forward_kernels(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVStorage,
                         meta: KernelAttentionMetadata,
                         on_layer: Callable[[int], None] | None) -> torch.Tensor:
        raise RuntimeError(f"the kernel path cannot run this model: "
                           f"{self.kernel_path_refusal(self.config)}")

    # --- shared by every family -----------------------------------------------------------

    @classmethod
    def expected_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every parameter the model owns and its shape, by checkpoint name."""
        h = config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (config.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        for n in range(config.num_layers):
            shapes.update(cls.layer_shapes(config, f"model.layers.{n}."))
        return shapes

    def enable_tensor_parallel(self, tp_size: int,
                               all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Mark this model as one of `tp_size` shards whose layers sum their partial
        outputs with `all_reduce`. Only the torch path supports it."""
        self.tp_size = tp_size
        for layer in self.model.layers:
            layer.all_reduce = all_reduce

    def enable_expert_parallel(self, num_ranks: int, exchange: BlockExchange) -> None:
        """Mark this model as rank 0 of `num_ranks` expert-parallel ranks: its MoE blocks
        share their tokens with the other ranks through `exchange`
        (engine/expert_exchange.py). Only the torch path supports it."""
        self.tp_size = num_ranks
        for module in self.modules():
            if isinstance(module, MoEBlock):
                module.exchange = exchange

    def prepare_kernels(self) -> None:
        """Make the model ready for the kernel path; idempotent. Called once at start-up,
        before any graph capture (it allocates and copies, which a capture may not do).
        Raises ValueError where the kernel path cannot run this model."""
        from engine.kernels.rope import rope_cos_sin

        refusal = self.kernel_path_refusal(self.config)
        if refusal is not None:
            raise ValueError(f"the kernel path cannot run this model: {refusal}")
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
            if isinstance(mlp, MoEBlock):
                mlp.fuse_experts()
                continue
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
        x = self.embed(input_ids)
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

    def compute_logits(self, hidden: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden states [N, hidden]; written into `out`
        (float32 [N, vocab]) when given, which is returned. Soft-capped where the config
        says so (in the model dtype, as transformers does)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight, workspace=self.gemv_workspace)
        if self.config.final_logit_softcap is not None:
            logits = soft_cap(logits, self.config.final_logit_softcap)
        if out is None:
            return logits.float()
        return out.copy_(logits)
