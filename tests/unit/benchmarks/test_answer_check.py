"""The soak's answer check: a completed answer is whole when the tokens it received, the
tokens its usage counts and max_tokens agree; one that did not complete is a failure; a
stream counts only with its [DONE] and no error event."""

from __future__ import annotations

import json

from benchmarks.answer_check import Answer, body_answer, judge, sse_answer, summarize_checks


def data(event: object) -> str:
    return "data: " + (event if isinstance(event, str) else json.dumps(event))


def chunk(*tokens: str) -> dict:
    return {"choices": [{"index": 0, "text": "".join(tokens),
                         "logprobs": {"tokens": list(tokens)}}]}


def test_a_stream_counts_the_logprob_entries_of_its_chunks_and_takes_its_usage() -> None:
    lines = [data(chunk(" The")), "", data(chunk(" sea", " is")),
             data({"choices": [], "usage": {"completion_tokens": 3}}), data("[DONE]")]
    assert sse_answer(lines) == (Answer(" The sea is", 3, 3), "")


def test_a_stream_with_an_error_event_or_without_done_did_not_complete() -> None:
    error = data({"error": {"message": "worker lost", "type": "server_error"}})
    assert sse_answer([data(chunk(" The")), error, data("[DONE]")]) == \
        (None, "error event: worker lost")
    assert sse_answer([data(chunk(" The"))]) == (None, "stream ended without [DONE]")


def test_a_body_counts_its_logprob_entries() -> None:
    body = {**chunk(" a", " b"), "usage": {"completion_tokens": 2}}
    assert body_answer(body) == Answer(" a b", 2, 2)


def test_answers_are_whole_broken_or_failed_and_counted() -> None:
    records = [judge(0, False, Answer(" a b", 2, 2), "", 2),
               judge(1, True, Answer(" b", 1, 2), "", 2),  # a token lost at a splice
               judge(1, True, Answer(" a b b", 3, 2), "", 2),  # a token sent twice
               judge(2, False, Answer(" a", 1, 1), "", 2),  # fewer than max_tokens
               judge(0, False, None, "HTTP 503", 2)]
    assert [r.outcome for r in records] == ["whole", "broken", "broken", "broken", "failed"]
    summary = summarize_checks(records)
    assert (summary.checked, summary.whole, summary.broken, summary.failed) == (5, 1, 3, 1)
    assert summary.broken_records[0].detail.startswith("1 tokens received, usage 2")
    assert records[4].detail == "HTTP 503"
