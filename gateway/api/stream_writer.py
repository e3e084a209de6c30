"""A streamed answer: SSE events written to the client, by the handler and from the
upstream's read callback.

The handler (`stream_answer`) pulls batches of deltas from the backend and writes each
batch with one write. Between two batches it waits; while it waits, the request's
`DirectTokens` (its `sink`, gateway/api/backend.py's `DeltaSink`) is open, and the backend
may push deltas through it from the read callback of the channel to the worker
(rpc/channel_client.py):

    worker ─frame─▶ Channel.data_received ─▶ TokenRelay.offer ─▶ DirectTokens.push ─▶ client
                    (no task woken, no generator resumed: one decode, one encode, one write)

and the handler is woken only for what that does not take: the first token, the finish,
logprobs, errors, and everything while the client lags. Either way aiohttp's response
object writes the bytes (and frames them: chunked, or not for an HTTP/1.0 client).

`DirectTokens` accepts only while (a) the handler waits for its next batch (`waiting()`
around that wait), so every event it wrote before has left, in order; (b) the response's
headers are out (opened after the first write); (c) the client's transport is open and has
nothing buffered: a client that lags gets the handler's bounded writes.

Lifecycle of `DirectTokens`: created with the request → opened after the first write
(`open`) → accepting only inside `waiting()` → closed with the handler. Invariants
(`check_invariants`): `num_tokens` counts exactly the tokens pushed; nothing is pushed
outside `waiting()` or after `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator

from aiohttp import web

from gateway.api.backend import BackendUnavailable, GenerationRequest, TokenDelta
from gateway.api.chunk_encoder import ChatChunkEncoder, CompletionChunkEncoder
from gateway.api.drain import Drain
from gateway.api.errors import ApiError, overloaded
from gateway.api.request_parsing import Endpoint, ValidatedRequest
from gateway.api.responses import (SENT_RESPONSE, StreamTiming, first_batch_or_keepalive,
                                   keep_refusal, shutting_down, usage_of, write_bounded)
from gateway.api.slo_accounting import RequestTiming
from gateway.api.sse import DONE_EVENT, SSE_HEADERS, encode_event

log = logging.getLogger(__name__)

TextEncoder = Callable[[str], bytes]  # one token's text as one SSE event


class DirectTokens:
    """A streamed answer's way to its client from the upstream's read callback."""

    def __init__(self, timing: RequestTiming,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timing = timing
        self.num_tokens = 0
        self._clock = clock
        self._response: web.StreamResponse | None = None
        self._transport: asyncio.Transport | None = None
        self._encode: TextEncoder | None = None
        self._waiting = False

    def open(self, response: web.StreamResponse, transport: asyncio.Transport | None,
             encode: TextEncoder) -> None:
        """The headers and every event so far are written; later plain tokens may come
        this way."""
        if transport is not None:
            self._response, self._transport, self._encode = response, transport, encode

    def close(self) -> None:
        self._response = self._transport = self._encode = None
        self._waiting = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the handler's wait for its next batch: the only time pushes are taken."""
        self._waiting = True
        try:
            yield
        finally:
            self._waiting = False

    def accepts(self) -> bool:
        transport = self._transport
        return self._waiting and transport is not None and not transport.is_closing() \
            and transport.get_write_buffer_size() == 0

    def push(self, deltas: list[TokenDelta]) -> None:
        response, encode = self._response, self._encode
        assert response is not None and encode is not None and self._waiting, \
            "push without accepts()"
        if len(deltas) == 1:
            delta = deltas[0]
            payload = encode(delta.text)
            self.num_tokens += delta.num_tokens
        else:
            payload = b"".join(encode(delta.text) for delta in deltas)
            self.num_tokens += sum(delta.num_tokens for delta in deltas)
        write_now(response, payload)
        self.timing.observe(deltas, self._clock())

    def check_invariants(self) -> None:
        assert (self._response is None) == (self._encode is None) == (self._transport is None), \
            "half-open direct writes"
        assert self.num_tokens >= 0


def write_now(response: web.StreamResponse, data: bytes) -> None:
    """aiohttp's own write of `data`, run to its end in this call (from a callback, where
    nothing can be awaited). It frames the bytes and hands them to the transport first; the
    only wait after that is a drain of a paused transport, which `accepts()` rules out (an
    empty buffer cannot be paused). Were it paused after all, the bytes are out already and
    the drain is left to the handler's next bounded write."""
    writing = response.write(data)
    try:
        writing.send(None)
    except StopIteration:
        return
    writing.close()


