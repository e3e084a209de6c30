"""An engine on the default model, for the tests that run one in this process."""

from __future__ import annotations

from engine.llm_engine import EngineConfig, LLMEngine

# Prompts of several kinds (prose, an instruction, code, a list), for batches.
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three colours: red,",
    "In 1969, the first person to walk on the Moon was",
)


def make_engine(loaded, **overrides) -> LLMEngine:
    """A fresh engine over the `loaded` fixture's model (conftest.py); `overrides` are
    EngineConfig fields (256 KV blocks unless given)."""
    model, tokenizer = loaded
    config = EngineConfig(**{"num_kv_blocks": 256, **overrides})
    return LLMEngine.for_model(model.model, model.config, tokenizer, config)
