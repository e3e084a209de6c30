"""The worker channel's wire format: one persistent connection carrying many requests.

A gateway keeps one channel per worker (rpc/channel_client.py) on the
worker's control port; the worker tells it from HTTP by its first bytes
(rpc/channel_server.py). After the magic, both directions are frames:

    ┌── 4 bytes ──────────────┬── 4 bytes ───────┬──── length bytes ─────────────────┐
    │ length, unsigned, big   │ stream id        │ msgpack [version, message] or ""  │
    └─────────────────────────┴──────────────────┴───────────────────────────────────┘

    gateway ── MAGIC, (0, ChannelHello(token)) ─────────────▶ worker
            ◀─ (0, ChannelWelcome) or (0, ErrorFrame) + close ─
            ── (n, request message) ───────────────────────▶ opens stream n: a call or a
            ◀─ (n, answer) ... (n, "") ─────────────────────  stream answer, then its end
            ── (n, "") ─────────────────────────────────────▶ the gateway dropped stream n
                                                              (the worker aborts it)

Stream 0 is the connection's own (the greeting); the gateway numbers its streams from 1
and never reuses a number on one connection. An empty body ends a stream: from the worker,
after its last frame (an ErrorFrame ends it too); from the gateway, as an abort. A worker
answers frames of a stream it no longer knows with nothing; a gateway drops them.

Invariants (`FrameSplitter`): frames come out whole, exactly once, in wire order; a frame
over `max_frame_bytes` is refused before it is buffered.
"""

from __future__ import annotations

import struct
from typing import Annotated

import msgspec

from protocol.messages import Message

MAGIC = b"PDSVCH01"  # never the start of an HTTP request line; "01": this wire's version
HEADER = struct.Struct(">II")
HEADER_SIZE = HEADER.size
CONNECTION_STREAM_ID = 0
MAX_STREAM_ID = (1 << 32) - 1
END = b""
_unpack = HEADER.unpack_from
_pack = HEADER.pack


class ChannelHello(Message, tag="channel_hello", frozen=True, kw_only=True):
    """Gateway → worker, first: the internal token (None where the worker needs none)."""

    token: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class ChannelWelcome(Message, tag="channel_welcome", frozen=True, kw_only=True):
    """Worker → gateway: the channel is open; frames up to `max_frame_bytes` are taken."""

    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1)]


class FrameTooLarge(ValueError):
    pass


def frame(stream_id: int, body: bytes) -> bytes:
    return _pack(len(body), stream_id) + body


def end_frame(stream_id: int) -> bytes:
    return _pack(0, stream_id)


class FrameSplitter:
    """Bytes in, (stream id, body) out; keeps an incomplete tail for the next feed."""

    def __init__(self, max_frame_bytes: int) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._tail = b""

    @property
    def has_partial_frame(self) -> bool:
        return bool(self._tail)

    def feed(self, data: bytes) -> list[tuple[int, bytes | memoryview]]:
        """Every frame `data` completes, in order. Raises FrameTooLarge."""
        if self._tail:
            data = self._tail + data
            self._tail = b""
        size = len(data)
        if size >= HEADER_SIZE:
            length, stream_id = _unpack(data, 0)
            if length + HEADER_SIZE == size and length <= self.max_frame_bytes:
                return [(stream_id, data[HEADER_SIZE:])]  # a paced stream's usual read
        frames: list[tuple[int, bytes | memoryview]] = []
        view = memoryview(data)
        pos = 0
        while pos + HEADER_SIZE <= size:
            length, stream_id = _unpack(data, pos)
            if length > self.max_frame_bytes:
                raise FrameTooLarge(f"frame of {length} bytes exceeds {self.max_frame_bytes}")
            end = pos + HEADER_SIZE + length
            if end > size:
                break
            frames.append((stream_id, view[pos + HEADER_SIZE:end]))
            pos = end
        if pos < size:
            self._tail = bytes(view[pos:])
        return frames
