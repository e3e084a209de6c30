"""The wire envelope every cross-process message travels in, and its codec.

    [PROTOCOL_VERSION, message]      one msgpack array; `message` a tagged msgspec Struct

The version sits outside the message, so a peer on another version gets a clear
`ProtocolVersionError`, not a confusing field error. Decoding is bounded: a message over
`max_bytes` is refused before it is parsed. The messages themselves are in protocol.py
(which re-exports what is here).
"""

from __future__ import annotations

import typing
from typing import Generic, TypeVar

import msgspec

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 << 20  # a hostile peer cannot make a process allocate without limit


class ProtocolError(ValueError):
    """A message could not be decoded (bad bytes, bad fields, too large)."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks another protocol version."""


class MessageTooLargeError(ProtocolError):
    pass


M = TypeVar("M")


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode((PROTOCOL_VERSION, message))


class MessageDecoder(Generic[M]):
    """Decodes envelopes into one message type (or a union of them), checking the version;
    annotate it with what it yields (`d: MessageDecoder[A | B] = MessageDecoder(A | B)`)."""

    def __init__(self, message_type: object, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.message_type = message_type
        self.max_bytes = max_bytes
        self._envelope = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(message_type)

    def decode(self, data: bytes | memoryview) -> M:
        if len(data) > self.max_bytes:
            raise MessageTooLargeError(f"message of {len(data)} bytes exceeds {self.max_bytes}")
        try:
            version, body = self._envelope.decode(data)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"not a pdserve message envelope: {exc}") from exc
        if version != PROTOCOL_VERSION:
            raise ProtocolVersionError(
                f"peer speaks protocol version {version}, this process speaks {PROTOCOL_VERSION}")
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, ValueError) as exc:
            raise ProtocolError(f"invalid {_type_name(self.message_type)}: {exc}") from exc


def decode(data: bytes | memoryview, message_type: type[M], max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """One-off decode; hot paths keep a MessageDecoder."""
    decoder: MessageDecoder[M] = MessageDecoder(message_type, max_bytes)
    return decoder.decode(data)


def _type_name(message_type: object) -> str:
    members = typing.get_args(message_type)
    if members:
        return " | ".join(_type_name(m) for m in members)
    return getattr(message_type, "__name__", None) or str(message_type)
