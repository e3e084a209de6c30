"""A worker channel greeted by hand, for tests that then write frames a typed client never
sends: the greeting of rpc/channel_wire.py spoken over a plain asyncio connection."""

from __future__ import annotations

import asyncio
import struct

from protocol.cluster_secret import KeyPurpose, derive_optional_key
from protocol.messages import ErrorFrame, MessageDecoder
from rpc.channel_greeting import CallerGreeting
from rpc.channel_wire import MAGIC, ChannelChallenge, ChannelWelcome, endpoint, frame

GREETING: MessageDecoder[ChannelChallenge | ChannelWelcome | ErrorFrame] = MessageDecoder(
    ChannelChallenge | ChannelWelcome | ErrorFrame)


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    async with asyncio.timeout(5):
        length, stream_id = struct.unpack(">II", await reader.readexactly(8))
        return stream_id, await reader.readexactly(length)


async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None,
                host: str, port: int) -> ChannelWelcome:
    """The whole greeting, as a caller holding `token` that dialled host:port."""
    greeting = CallerGreeting(derive_optional_key(token, KeyPurpose.CHANNEL),
                              endpoint(host, port))
    writer.write(MAGIC + frame(0, greeting.hello()))
    stream_id, body = await read_frame(reader)
    challenge = GREETING.decode(body)
    assert stream_id == 0 and isinstance(challenge, ChannelChallenge), challenge
    writer.write(frame(0, greeting.answer(challenge)))
    stream_id, body = await read_frame(reader)
    welcome = GREETING.decode(body)
    assert stream_id == 0 and isinstance(welcome, ChannelWelcome), welcome
    return welcome


async def open_greeted(host: str, port: int, token: str | None
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    await greet(reader, writer, token, host, port)
    return reader, writer
