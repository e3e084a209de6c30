"""Stepping an in-process engine to the end, as a client of each request would see it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from default_engine import PROMPTS, make_engine

from engine.llm_engine import LLMEngine, RequestOutput
from protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


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


@dataclass
class StopCases:
    """Requests that end every way a request can, and sample every way it can."""

    requests: dict[str, tuple[list[int], SamplingParams]]
    stop: str  # the stop string of "stop-string": a word the greedy output contains
    stop_token: int  # the stop token of "stop-token": its greedy output's 7th token

    @classmethod
    def build(cls, engine: LLMEngine) -> StopCases:
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
        word = engine.tokenizer.encode(PROMPTS[0])
        greedy = engine.generate([word], GREEDY)[0]
        stop, stop_token = greedy.text.strip().split()[1], greedy.token_ids[6]
        requests = {
            "eos": (chat, SamplingParams(max_tokens=64, temperature=0.0)),  # end of turn
            "stop-string": (word, SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))),
            "stop-token": (word, SamplingParams(max_tokens=24, temperature=0.0,
                                                stop_token_ids=(stop_token,))),
            "min-tokens": (chat, SamplingParams(max_tokens=40, temperature=0.0, min_tokens=30)),
            "seeded": (word, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7,
                                            logprobs=2, presence_penalty=0.4)),
            "penalties": (word, SamplingParams(max_tokens=16, temperature=0.0, logprobs=0,
                                               repetition_penalty=1.3, frequency_penalty=0.5)),
            "one-token": (word, SamplingParams(max_tokens=1, temperature=0.0)),
        }
        return cls(requests, stop, stop_token)

    def check(self, seen: dict[str, Seen]) -> None:
        """Each request ended the way it was built to."""
        assert seen["eos"].finish_reasons[-1] == "stop" and len(seen["eos"].tokens) < 64
        assert seen["stop-string"].finish_reasons[-1] == "stop"
        assert self.stop not in "".join(seen["stop-string"].texts)
        assert seen["stop-token"].tokens[-1] == self.stop_token
        assert seen["stop-token"].finish_reasons[-1] == "stop"
        assert len(seen["min-tokens"].tokens) >= 30
        assert all(lp is not None and len(lp.top_token_ids) == 2
                   for lp in seen["seeded"].logprobs)
        assert all(lp is not None and lp.top_token_ids == () for lp in seen["penalties"].logprobs)
        assert len(seen["one-token"].tokens) == 1


def check_an_abort_after_step_five(loaded, mode: str,
                                   before_abort: Callable[[LLMEngine], None]) -> None:
    """Two greedy requests on one prompt; after step 5 (once `before_abort(engine)` has
    checked what that mode holds then) "gone" is aborted. Its client got the outputs of
    4 steps and no finish; "keep" got exactly what it gets alone; nothing is left behind."""
    engine = make_engine(loaded)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    requests = {"keep": (prompt, GREEDY), "gone": (prompt, GREEDY)}
    aborted_at: list[int] = []

    def abort_after_five(engine: LLMEngine, step: int) -> None:
        if step == 5:
            before_abort(engine)
            assert engine.abort_request("gone")
            aborted_at.append(step)

    seen, _ = run(engine, requests, mode, between_steps=abort_after_five)
    assert aborted_at == [5]
    assert len(seen["gone"].tokens) == 4 and not any(seen["gone"].finish_reasons)
    plain, _ = run(make_engine(loaded), {"keep": (prompt, GREEDY)}, "plain")
    assert seen["keep"] == plain["keep"]
    assert engine.kv_cache.num_used_blocks == 0
    assert not engine.has_unfinished()
