"""Mixtral decoder: the Mistral block whose every feed-forward is a mixture of experts
(engine/models/moe.py): a top-`num_experts_per_tok` softmax router over
`num_local_experts` SiLU gated MLPs, the picked weights renormalised to sum to one.

Checkpoints name the block `block_sparse_moe` and an expert's gate, down and up
projections `w1`, `w2`, `w3`; the model holds them as `mlp` and `gate_proj`, `down_proj`,
`up_proj`, the names every other family uses (`parameter_name` maps one to the other).
The routing weights scale the expert outputs in float32 and the sum is rounded after, as
transformers does. CUDA: as Qwen3-MoE (engine/models/qwen3_moe.py), no graph capture.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.models.decoder import DecoderLayer
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, MoEBlock, moe_shapes

# (checkpoint's, model's) name pieces.
_RENAMES = (("block_sparse_moe.", "mlp."),
            *((f".{mixtral}.", f".{ours}.")
              for ours, mixtral in zip(QWEN_EXPERT_NAMES, MIXTRAL_EXPERT_NAMES)))


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def make_layer(cls, config: ModelConfig, n: int) -> DecoderLayer:
        if config.moe is None:
            raise ValueError("a Mixtral config without its mixture-of-experts fields")
        mlp = MoEBlock(config.hidden_size, config.moe, config.hidden_act, round_weights=False)
        return LlamaDecoderLayer(config, config.window_of(n), mlp=mlp)

    @classmethod
    def layer_shapes(cls, config: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
        if config.moe is None:
            raise ValueError("a Mixtral config without its mixture-of-experts fields")
        shapes = super().layer_shapes(config, prefix)
        for name in [name for name in shapes if name.startswith(prefix + "mlp.")]:
            del shapes[name]
        shapes.update(moe_shapes(prefix + "block_sparse_moe.", config.hidden_size, config.moe,
                                 MIXTRAL_EXPERT_NAMES))
        return shapes

    @classmethod
    def parameter_name(cls, checkpoint_name: str) -> str:
        if ".block_sparse_moe." not in checkpoint_name:
            return checkpoint_name
        for checkpoint_piece, model_piece in _RENAMES:
            checkpoint_name = checkpoint_name.replace(checkpoint_piece, model_piece)
        return checkpoint_name
