"""Answers under faults: every token a request is billed for reaches its client, once.

The soak (benchmarks/reliability.py) counts requests that fail; a request that completes
with a token lost or repeated at a retry or a migration would pass it. This check asks a
few fixed prompts over and over while the faults run, streamed and not in turn, each with
EOS ignored, a fixed max_tokens and `logprobs` (one entry per token the client received,
made where the token's text is made). A completed answer is whole when

    logprob entries received == usage.completion_tokens == max_tokens

A delta lost at a splice drops its text and its logprob entry while the worker still
counts the token; a token sent twice adds an entry. Comparing the text with an undisturbed
run's instead would not do: greedy answers depend on how requests were batched (a near-tie
flips with the summation order of a different batch shape), faults or not.

    run_checks(url, ..., stop)  until `stop` is set: ask, count, record (`CheckRecord`)
    summarize_checks(records)   counts: checked, whole, broken, failed

An answer that does not complete (an error status or event, a timeout) is `failed`, not
`broken`: the soak's own failure count judges those.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from bench.sse_client import StreamFault, StreamState, read_stream

PROMPTS = (
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "List three uses of a paperclip:",
    "Explain why the sky is blue in one paragraph.",
    "def fibonacci(n):",
    "The three primary colours are",
)


class CheckRecord(msgspec.Struct):
    prompt_index: int
    streamed: bool
    outcome: str  # "whole" | "broken" | "failed"
    detail: str = ""  # the failure, or the counts that disagreed


class CheckSummary(msgspec.Struct):
    checked: int
    whole: int
    broken: int
    failed: int
    broken_records: list[CheckRecord]


class Answer(msgspec.Struct):
    """What a completed answer carried: its logprob entries and its usage."""

    num_logprobs: int
    completion_tokens: int | None


def summarize_checks(records: Sequence[CheckRecord]) -> CheckSummary:
    """Counts by outcome, and the broken answers themselves; pure."""
    broken = [r for r in records if r.outcome == "broken"]
    return CheckSummary(checked=len(records), whole=sum(r.outcome == "whole" for r in records),
                        broken=len(broken), failed=sum(r.outcome == "failed" for r in records),
                        broken_records=broken)


def judge(index: int, streamed: bool, answer: Answer | None, error: str,
          max_tokens: int) -> CheckRecord:
    """The record of one answer; pure."""
    if answer is None:
        return CheckRecord(index, streamed, "failed", error)
    if not answer.num_logprobs == answer.completion_tokens == max_tokens:
        return CheckRecord(index, streamed, "broken",
                           f"{answer.num_logprobs} tokens received, usage "
                           f"{answer.completion_tokens}, max_tokens {max_tokens}")
    return CheckRecord(index, streamed, "whole")


def body_answer(body: dict[str, Any]) -> Answer:
    """The answer of a non-streamed completion's body; pure."""
    logprobs = body["choices"][0].get("logprobs") or {}
    return Answer(len(logprobs.get("tokens") or ()),
                  (body.get("usage") or {}).get("completion_tokens"))


async def ask(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
              max_tokens: int, streamed: bool) -> tuple[Answer | None, str]:
    """(the answer, "") of one completion with logprobs, or (None, why it did not
    complete)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, "logprobs": 1,
                            "stream": streamed}
    if streamed:
        body["stream_options"] = {"include_usage": True}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return None, f"HTTP {response.status}: {(await response.read())[:200]!r}"
            if streamed:  # the load generator's parser: events, error events, [DONE]
                state = StreamState("completions", 0.0)
                await read_stream(response, state)
                return Answer(state.num_logprob_entries, state.usage_completion_tokens), ""
            return body_answer(json.loads(await response.read())), ""
    except StreamFault as fault:
        return None, f"{fault.kind}: {fault.detail}"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError,
            IndexError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


async def run_checks(url: str, model: str, max_tokens: int, timeout_s: float,
                     stop: asyncio.Event, records: list[CheckRecord],
                     prompts: Sequence[str] = PROMPTS) -> None:
    """Ask the prompts in turn (streamed every other time) until `stop` is set, appending
    one record per answer to `records`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        turn = 0
        while not stop.is_set():
            index, streamed = turn % len(prompts), turn % 2 == 1
            turn += 1
            answer, error = await ask(session, url, model, prompts[index], max_tokens,
                                      streamed)
            records.append(judge(index, streamed, answer, error, max_tokens))
