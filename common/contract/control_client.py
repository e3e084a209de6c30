"""The internal control plane, client side: one worker's control API as typed calls.

    call(path, message, response type, timeout)    POST one message, one answer back
    stream(path, message, frame type, timeouts)    POST one message, a stream of frames back

Both send protocol envelopes (common/contract/protocol.py); a stream is read by the one
frame reader, `common/contract/frames.py`'s `stream_frame_batches`, and yielded frame by
frame. Errors: an ErrorFrame answer raises `RemoteError`; a refused connection, a cut
stream or an undecodable answer raise `ControlError`; a missed deadline raises
`FrameDeadlineError` (control_errors.py).

Deadlines: `call` has one overall deadline; `stream` one for the response headers and the
first frame, and one per later frame, so a stalled worker is noticed within
frame_timeout_s and the request can fail cleanly instead of hanging.

Lifecycle: a client owns its aiohttp session unless one is passed in; `aclose()` closes an
owned session exactly once. Invariant (`check_invariants`): a closed client holds no session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import TypeVar

import aiohttp
from aiohttp import ClientSession, ClientTimeout

from common.contract.control_errors import ControlError, FrameDeadlineError, RemoteError
from common.contract.frames import MSGPACK_CONTENT_TYPE, FrameBatchDecoder, stream_frame_batches
from common.contract.protocol import (MAX_MESSAGE_BYTES, ErrorFrame, Message, MessageDecoder,
                                      ProtocolError, encode)

R = TypeVar("R", bound=Message)


class ControlClient:
    """Calls one worker's control API."""

    def __init__(self, base_url: str, token: str | None = None,
                 session: ClientSession | None = None,
                 max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_frame_bytes = max_frame_bytes
        self._token = token
        self._headers = {"Content-Type": MSGPACK_CONTENT_TYPE}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._owns_session = session is None
        self._session = session
        self._closed = False
        self._frame_decoders: dict[object, FrameBatchDecoder[Message]] = {}

    def _get_session(self) -> ClientSession:
        if self._closed:
            raise ControlError(f"control client of {self.base_url} is closed")
        if self._session is None:
            self._session = ClientSession()
        return self._session

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None

    async def call(self, path: str, message: Message, response_type: type[R],
                   timeout_s: float) -> R:
        """POST one message, return the decoded answer; an ErrorFrame raises RemoteError."""
        decoder: MessageDecoder[R | ErrorFrame] = MessageDecoder(ErrorFrame | response_type,
                                                                 self.max_frame_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                async with self._get_session().post(
                        self.base_url + path, data=encode(message), headers=self._headers,
                        timeout=ClientTimeout(total=None)) as response:
                    body = await response.content.read(self.max_frame_bytes + 1)
                    try:
                        answer = decoder.decode(body)
                    except ProtocolError as exc:
                        raise ControlError(f"HTTP {response.status} with an undecodable body: "
                                           f"{exc}", response.status) from exc
                    if isinstance(answer, ErrorFrame):
                        raise RemoteError(answer, response.status)
                    return answer
        except TimeoutError as exc:
            raise FrameDeadlineError(f"{path}: no answer within {timeout_s} s") from exc
        except aiohttp.ClientError as exc:  # refused, reset, cut mid-body: the peer is gone
            raise ControlError(f"{path}: {type(exc).__name__}: {exc}") from exc

    async def stream(self, path: str, message: Message, frame_type: object,
                     first_frame_timeout_s: float, frame_timeout_s: float
                     ) -> AsyncGenerator[Message, None]:
        """POST one message and yield the frames of the answer until the worker ends it.

        `frame_type` is a message type or a union of them (ErrorFrames always raise
        RemoteError). Wrap in contextlib.aclosing() when leaving the loop early: closing
        the generator drops the connection, which the worker sees as an abort.
        """
        frames = self._frame_decoders.get(frame_type)
        if frame_type not in self._frame_decoders:
            frames = self._frame_decoders[frame_type] = FrameBatchDecoder(
                frame_type, self.max_frame_bytes)
        assert frames is not None
        batches = stream_frame_batches(self._get_session(), self.base_url + path, message,
                                       frames, first_frame_timeout_s, frame_timeout_s,
                                       self._token)
        async with contextlib.aclosing(batches):
            async for batch in batches:
                for frame in batch:
                    yield frame

    def check_invariants(self) -> None:
        if self._closed:
            assert self._session is None, "a closed control client still holds its session"
