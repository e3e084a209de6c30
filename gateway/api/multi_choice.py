"""Requests with several choices: a list of prompts on /v1/completions, `n` > 1 on both
endpoints; and every chat answer whose tool calls are parsed (gateway/api/tool_answer.py),
one choice or more. Each choice is a generation of its own (its own id, its own workers;
the n choices of one prompt share the first one's route and prefill,
gateway/api/shared_prefill.py); their deltas are merged here into one answer.

    prompts p0..pk, n samples each ──▶ choice index = prompt index * n + sample index
                                        (OpenAI's order), generation id "<request id>-<index>"
    each choice's generate_batches ──▶ a task each ──▶ queue of (index, batch) ──▶
        JSON body: choices in index order, usage summed
        SSE: one event per delta, naming its choice `index`; then usage (if asked), [DONE]

Sampling: with a `seed`, choice j of a prompt draws with seed + j, so the n samples differ
and the answer repeats; without one, every choice draws from its worker's generator.

Usage: prompt tokens count each prompt once (however many samples it has, as OpenAI counts
them); completion tokens add up over every choice.

Lifecycle of the tasks: created by `merged_choices`, owned by it, cancelled and awaited when
it ends (all finished, an error, the client gone); a cancelled task closes its generation's
batches, which stops its work on the workers. Invariants: every choice's last delta carries
its finish reason; the answer has exactly one entry per choice.

A streamed multi-choice answer sends its headers with its first token (no keep-alives while
it waits, unlike the one-choice writer, gateway/api/stream_writer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from gateway.api.backend import (BackendUnavailable, CompletionBackend, GenerationRequest,
                                 TokenDelta, TokenLogprob)
from gateway.api.chunk_encoder import chat_logprobs, completion_logprobs
from gateway.api.drain import Drain
from gateway.api.errors import overloaded
from gateway.api.openai_api import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                    ChatCompletionResponse, ChatDelta, ChatResponseMessage,
                                    CompletionChoice, CompletionChunk, CompletionResponse,
                                    PromptTokensDetails, Usage)
from gateway.api.request_parsing import Endpoint, ValidatedRequest
from gateway.api.responses import SENT_RESPONSE, StreamTiming, shutting_down, write_bounded
from gateway.api.slo_accounting import RequestTiming
from gateway.api.sse import DONE_EVENT, SSE_HEADERS, encode_event
from gateway.api.tool_answer import ToolDeltas, answer_finish_reason, tool_message
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_SEED_SPACE = 2**64


def choice_sampling(sampling: SamplingParams, sample_index: int) -> SamplingParams:
    """Sample j's parameters: a seeded request's seed moves by j (wrapping in 64 bits)."""
    if sampling.seed is None or sample_index == 0:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + sample_index) % _SEED_SPACE)


@dataclass(slots=True)
class _Choice:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    num_chars: int = 0  # text streamed so far (completions' logprob offsets)
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None  # reported with the finish
    announced: bool = False  # chat: the role event went out


async def merged_choices(backend: CompletionBackend, generations: Sequence[GenerationRequest],
                         timing: RequestTiming
                         ) -> AsyncGenerator[tuple[int, list[TokenDelta]], None]:
    """(choice index, batch) as the choices' batches arrive; raises the first choice's
    BackendUnavailable (or other error)."""
    queue: asyncio.Queue[tuple[int, list[TokenDelta] | BaseException | None]] = asyncio.Queue()

    async def run(index: int, generation: GenerationRequest) -> None:
        batches = backend.generate_batches(generation)
        try:
            async for batch in batches:
                queue.put_nowait((index, batch))
            queue.put_nowait((index, None))
        except Exception as exc:  # handed to the consumer, who raises it
            queue.put_nowait((index, exc))
        finally:
            await batches.aclose()

    tasks = [asyncio.create_task(run(i, g), name=g.request_id) for i, g in enumerate(generations)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            # The request finishes with its last choice: earlier finishes are not its own.
            last = remaining == 1
            timing.observe(item if last else [_unfinished(d) for d in item], time.monotonic())
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _unfinished(delta: TokenDelta) -> TokenDelta:
    if delta.finish_reason is None:
        return delta
    return msgspec.structs.replace(delta, finish_reason=None)


def usage_of_choices(prompt_lengths: Sequence[int], num_generated: int,
                     choices: Sequence[_Choice] = ()) -> Usage:
    """Each prompt once, with its first choice's cached tokens (the one that prefilled it,
    gateway/api/shared_prefill.py), when the workers reported them."""
    num_prompt = sum(prompt_lengths)
    n = len(choices) // len(prompt_lengths) if choices else 1
    cached = [c.num_cached_tokens for c in choices[::n]]
    details = None if not cached or None in cached else PromptTokensDetails(
        cached_tokens=sum(c for c in cached if c is not None))
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated, prompt_tokens_details=details)


async def json_choices_answer(validated: ValidatedRequest, request_id: str,
                              merged: AsyncGenerator[tuple[int, list[TokenDelta]], None],
                              num_choices: int, prompt_lengths: Sequence[int]
                              ) -> tuple[web.Response, int]:
    choices = [_Choice() for _ in range(num_choices)]
    try:
        async for index, batch in merged:
            choice = choices[index]
            for delta in batch:
                choice.texts.append(delta.text)
                choice.logprobs.extend(delta.logprobs or ())
                choice.num_tokens += delta.num_tokens
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.num_cached_tokens = delta.num_cached_tokens
    except BackendUnavailable as exc:
        raise overloaded(str(exc), exc.retry_after_s, exc.code) from exc
    finally:
        await merged.aclose()
    num_generated = sum(c.num_tokens for c in choices)
    usage = usage_of_choices(prompt_lengths, num_generated, choices)
    created = int(time.time())
    want_logprobs = validated.logprobs is not None
    body: ChatCompletionResponse | CompletionResponse
    if validated.endpoint is Endpoint.CHAT:
        body = ChatCompletionResponse(
            id=request_id, created=created, model=validated.model, usage=usage,
            choices=[_chat_choice(validated, i, c, want_logprobs) for i, c in enumerate(choices)])
    else:
        body = CompletionResponse(
            id=request_id, created=created, model=validated.model, usage=usage,
            choices=[CompletionChoice(index=i, text="".join(c.texts),
                                      finish_reason=c.finish_reason,
                                      logprobs=completion_logprobs(tuple(c.logprobs), 0)
                                      if want_logprobs else None)
                     for i, c in enumerate(choices)])
    return web.Response(body=msgspec.json.encode(body), content_type="application/json"), \
        num_generated


def _chat_choice(validated: ValidatedRequest, index: int, choice: _Choice,
                 want_logprobs: bool) -> ChatChoice:
    text = "".join(choice.texts)
    tools = validated.tool_use
    if tools is not None and tools.parses_output:
        message, num_calls = tool_message(text, tools.names)
    else:
        message, num_calls = ChatResponseMessage(role="assistant", content=text), 0
    return ChatChoice(index=index, message=message,
                      logprobs=chat_logprobs(tuple(choice.logprobs)) if want_logprobs else None,
                      finish_reason=answer_finish_reason(choice.finish_reason, num_calls))


async def stream_choices_answer(request: web.Request, validated: ValidatedRequest,
                                request_id: str,
                                merged: AsyncGenerator[tuple[int, list[TokenDelta]], None],
                                num_choices: int, prompt_lengths: Sequence[int],
                                timing: StreamTiming, drain: Drain
                                ) -> tuple[web.StreamResponse, int]:
    """One SSE event per delta, each naming its choice; headers with the first token."""
    events = _ChunkEvents(validated, request_id, num_choices)
    response = request[SENT_RESPONSE] = web.StreamResponse(headers=SSE_HEADERS)
    try:
        try:
            index, batch = await anext(merged)
        except BackendUnavailable as exc:
            raise overloaded(str(exc), exc.retry_after_s, exc.code) from exc
        except StopAsyncIteration:
            raise overloaded("The backend ended the request without an answer.") from None
        await response.prepare(request)
        pending: list[bytes] = []
        while True:
            pending += events.of(index, batch)
            await write_bounded(request, response, b"".join(pending), timing.write_timeout_s)
            pending.clear()
            try:
                index, batch = await anext(merged)
            except StopAsyncIteration:
                break
            except BackendUnavailable as exc:  # headers are out: in-band
                pending.append(encode_event(overloaded(str(exc), code=exc.code).body_bytes()))
                break
        if validated.include_usage:
            pending.append(events.usage(prompt_lengths))
        pending.append(DONE_EVENT)
        await write_bounded(request, response, b"".join(pending), timing.write_timeout_s,
                            eof=True)
    except ConnectionResetError as exc:
        log.info("client went away during %s: %s", request_id, exc)
    except asyncio.CancelledError:
        if not (response.prepared and drain.was_cut()):
            raise
        tail = [encode_event(shutting_down().body_bytes()), DONE_EVENT]
        with contextlib.suppress(ConnectionResetError):
            await write_bounded(request, response, b"".join(tail), timing.write_timeout_s,
                                eof=True)
    finally:
        await merged.aclose()
    return response, events.num_generated


class _ChunkEvents:
    """The SSE events of a multi-choice stream (the chunk Structs, encoded per delta)."""

    def __init__(self, validated: ValidatedRequest, request_id: str, num_choices: int) -> None:
        self._chat = validated.endpoint is Endpoint.CHAT
        self._want_logprobs = validated.logprobs is not None
        self._id, self._model, self._created = request_id, validated.model, int(time.time())
        self._choices = [_Choice() for _ in range(num_choices)]
        tools = validated.tool_use
        self._tools = [ToolDeltas(tools.names) for _ in range(num_choices)] \
            if self._chat and tools is not None and tools.parses_output else None
        self.num_generated = 0

    def of(self, index: int, batch: list[TokenDelta]) -> list[bytes]:
        choice = self._choices[index]
        out = []
        if self._chat and not choice.announced:
            choice.announced = True
            out.append(self._chat_event(index, ChatDelta(role="assistant", content=""), None, None))
        for delta in batch:
            choice.num_tokens += delta.num_tokens
            self.num_generated += delta.num_tokens
            if delta.finish_reason is not None:
                choice.num_cached_tokens = delta.num_cached_tokens
            lp = delta.logprobs if self._want_logprobs else None
            if self._tools is not None:
                out += self._tool_events(index, delta, lp)
            elif self._chat:
                out.append(self._chat_event(
                    index, ChatDelta(content=delta.text) if delta.text or delta.finish_reason
                    is None else ChatDelta(), delta.finish_reason, lp))
            else:
                logprobs = completion_logprobs(lp, choice.num_chars) if lp is not None else None
                out.append(encode_event(msgspec.json.encode(CompletionChunk(
                    id=self._id, created=self._created, model=self._model,
                    choices=[CompletionChoice(index=index, text=delta.text, logprobs=logprobs,
                                              finish_reason=delta.finish_reason)]))))
            choice.num_chars += len(delta.text)
        return out

    def _tool_events(self, index: int, delta: TokenDelta,
                     logprobs: tuple[TokenLogprob, ...] | None) -> list[bytes]:
        """Content outside the calls, each call's deltas, then the finish."""
        assert self._tools is not None
        tools = self._tools[index]
        finish = delta.finish_reason
        content, calls = tools.feed(delta.text, finish is not None)
        out = []
        if content or logprobs is not None:
            out.append(self._chat_event(index, ChatDelta(content=content), None, logprobs))
        out += [self._chat_event(index, ChatDelta(tool_calls=[call]), None, None)
                for call in calls]
        if finish is not None:
            out.append(self._chat_event(index, ChatDelta(), answer_finish_reason(
                finish, tools.num_calls), None))
        return out

    def _chat_event(self, index: int, delta: ChatDelta, finish_reason: str | None,
                    logprobs: tuple[TokenLogprob, ...] | None) -> bytes:
        return encode_event(msgspec.json.encode(ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model,
            choices=[ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason,
                                     logprobs=chat_logprobs(logprobs) if logprobs is not None
                                     else None)])))

    def usage(self, prompt_lengths: Sequence[int]) -> bytes:
        usage = usage_of_choices(prompt_lengths, self.num_generated, self._choices)
        chunk: ChatCompletionChunk | CompletionChunk
        if self._chat:
            chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model,
                                        choices=[], usage=usage)
        else:
            chunk = CompletionChunk(id=self._id, created=self._created, model=self._model,
                                    choices=[], usage=usage)
        return encode_event(msgspec.json.encode(chunk))
