"""The decoder of a stream's frames: one envelope per frame, typed by what the stream carries.

A channel (rpc/channel_wire.py) delimits frames; each frame's body is one protocol envelope
`[PROTOCOL_VERSION, message]` (protocol/messages.py). A stream is read as `F | ErrorFrame`,
where F is a message type or a union of them, with one typed msgspec decode per frame;
only a frame that fails it is decoded again by `MessageDecoder`, to raise the precise
`ProtocolError` / `ProtocolVersionError`. Decoders are stateless: one per frame type,
shared by every stream of that type (they cost more to build than a short stream costs to
decode).
"""

from __future__ import annotations

from typing import Generic, TypeVar

import msgspec

from protocol.messages import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ErrorFrame, Message,
                               MessageDecoder)

F = TypeVar("F", bound=Message)


class FrameDecoder(Generic[F]):
    """Decodes one frame's body as `F | ErrorFrame`."""

    def __init__(self, frame_type: object, max_frame_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.frame_type = frame_type
        self.max_frame_bytes = max_frame_bytes
        self._fast: msgspec.msgpack.Decoder[tuple[int, F | ErrorFrame]] = \
            msgspec.msgpack.Decoder(tuple[int, ErrorFrame | frame_type])  # type: ignore[valid-type]
        self._precise: MessageDecoder[F | ErrorFrame] = MessageDecoder(ErrorFrame | frame_type,
                                                                       max_frame_bytes)

    def decode(self, body: bytes | memoryview) -> F | ErrorFrame:
        """One frame's body (its envelope); raises ProtocolError for anything else."""
        try:
            version, message = self._fast.decode(body)
        except (msgspec.DecodeError, ValueError):
            # Let the envelope-first decoder say precisely what is wrong (version, field).
            return self._precise.decode(body)
        if version != PROTOCOL_VERSION:
            return self._precise.decode(body)  # raises ProtocolVersionError
        return message
