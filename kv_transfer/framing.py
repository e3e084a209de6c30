"""One TCP connection carrying control frames and (TCP backend) raw KV data frames.

Frame = 13-byte header `!BIQ` (kind, payload length, tag) + payload.
  kind 0 control: payload is one msgpack `ControlMessage`.
  kind 1 data:    payload is the bytes of message `tag` (see layout.tag_for); the reader
                  asks `dest_for(tag)` for the destination and receives straight into the
                  cache (BufferedProtocol: no intermediate copy). A tag with no destination
                  (a cancelled transfer) is read into a small scratch buffer and dropped.

Lifecycle: connected -> (frames) -> lost. `on_lost(exc)` is called exactly once, when the
peer closes, dies (the kernel resets the socket), or a frame is malformed; the closed
connection is what tells either side that its peer died.
Invariants: at most one data frame is partly received at a time; `dest_for` is consulted
on every `get_buffer`, so a destination dropped mid-frame receives no further byte.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

import msgspec

from kv_transfer.messages import DECODER, ENCODER, ControlMessage

HEADER = struct.Struct("!BIQ")
KIND_CONTROL = 0
KIND_DATA = 1
MAX_CONTROL_BYTES = 16 << 20
SCRATCH_BYTES = 1 << 20


class FrameConnection(asyncio.BufferedProtocol):
    def __init__(self, on_message: Callable[["FrameConnection", ControlMessage], None],
                 on_lost: Callable[["FrameConnection", Exception | None], None],
                 dest_for: Callable[[int], memoryview | None] | None = None,
                 on_data: Callable[[int], None] | None = None) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._dest_for = dest_for
        self._on_data = on_data
        self.transport: asyncio.Transport | None = None
        self._header = bytearray(HEADER.size)
        self._header_view = memoryview(self._header)
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._kind: int | None = None  # None: reading a header
        self._tag = 0
        self._length = 0
        self._pos = 0
        self._payload: bytearray | None = None
        self._write_ready: asyncio.Future[None] | None = None
        self._lost = False

    # -- reading ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._kind is None:
            return self._header_view[self._pos:]
        if self._kind == KIND_CONTROL:
            return memoryview(self._payload)[self._pos:]  # type: ignore[arg-type]
        remaining = self._length - self._pos
        dest = self._dest_for(self._tag) if self._dest_for is not None else None
        if dest is None or len(dest) != self._length:
            return self._scratch[:min(remaining, SCRATCH_BYTES)]
        return dest[self._pos:]

    def buffer_updated(self, nbytes: int) -> None:
        self._pos += nbytes
        if self._kind is None:
            if self._pos < HEADER.size:
                return
            self._kind, self._length, self._tag = HEADER.unpack(self._header)
            self._pos = 0
            if self._kind == KIND_CONTROL:
                if self._length > MAX_CONTROL_BYTES:
                    return self._fail(ValueError(f"control frame of {self._length} bytes"))
                self._payload = bytearray(self._length)
            elif self._kind != KIND_DATA or self._dest_for is None:
                return self._fail(ValueError(f"unexpected frame kind {self._kind}"))
            if self._length == 0:
                self._frame_done()
            return
        if self._pos == self._length:
            self._frame_done()

    def _frame_done(self) -> None:
        kind, tag, payload = self._kind, self._tag, self._payload
        self._kind, self._pos, self._payload = None, 0, None
        if kind == KIND_CONTROL:
            try:
                message = DECODER.decode(payload)  # type: ignore[arg-type]
            except msgspec.DecodeError as exc:
                return self._fail(exc)
            self._on_message(self, message)
        elif self._on_data is not None:
            self._on_data(tag)

    def _fail(self, exc: Exception) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(ConnectionResetError("connection lost"))
        self._on_lost(self, exc)

    def eof_received(self) -> bool:
        return False  # close our side too; a half-open control link is a dead peer

    # -- writing ---------------------------------------------------------------------------
    @property
    def is_lost(self) -> bool:
        return self._lost

    def send_message(self, message: ControlMessage) -> None:
        """Queue one control frame; silently dropped once the connection is lost."""
        if self._lost or self.transport is None:
            return
        payload = ENCODER.encode(message)
        self.transport.write(HEADER.pack(KIND_CONTROL, len(payload), 0) + payload)

    async def send_data(self, tag: int, data: memoryview) -> None:
        """Write one data frame, waiting (flow control) while the socket buffer is full."""
        if self._lost or self.transport is None:
            raise ConnectionResetError("connection lost")
        view = data.cast("B")
        # One writev for the header and the payload (two writes made two syscalls).
        self.transport.writelines((HEADER.pack(KIND_DATA, len(view), tag), view))
        if self._write_ready is not None:
            await asyncio.shield(self._write_ready)

    def pause_writing(self) -> None:
        if self._write_ready is None:
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)
        self._write_ready = None

    def close(self) -> None:
        if self.transport is not None and not self._lost:
            self.transport.close()
