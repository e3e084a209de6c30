"""Stepping an in-process engine to the end, as a client of each request would see it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.contract.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine, RequestOutput


@dataclass
class Seen:
    """What a client of one request would have received, in order."""

    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reasons: list = field(default_factory=list)  # one per output; the last is set

    def add(self, out: RequestOutput) -> None:
        assert not any(self.finish_reasons), f"{out.request_id}: an output after the finish"
        self.tokens += out.new_token_ids
        self.texts.append(out.new_text)
        self.logprobs += out.logprobs
        self.finish_reasons.append(out.finish_reason)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
        mode: str, between_steps: Callable[[LLMEngine, int], None] | None = None
        ) -> tuple[dict[str, Seen], int]:
    """Step until done in `mode` (plain, pipelined or overlapped); returns what each
    request's client saw and how many outputs came early (through `on_outputs`)."""
    assert mode in ("plain", "pipelined", "overlapped"), mode
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen = {rid: Seen() for rid in requests}
    num_early = 0
    step = 0
    while engine.has_unfinished():
        early: list[RequestOutput] = []
        outputs = engine.step(on_outputs=early.extend if mode == "pipelined" else None,
                              overlap=mode == "overlapped")
        num_early += len(early)
        for out in early + outputs:
            seen[out.request_id].add(out)
        engine.check_invariants()
        step += 1
        if between_steps is not None:
            between_steps(engine, step)
    assert engine.kv_cache.num_used_blocks == 0
    return seen, num_early
