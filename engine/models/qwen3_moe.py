"""Qwen3-MoE decoder: the Qwen3 block (per-head q/k RMSNorm) whose feed-forward is a
mixture of experts (engine/models/moe.py) on the layers the config makes sparse.

    layer n is sparse  <=>  n not in mlp_only_layers and (n + 1) % decoder_sparse_step == 0

A sparse layer's router softmaxes over `num_experts`, keeps the top `num_experts_per_tok`
and, where `norm_topk_prob` is set, renormalises their weights to sum to one; each expert
is a SiLU gated MLP of width `moe_intermediate_size`. Dense layers keep the gated MLP of
`intermediate_size`. The weights are rounded to the model dtype before they scale the
expert outputs, as transformers does.

On CUDA the kernel path runs attention, norms and dense MLPs with the Triton kernels and
the expert block with the fused grouped GEMMs (engine/kernels/fused_moe.py); its steps are
captured in CUDA graphs like a dense model's.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.decoder import DecoderLayer
from engine.models.llama import LlamaDecoderLayer
from engine.models.moe import sparse_mlp, with_moe_shapes
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        return LlamaDecoderLayer(config, config.window_of(n), qk_norm=True, mlp=sparse_mlp(config, n))

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        return with_moe_shapes(config, prefix, super().layer_shapes(config, prefix))
