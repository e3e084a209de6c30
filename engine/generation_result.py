"""GenerationResult: a whole finished request, as `LLMEngine.generate` returns it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs
from protocol.finish_reason import FinishReason


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None  # None until it finishes
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
