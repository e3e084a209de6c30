"""A generation as an HTTP answer: one JSON body (`json_answer`) from the backend's batches
of `TokenDelta`s, and what a streamed answer (gateway/api/stream_writer.py) shares with it:
the first batch (with keep-alives while it is awaited), bounded writes, usage.

Stream: headers go out with the first token (a request that fails at once still gets a
proper 503), or after `first_byte_s` without it, then a keep-alive blank line every
`keepalive_s`; one SSE event per token, all the events of one batch in one write; a
failure after the headers is an in-band error event; the end is the usage chunk (when
asked) and [DONE]; a stream the gateway's shutdown cuts (gateway/api/drain.py) ends the same
way, with an error.
Every write to the client is bounded (`write_timeout_s`): a client that stops reading
counts as gone, its connection dropped. A client that goes away closes the batches'
generator, which is what stops the work upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import msgspec
from aiohttp import web

from gateway.api.backend import BackendUnavailable, GenerationRequest, TokenDelta, TokenLogprob
from gateway.api.chunk_encoder import chat_logprobs, completion_logprobs
from gateway.api.errors import ApiError, overloaded
from gateway.api.openai_api import (ChatChoice, ChatCompletionResponse, ChatResponseMessage,
                                    CompletionChoice, CompletionResponse, PromptTokensDetails,
                                    Usage)
from gateway.api.request_parsing import Endpoint, ValidatedRequest
from gateway.api.request_trace import RequestTrace
from gateway.api.slo_accounting import RequestTiming
from protocol.finish_reason import FinishReason

# The request's stream response, kept on the request: a handler cancelled once the client
# hangs up (after [DONE], say) still counts the status the client saw (gateway/ops/ops_api.py).
# A request refused with 429 or 503, kept on the request for the refusal counter and log;
# and its timing, for the SLO accounting (gateway/api/slo_accounting.py), and its stages.
try:
    SENT_RESPONSE = web.RequestKey("sent_response", web.StreamResponse)
    REFUSAL = web.RequestKey("refusal", ApiError)
    SLO_TIMING = web.RequestKey("slo_timing", RequestTiming)
    TRACE = web.RequestKey("trace", RequestTrace)
except AttributeError:  # aiohttp < 3.14 has no typed request keys
    SENT_RESPONSE = "pdserve_sent_response"  # type: ignore[assignment]
    REFUSAL = "pdserve_refusal"  # type: ignore[assignment]
    SLO_TIMING = "pdserve_slo_timing"  # type: ignore[assignment]
    TRACE = "pdserve_trace"  # type: ignore[assignment]

log = logging.getLogger(__name__)
# What goes out while the first token is awaited: a blank line, which every SSE parser
# ignores (no field, no event). Not a `: comment` line: clients that strip each chunk
# they read and split on blank lines (vLLM's benchmark client, many hand-written ones)
# glue a comment to the next event and lose the whole stream.
KEEPALIVE = b"\n"


def keep_refusal(request: web.Request, exc: ApiError) -> None:
    """Remember a 429 or 503 on the request for the refusal counter and the SLO outcome
    (gateway/ops/ops_api.py); other errors are not refusals."""
    if exc.status in (429, 503):
        request[REFUSAL] = exc


@dataclass(frozen=True, slots=True)
class StreamTiming:
    write_timeout_s: float = 30.0  # a client that takes no bytes this long is treated as gone
    first_byte_s: float = 2.0  # headers wait this long for the first token at most
    keepalive_s: float = 10.0  # then a blank line this often until it comes


def shutting_down() -> ApiError:
    return overloaded("The server is shutting down; retry in a moment.", retry_after_s=1)



async def write_bounded(request: web.Request, response: web.StreamResponse, data: bytes,
                 timeout_s: float, eof: bool = False) -> None:
    """One write to the client, bounded: a client that stops reading counts as gone (its
    connection is dropped, so nothing else waits on it either).

    Fast path, no timer: with nothing buffered in the transport and less than its
    high-water mark to write, the transport cannot pause, so the write cannot wait (the
    common case for a client that keeps up: one timer less per token)."""
    transport = request.transport
    if not eof and transport is not None and transport.get_write_buffer_size() == 0 \
            and len(data) < transport.get_write_buffer_limits()[1]:
        await response.write(data)
        return
    try:
        async with asyncio.timeout(timeout_s):
            if eof:
                await response.write_eof(data)
            else:
                await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client took no data for {timeout_s:g} s") from None


async def first_batch(batches: AsyncGenerator[list[TokenDelta], None]) -> list[TokenDelta]:
    try:
        return await anext(batches)
    except BackendUnavailable as exc:
        raise overloaded(str(exc), exc.retry_after_s, exc.code) from exc
    except StopAsyncIteration:
        raise overloaded("The backend ended the request without an answer.") from None


async def first_batch_or_keepalive(request: web.Request, response: web.StreamResponse,
                                    batches: AsyncGenerator[list[TokenDelta], None],
                                    timing: StreamTiming) -> list[TokenDelta]:
    """The first batch; past `first_byte_s` without it, the headers and keep-alive blank
    lines go out while it is awaited (raises ApiError for a backend that fails or gives
    nothing).

    The wait is this task's own (no task per request for the common case of a first token
    within `first_byte_s`); a timer starts the keep-alives in a task of their own, stopped
    before this returns. A keep-alive that finds the client gone (or not reading within
    `write_timeout_s`) closes the connection, and the server cancels this handler (the
    gateway's runner cancels the handler of a lost connection, as aiohttp's test server
    does), which closes `batches`: the work upstream stops."""
    loop = asyncio.get_running_loop()
    keepalives: asyncio.Task[None] | None = None

    def start_keepalives() -> None:
        nonlocal keepalives
        keepalives = loop.create_task(_keep_alive(request, response, timing))

    timer = loop.call_later(timing.first_byte_s, start_keepalives)
    try:
        return await first_batch(batches)
    finally:
        timer.cancel()
        if keepalives is not None:
            keepalives.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalives


async def _keep_alive(request: web.Request, response: web.StreamResponse,
                      timing: StreamTiming) -> None:
    try:
        if not response.prepared:
            await response.prepare(request)
        while True:
            await write_bounded(request, response, KEEPALIVE, timing.write_timeout_s)
            await asyncio.sleep(timing.keepalive_s)
    except ConnectionResetError as exc:
        log.info("client went away while its first token was awaited: %s", exc)
        if request.transport is not None:
            request.transport.close()


async def json_answer(validated: ValidatedRequest, generation: GenerationRequest,
                      batches: AsyncGenerator[list[TokenDelta], None]) -> tuple[web.Response, int]:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    num_generated = 0
    finish_reason: FinishReason | None = None
    num_cached: int | None = None
    try:
        batch = await first_batch(batches)
        while finish_reason is None:
            for delta in batch:
                texts.append(delta.text)
                logprobs.extend(delta.logprobs or ())
                num_generated += delta.num_tokens
                finish_reason = delta.finish_reason
                num_cached = delta.num_cached_tokens
                if finish_reason is not None:
                    break
            else:
                batch = await anext(batches)
    except StopAsyncIteration:
        pass
    except BackendUnavailable as exc:
        raise overloaded(str(exc), exc.retry_after_s, exc.code) from exc
    finally:
        await batches.aclose()
    text = "".join(texts)
    usage = usage_of(generation, num_generated, num_cached)
    created = int(time.time())
    want_logprobs = generation.sampling.logprobs is not None
    body: ChatCompletionResponse | CompletionResponse
    if validated.endpoint is Endpoint.CHAT:
        body = ChatCompletionResponse(
            id=generation.request_id, created=created, model=validated.model, usage=usage,
            choices=[ChatChoice(index=0, message=ChatResponseMessage(role="assistant", content=text),
                                logprobs=chat_logprobs(tuple(logprobs)) if want_logprobs else None,
                                finish_reason=finish_reason)])
    else:
        body = CompletionResponse(
            id=generation.request_id, created=created, model=validated.model, usage=usage,
            choices=[CompletionChoice(
                index=0, text=text, finish_reason=finish_reason,
                logprobs=completion_logprobs(tuple(logprobs), 0) if want_logprobs else None)])
    return web.Response(body=msgspec.json.encode(body), content_type="application/json"), num_generated


def usage_of(generation: GenerationRequest, num_generated: int,
             num_cached: int | None = None) -> Usage:
    num_prompt = len(generation.prompt_token_ids)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated,
                 prompt_tokens_details=None if num_cached is None
                 else PromptTokensDetails(cached_tokens=num_cached))
