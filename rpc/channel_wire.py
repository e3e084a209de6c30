"""The worker channel's wire format: one persistent connection carrying many requests.

A gateway keeps one channel per worker (rpc/channel_client.py) on the
worker's control port; the worker tells it from HTTP by its first bytes
(rpc/channel_server.py). After the magic, both directions are frames:

    ┌── 4 bytes ──────────────┬── 4 bytes ───────┬──── length bytes ─────────────────┐
    │ length, unsigned, big   │ stream id        │ msgpack [version, message] or ""  │
    └─────────────────────────┴──────────────────┴───────────────────────────────────┘

    gateway ── MAGIC, (0, ChannelHello(nonce_c)) ───────────▶ worker
            ◀─ (0, ChannelChallenge(nonce_w, proof_w)) ─────── (the greeting: below)
            ── (0, ChannelProof(proof_c)) ──────────────────▶
            ◀─ (0, ChannelWelcome) or (0, ErrorFrame) + close ─
            ── (n, request message) ───────────────────────▶ opens stream n: a call or a
            ◀─ (n, answer) ... (n, "") ─────────────────────  stream answer, then its end
            ── (n, "") ─────────────────────────────────────▶ the gateway dropped stream n
                                                              (the worker aborts it)

The greeting proves, both ways, that the peer holds the cluster's token, and the token
never travels (protocol/cluster_secret.py has the keys and MACs):

    proof_w = MAC(channel key; "worker", endpoint, nonce_c, nonce_w)
    proof_c = MAC(channel key; "caller", endpoint, nonce_c, nonce_w)

`endpoint` is host:port as the caller dialled it (the control URL the worker registered)
and as the worker serves it. The worker proves first: the caller checks proof_w before it
sends anything else, and closes the connection when it is wrong or missing, so a listener
at an address a registry entry names (a forged or stale entry, a port taken over) learns
neither the token nor a request; one that relays the greeting to a real worker gets that
worker's proof for the worker's own endpoint, which is not the one dialled. Then the worker
checks proof_c (a wrong one: ErrorFrame UNAUTHORIZED, then close). Fresh nonces on both
sides: no proof is good twice. A side without a token proves nothing (its proof is None)
and takes the other side's on trust; a caller with a token refuses a worker without one.

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

from protocol.cluster_secret import NONCE_BYTES
from protocol.messages import Message

MAGIC = b"PDSVCH02"  # never the start of an HTTP request line; "02": this wire's version
HEADER = struct.Struct(">II")
HEADER_SIZE = HEADER.size
CONNECTION_STREAM_ID = 0
MAX_STREAM_ID = (1 << 32) - 1
END = b""
_unpack = HEADER.unpack_from
_pack = HEADER.pack


Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(max_length=64)]


class ChannelHello(Message, tag="channel_hello", frozen=True, kw_only=True):
    """Caller → worker, first: a fresh nonce (nothing secret)."""

    nonce: Nonce


class ChannelChallenge(Message, tag="channel_challenge", frozen=True, kw_only=True):
    """Worker → caller: a fresh nonce, and the worker's proof (None: it has no token)."""

    nonce: Nonce
    proof: Proof | None = None


class ChannelProof(Message, tag="channel_proof", frozen=True, kw_only=True):
    """Caller → worker, once the worker's proof checked out: the caller's (None: no token)."""

    proof: Proof | None = None


class ChannelWelcome(Message, tag="channel_welcome", frozen=True, kw_only=True):
    """Worker → gateway: the channel is open; frames up to `max_frame_bytes` are taken."""

    max_frame_bytes: Annotated[int, msgspec.Meta(ge=1)]


class FrameTooLarge(ValueError):
    pass


def endpoint(host: str, port: int) -> str:
    """host:port as both ends of a greeting name it (the host as written, lower case)."""
    return f"{host.strip('[]').lower()}:{port}"


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
