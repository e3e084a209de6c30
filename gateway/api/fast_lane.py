"""Tokens to the client without waking a task: SSE events written from the upstream's read
callback.

A streamed answer's handler (gateway/api/responses.py) pulls batches of deltas from the
backend and writes them. Between two batches it waits; while it waits, a `FastLane` is
open, and the backend may push deltas through it (`DeltaSink`, gateway/api/backend.py) from
the worker channel's read callback (rpc/channel_client.py):

    worker ─frame─▶ Channel.data_received ─▶ TokenRelay.offer ─▶ FastLane.push ─▶ client
                    (no task woken, no generator resumed: one decode, one encode, one write)

and the handler is woken only for what the lane does not take: the first token, the
finish, logprobs, errors, and everything while the client lags.

The lane accepts only while (a) the handler waits for its next batch (`waiting()` around
that wait), so every event it wrote before has left, in order; (b) the response is
chunked and its headers are out (opened after the first write); (c) the client's transport
is open and has nothing buffered: a client that lags gets the handler's bounded writes.
Each push is one chunk of the response's chunked body, as aiohttp would frame it.

Lifecycle: created with the request → opened after the first write (`open`) → accepting
only inside `waiting()` → closed with the handler. Invariants: `num_tokens` counts exactly
the tokens pushed; nothing is pushed outside `waiting()` or after `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator

from gateway.api.backend import TokenDelta
from gateway.api.slo_accounting import RequestTiming

TextEncoder = Callable[[str], bytes]  # one token's text as one SSE event


class FastLane:
    def __init__(self, timing: RequestTiming,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timing = timing
        self.num_tokens = 0
        self._clock = clock
        self._transport: asyncio.Transport | None = None
        self._encode: TextEncoder | None = None
        self._waiting = False

    def open(self, transport: asyncio.Transport | None, encode: TextEncoder,
             chunked: bool) -> None:
        """The headers and every event so far are written; later plain tokens may come
        this way. A response that is not chunked (HTTP/1.0) keeps the lane shut."""
        if transport is not None and chunked:
            self._transport, self._encode = transport, encode

    def close(self) -> None:
        self._transport = self._encode = None
        self._waiting = False

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the handler's wait for its next batch: the only time the lane accepts."""
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
        transport, encode = self._transport, self._encode
        assert transport is not None and encode is not None and self._waiting, \
            "push without accepts()"
        if len(deltas) == 1:
            delta = deltas[0]
            payload = encode(delta.text)
            self.num_tokens += delta.num_tokens
        else:
            payload = b"".join(encode(delta.text) for delta in deltas)
            self.num_tokens += sum(delta.num_tokens for delta in deltas)
        transport.write(b"%x\r\n%b\r\n" % (len(payload), payload))
        self.timing.observe(deltas, self._clock())

    def check_invariants(self) -> None:
        assert (self._transport is None) == (self._encode is None), "half-open lane"
        assert self.num_tokens >= 0
