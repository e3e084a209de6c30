"""Which model class runs which architecture: the one list of supported families.

    architecture (HF class name)                         module
    LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM  engine/models/llama.py
    Qwen3ForCausalLM                                     engine/models/qwen3.py
    Gemma2ForCausalLM                                    engine/models/gemma2.py
    Qwen3MoeForCausalLM                                  engine/models/qwen3_moe.py
    Qwen2MoeForCausalLM                                  engine/models/qwen2_moe.py
    MixtralForCausalLM                                   engine/models/mixtral.py

Readers (engine/hf_reader.py, engine/gguf_reader.py) refuse anything else with
`unsupported_architecture_message`, so the error and this table cannot drift apart.
"""

from __future__ import annotations

from engine.models.decoder import DecoderForCausalLM
from engine.models.gemma2 import Gemma2ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mixtral import MixtralForCausalLM
from engine.models.qwen2_moe import Qwen2MoeForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

_MODEL_CLASSES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODEL_CLASSES)


def unsupported_architecture_message(architecture: object) -> str:
    return (f"unsupported architecture {architecture!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class that runs `architecture`; ValueError naming the supported list otherwise."""
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(unsupported_architecture_message(architecture)) from None
