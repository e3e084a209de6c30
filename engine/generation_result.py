"""GenerationResult: a whole finished request, as `LLMEngine.generate` returns it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.output_processor import RequestOutput
from engine.sampler import TokenLogprobs
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams


class _Engine(Protocol):  # what of engine/llm_engine.py's LLMEngine this module uses
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None  # None until it finishes
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


def run_to_completion(engine: _Engine, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams],
                      ids: Sequence[str]) -> list[GenerationResult]:
    """Add the prompts under `ids` and step `engine` until each has finished; the results
    in input order (`LLMEngine.generate`)."""
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    results = {rid: GenerationResult(rid, [], "") for rid in ids}
    for rid, prompt, p in zip(ids, prompts, params_list):
        engine.add_request(rid, prompt, p)
    while any(r.finish_reason is None for r in results.values()):
        for out in engine.step():
            result = results.get(out.request_id)
            if result is None:
                continue
            result.token_ids.extend(out.new_token_ids)
            result.text += out.new_text
            result.logprobs.extend(out.logprobs)
            if out.finish_reason is not None:
                result.finish_reason = out.finish_reason
    return [results[rid] for rid in ids]
