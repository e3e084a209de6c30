"""Several choices per request (a batch of prompts, n > 1) through the HTTP layer, with a
backend that echoes each choice's prompt and seed, so order and sampling are visible."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import pytest
from gateway_harness import MODEL, Harness

from gateway.api.backend import BackendUnavailable, GenerationRequest, TokenDelta
from gateway.api.multi_choice import choice_sampling
from gateway.api.sse import SseDecoder
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


@dataclass
class EchoBackend:
    """Replies "<prompt text>/<seed>" in two deltas; choice "<x>-1" of a request is slow."""

    requests: list[GenerationRequest] = field(default_factory=list)
    fail: bool = False
    num_closed: int = 0

    def context_limit(self) -> int | None:
        return None

    async def generate_batches(self, request: GenerationRequest
                               ) -> AsyncGenerator[list[TokenDelta], None]:
        self.requests.append(request)
        try:
            if self.fail:
                raise BackendUnavailable("no worker", retry_after_s=1)
            if request.request_id.endswith("-1"):
                await asyncio.sleep(0.05)  # finishes after later choices: order is by index
            text = bytes(request.prompt_token_ids).decode()
            yield [TokenDelta(text=text, num_tokens=2)]
            yield [TokenDelta(text=f"/{request.sampling.seed}", num_tokens=1,
                              finish_reason=FinishReason.STOP)]
        finally:
            self.num_closed += 1


@pytest.fixture
def harness():
    h = Harness(EchoBackend())  # type: ignore[arg-type]
    yield h
    h.close()


def post(h: Harness, path: str, **fields):
    body = {"model": MODEL, "max_tokens": 5, **fields}
    return h.call("POST", path, data=json.dumps(body))


def test_batched_prompts_answer_in_order_with_usage_summed(harness):
    status, _, raw = post(harness, "/v1/completions", prompt=["ab", "cde", "f"])
    assert status == 200, raw
    answer = json.loads(raw)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == ["ab/None", "cde/None", "f/None"]
    assert all(c["finish_reason"] == "stop" for c in answer["choices"])
    assert answer["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15}
    ids = sorted(r.request_id.rsplit("-", 1)[1] for r in harness.backend.requests)
    assert ids == ["0", "1", "2"]
    assert harness.controller.num_running == 0


def test_token_id_prompts_and_n_choices_order_prompt_major(harness):
    status, _, raw = post(harness, "/v1/completions", prompt=[[120], [121]], n=2, seed=7)
    assert status == 200, raw
    texts = [c["text"] for c in json.loads(raw)["choices"]]
    assert texts == ["x/7", "x/8", "y/7", "y/8"]  # each prompt's samples, seeds apart
    assert json.loads(raw)["usage"]["prompt_tokens"] == 2  # each prompt counted once


def test_chat_n_streamed_names_each_choice(harness):
    status, _, raw = post(harness, "/v1/chat/completions", n=3, stream=True,
                          stream_options={"include_usage": True},
                          messages=[{"role": "user", "content": "q"}])
    assert status == 200, raw
    events = SseDecoder().feed(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    roles, finishes = set(), {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        i = choice["index"]
        if choice["delta"].get("role"):
            roles.add(i)
        texts[i] = texts.get(i, "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[i] = choice["finish_reason"]
    assert roles == {0, 1, 2} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert len(set(texts.values())) == 1 and texts[0].endswith("/None")
    assert chunks[-1]["usage"]["completion_tokens"] == 9 and chunks[-1]["choices"] == []


def test_streamed_batch_of_completions(harness):
    status, _, raw = post(harness, "/v1/completions", prompt=["a", "b"], stream=True)
    events = SseDecoder().feed(raw)
    texts: dict[int, str] = {}
    for e in events[:-1]:
        [choice] = json.loads(e)["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "a/None", 1: "b/None"}


def test_backend_unavailable_is_503_and_every_choice_is_closed(harness):
    harness.backend.fail = True
    status, _, raw = post(harness, "/v1/completions", prompt=["a", "b", "c"])
    assert status == 503, raw
    assert harness.backend.num_closed == 3
    assert harness.controller.num_running == 0


def test_seed_of_later_samples_moves_and_wraps():
    params = SamplingParams(seed=2**64 - 1)
    assert choice_sampling(params, 0).seed == 2**64 - 1
    assert choice_sampling(params, 2).seed == 1
    assert choice_sampling(SamplingParams(), 3).seed is None
