"""Qwen2-MoE decoder: the Qwen2 block (a bias on the q/k/v projections) whose feed-forward
is, on the layers the config makes sparse, a mixture of experts with a shared expert
(engine/models/moe.py): every token also goes through one more gated MLP, of
`shared_expert_intermediate_size`, scaled by a sigmoid of its own one-output gate.

    layer n is sparse  <=>  n not in mlp_only_layers and (n + 1) % decoder_sparse_step == 0

Routing as Qwen3-MoE (engine/models/qwen3_moe.py): softmax over `num_experts`, the top
`num_experts_per_tok`, renormalised where `norm_topk_prob`, the weights rounded to the model
dtype before they scale the expert outputs. CUDA: as Qwen3-MoE, no graph capture.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.decoder import DecoderLayer
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import sparse_mlp, with_moe_shapes


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        return LlamaDecoderLayer(config, config.window_of(n), mlp=sparse_mlp(config, n))

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        return with_moe_shapes(config, prefix, super().layer_shapes(config, prefix))