async def stream_answer(request: web.Request, validated: ValidatedRequest,
                        generation: GenerationRequest,
                        batches: AsyncGenerator[list[TokenDelta], None], timing: StreamTiming,
                        drain: Drain, direct: DirectTokens) -> tuple[web.StreamResponse, int]:
    """One SSE event per token; all the events of one batch leave in one write.

    While it waits for the next batch, `direct` (the request's `sink`) lets the backend
    write plain tokens itself, as they arrive; the batches bring the rest.

    aiohttp's `write` awaits the transport only past 64 KiB buffered, so a client that
    keeps up costs no suspension per batch; one that lags makes us wait here, and the
    tokens that arrive meanwhile come as a bigger next batch.

    Headers go out with the first token, so a request that fails at once still gets a
    proper 503; when the first token takes longer than `first_byte_s` (a long prefill, a
    queue) they go out without it, followed by a keep-alive blank line every
    `keepalive_s`, and a failure is then reported in-band. A stream the gateway's shutdown
    cuts ends with an error event and [DONE] (gateway/api/drain.py).
    """
    created = int(time.time())
    chat = validated.endpoint is Endpoint.CHAT
    encoder = (ChatChunkEncoder if chat else CompletionChunkEncoder)(
        generation.request_id, created, validated.model)
    encode = encoder.text
    num_generated = 0
    write_timeout_s = timing.write_timeout_s
    response = request[SENT_RESPONSE] = web.StreamResponse(headers=SSE_HEADERS)
    events: list[bytes] = []
    direct_opened = False
    num_cached: int | None = None
    try:
        try:
            batch = await first_batch_or_keepalive(request, response, batches, timing)
        except ApiError as exc:
            if not response.prepared:
                raise
            batch = []  # headers are out: the error goes in-band, below
            events.append(encode_event(exc.body_bytes()))
            keep_refusal(request, exc)
        if not response.prepared:
            await response.prepare(request)
        if batch and isinstance(encoder, ChatChunkEncoder):
            events.append(encoder.role())
        while batch:
            finished = False
            for delta in batch:
                num_generated += delta.num_tokens
                events.append(encode(delta.text, delta.logprobs, delta.finish_reason))
                if delta.finish_reason is not None:
                    finished, num_cached = True, delta.num_cached_tokens
                    break
            if finished:
                break
            await write_bounded(request, response,
                         events[0] if len(events) == 1 else b"".join(events), write_timeout_s)
            events.clear()
            if not direct_opened:  # the headers and the first events are out
                direct_opened = True
                direct.open(response, request.transport, encoder.text)
            try:
                with direct.waiting():
                    batch = await anext(batches)
            except StopAsyncIteration:
                break
            except BackendUnavailable as exc:
                # Headers are out: report in-band, as OpenAI-compatible servers do.
                refusal = overloaded(str(exc), code=exc.code)
                keep_refusal(request, refusal)
                events.append(encode_event(refusal.body_bytes()))
                break
        if validated.include_usage:
            events.append(encoder.usage(usage_of(generation, num_generated + direct.num_tokens,
                                                 num_cached)))
        events.append(DONE_EVENT)
        # With the end-of-body chunk: the last events, [DONE] and the end in one write.
        await write_bounded(request, response, b"".join(events), write_timeout_s, eof=True)
    except ConnectionResetError as exc:
        # The client is gone (or stopped reading); nothing more can be sent. Closing the
        # generator (below) is what stops the work upstream.
        log.info("client went away during %s: %s", generation.request_id, exc)
    except asyncio.CancelledError:
        if not (response.prepared and drain.was_cut()):
            raise
        # The gateway is stopping: end the stream properly, never silently.
        events.append(encode_event(shutting_down().body_bytes()))
        if validated.include_usage:
            events.append(encoder.usage(usage_of(generation, num_generated + direct.num_tokens)))
        events.append(DONE_EVENT)
        with contextlib.suppress(ConnectionResetError):
            await write_bounded(request, response, b"".join(events), write_timeout_s, eof=True)
    finally:
        direct.close()
        await batches.aclose()
    return response, num_generated + direct.num_tokens


