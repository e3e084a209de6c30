"""The soak's answer check: a completed answer is whole when the tokens it received, the
tokens its usage counts and max_tokens agree; one that did not complete is a failure; a
stream (read by the load generator's parser) counts only with its [DONE] and no error
event."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.answer_check import Answer, body_answer, judge, summarize_checks
from bench.sse_client import ErrorKind, StreamFault, StreamState, read_stream


def event(payload: object) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) \
        + b"\n\n"


def chunk(*tokens: str) -> dict:
    return {"choices": [{"index": 0, "text": "".join(tokens),
                         "logprobs": {"tokens": list(tokens)}}]}


class Body:
    """An SSE body as aiohttp's response.content yields it: line by line."""

    def __init__(self, *events: bytes) -> None:
        self.content = self._lines(b"".join(events))

    @staticmethod
    async def _lines(data: bytes):
        for line in data.splitlines(keepends=True):
            yield line


def read(*events: bytes) -> StreamState:
    state = StreamState("completions", 0.0)
    asyncio.run(read_stream(Body(*events), state))  # type: ignore[arg-type]
    return state


def test_a_stream_counts_the_logprob_entries_of_its_chunks_and_takes_its_usage() -> None:
    state = read(event(chunk(" The")), event(chunk(" sea", " is")),
                 event({"choices": [], "usage": {"completion_tokens": 3}}), event(b"[DONE]"))
    assert (state.num_logprob_entries, state.usage_completion_tokens) == (3, 3)


def test_chat_logprobs_count_their_content_entries() -> None:
    state = StreamState("chat", 0.0)
    state.on_data(json.dumps({"choices": [{"delta": {"content": " a b"}, "logprobs": {
        "content": [{"token": " a"}, {"token": " b"}]}}]}), 1.0)
    assert state.num_logprob_entries == 2


def test_a_stream_with_an_error_event_or_without_done_did_not_complete() -> None:
    error = event({"error": {"message": "worker lost", "type": "server_error"}})
    with pytest.raises(StreamFault) as fault:
        read(event(chunk(" The")), error, event(b"[DONE]"))
    assert fault.value.kind == ErrorKind.STREAM_ERROR and "worker lost" in fault.value.detail
    with pytest.raises(StreamFault) as fault:
        read(event(chunk(" The")))
    assert fault.value.kind == ErrorKind.MISSING_DONE


def test_a_body_counts_its_logprob_entries() -> None:
    body = {**chunk(" a", " b"), "usage": {"completion_tokens": 2}}
    assert body_answer(body) == Answer(2, 2)


def test_answers_are_whole_broken_or_failed_and_counted() -> None:
    records = [judge(0, False, Answer(2, 2), "", 2),
               judge(1, True, Answer(1, 2), "", 2),  # a token lost at a splice
               judge(1, True, Answer(3, 2), "", 2),  # a token sent twice
               judge(2, False, Answer(1, 1), "", 2),  # fewer than max_tokens
               judge(0, False, None, "HTTP 503", 2)]
    assert [r.outcome for r in records] == ["whole", "broken", "broken", "broken", "failed"]
    summary = summarize_checks(records)
    assert (summary.checked, summary.whole, summary.broken, summary.failed) == (5, 1, 3, 1)
    assert summary.broken_records[0].detail.startswith("1 tokens received, usage 2")
    assert records[4].detail == "HTTP 503"
