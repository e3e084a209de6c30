"""Model architecture description shared by the loader, the model and the KV pool.

`ModelConfig` is the one place a model's shape lives. The loader fills it from an HF
`config.json` or from GGUF metadata; everything else reads it and never re-derives shapes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Activation(enum.Enum):
    """The gate activation of the gated MLP, by its Hugging Face `hidden_act` name."""

    SILU = "silu"
    GELU_TANH = "gelu_pytorch_tanh"  # GELU with the tanh approximation (Gemma)


def sliding_fields(window: int | None, sliding_layers: tuple[int, ...],
                   max_positions: int) -> dict[str, int | tuple[int, ...] | None]:
    """`ModelConfig`'s sliding_window and sliding_layers for a checkpoint's window and the
    layers it names; pure. A window no prompt can exceed (>= the context) is dropped: those
    layers attend to their whole context, and the kernels run without the window option."""
    if window is None or window >= max_positions or not sliding_layers:
        return {"sliding_window": None, "sliding_layers": ()}
    return {"sliding_window": window, "sliding_layers": sliding_layers}


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama-3.1 style frequency scaling of RoPE (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """The mixture-of-experts feed-forward of a model (engine/models/moe.py): `num_experts`
    gated MLPs of width `intermediate_size` each, of which a router picks `top_k` per token;
    `renormalize`: the picked experts' softmax weights are rescaled to sum to one (Mixtral;
    Qwen3-MoE's `norm_topk_prob`). `layers`: the decoder layers whose feed-forward is this
    block; the others keep the dense MLP of `ModelConfig.intermediate_size`.
    `shared_intermediate_size`: the width of a shared expert every token goes through,
    scaled by a sigmoid gate of its own (Qwen2-MoE); 0: none."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    layers: tuple[int, ...]
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0:
            raise ValueError(f"model config: moe intermediate_size must be positive, "
                             f"got {self.intermediate_size}")
        if self.shared_intermediate_size < 0:
            raise ValueError(f"model config: shared expert size must not be negative, "
                             f"got {self.shared_intermediate_size}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"model config: experts per token ({self.top_k}) must be "
                             f"between 1 and the number of experts ({self.num_experts})")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer. `architecture` (the Hugging Face
    class name) picks the family module in engine/models/families.py, which owns the
    layer structure; the fields below the shape are the numerics some families change.

    Invariants: every sliding-window layer index is a layer of the model, and a window is
    set exactly when some layer slides; soft-caps, window and query scalar are positive."""

    architecture: str  # e.g. "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    rope_scaling: Llama3RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: Activation = Activation.SILU
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (Gemma); None: head_dim.
    query_pre_attn_scalar: float | None = None
    # cap * tanh(x / cap) on attention scores (before the mask) and on the final logits.
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # A query at position p of a sliding layer sees keys (p - sliding_window, p] only.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # The mixture-of-experts feed-forward; None: every layer has the dense MLP.
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                     "sliding_window"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"model config: {name} must be positive or None, got {value}")
        if (self.sliding_window is None) != (not self.sliding_layers):
            raise ValueError("model config: sliding_window and sliding_layers go together "
                             f"(got {self.sliding_window} and {self.sliding_layers})")
        if any(not 0 <= n < self.num_layers for n in self.sliding_layers):
            raise ValueError(f"model config: sliding_layers {self.sliding_layers} name layers "
                             f"outside 0..{self.num_layers - 1}")
        if self.moe is not None and any(not 0 <= n < self.num_layers for n in self.moe.layers):
            raise ValueError(f"model config: mixture-of-experts layers {self.moe.layers} name "
                             f"layers outside 0..{self.num_layers - 1}")

    def is_moe_layer(self, layer: int) -> bool:
        """True where `layer`'s feed-forward is the mixture-of-experts block."""
        return self.moe is not None and layer in self.moe.layers

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer`; None where it attends to its whole context."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def attention_scale(self) -> float:
        """The factor on q·k before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
