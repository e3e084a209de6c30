"""The channel's greeting: the caller sends nothing (no token, no request) to a listener that
does not prove it is this cluster's worker at the address dialled. Real control servers
and real listeners on 127.0.0.1, port 0: one that records what it gets, one that answers
with a made-up proof, one that relays every byte to a real worker (a man in the middle)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from protocol.cluster_secret import KeyPurpose, derive_key
from protocol.messages import (DecodeDestination, ErrorCode, MessageDecoder, ReserveRequest,
                               ReserveResponse, encode)
from rpc.channel_client import ChannelPool
from rpc.channel_greeting import CallerGreeting, WorkerGreeting
from rpc.channel_wire import MAGIC, ChannelChallenge, ChannelHello, ChannelProof, endpoint, frame
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, add_call, make_app
from rpc.errors import PeerUnverifiedError, RemoteError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "greeting-token-5f1c"
PROMPT = [91_001, 91_002, 91_003]  # token ids no greeting ever contains


def reserve(rid: str = "r1") -> ReserveRequest:
    return ReserveRequest(request_id=rid, prompt_token_ids=PROMPT, timeout_ms=1000)


class Worker:
    def __init__(self) -> None:
        self.reserved: list[str] = []

    async def reserve(self, request: ReserveRequest) -> ReserveResponse:
        self.reserved.append(request.request_id)
        return ReserveResponse(request_id=request.request_id, destination=DecodeDestination(
            worker_id="d0", epoch=1, kv_address="x", block_ids=[0]))


@contextlib.asynccontextmanager
async def worker_server(token: str | None) -> AsyncIterator[tuple[Worker, ControlServer]]:
    worker = Worker()
    app = make_app(token=token)
    add_call(app, ReserveRequest, worker.reserve)
    server = ControlServer(app, token=token)
    await server.start()
    try:
        yield worker, server
    finally:
        await server.stop()


class Listener:
    """A TCP listener at a control URL: records every byte; `answer` (given what came so
    far, or None) is what it writes back to the first bytes."""

    def __init__(self, answer: bytes | None = None) -> None:
        self.received = bytearray()
        self.num_connections = 0
        self.answer = answer
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        answered = False
        try:
            while chunk := await reader.read(65536):
                self.received += chunk
                if self.answer is not None and not answered:
                    writer.write(self.answer)
                    answered = True
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def assert_nothing_secret(data: bytes) -> None:
    for secret in (TOKEN.encode(), TOKEN.encode().hex().encode(),
                   derive_key(TOKEN, KeyPurpose.CHANNEL),
                   derive_key(TOKEN, KeyPurpose.REGISTRY)):
        assert secret not in data, "a secret crossed the wire"
    assert encode(reserve())[8:] not in data and b"reserve_request" not in data, \
        "a request reached an unverified peer"


async def test_a_listener_that_cannot_prove_gets_no_token_and_no_request() -> None:
    made_up = frame(0, encode(ChannelChallenge(nonce=bytes(16), proof=bytes(32))))
    for answer in (None, made_up, frame(0, encode(ChannelChallenge(nonce=bytes(16))))):
        listener = Listener(answer)
        pool = ChannelPool(TOKEN, connect_timeout_s=1.0)
        try:
            async with listener as url:
                client = ControlClient(url, pool)
                with pytest.raises((PeerUnverifiedError, TimeoutError)):
                    await client.call(reserve(), ReserveResponse, timeout_s=1.0)
                await asyncio.sleep(0.05)  # anything sent late would have arrived by now
        finally:
            await pool.aclose()
        data = bytes(listener.received)
        assert listener.num_connections == 1 and data.startswith(MAGIC)
        # Exactly the hello: the caller's proof never leaves for a peer that did not prove.
        hello = MessageDecoder(ChannelHello).decode(data[len(MAGIC) + 8:])
        assert len(data) == len(MAGIC) + 8 + len(encode(hello))
        assert_nothing_secret(data)


async def test_a_relay_to_a_real_worker_is_refused_before_any_request() -> None:
    """The listener forwards the greeting to a real worker and back: the worker's proof is
    for its own address, not the one dialled, so the caller refuses it."""
    relayed = bytearray()

    async with worker_server(TOKEN) as (worker, server):
        assert server.port is not None

        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", server.port)

            async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                           seen: bytearray | None) -> None:
                with contextlib.suppress(ConnectionError):
                    while chunk := await src.read(65536):
                        if seen is not None:
                            seen += chunk
                        dst.write(chunk)
                dst.close()

            await asyncio.gather(pump(reader, up_writer, relayed),
                                 pump(up_reader, writer, None))

        relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{relay_server.sockets[0].getsockname()[1]}"
        pool = ChannelPool(TOKEN, connect_timeout_s=2.0)
        try:
            with pytest.raises(PeerUnverifiedError, match="did not prove"):
                await ControlClient(url, pool).call(reserve(), ReserveResponse, timeout_s=2.0)
            # The same worker, dialled at its own address, is verified and answers.
            answer = await ControlClient(server.url, pool).call(reserve("direct"),
                                                                ReserveResponse, 2.0)
            assert answer.request_id == "direct"
        finally:
            await pool.aclose()
            relay_server.close()
        assert worker.reserved == ["direct"]
        assert_nothing_secret(bytes(relayed))


async def test_a_caller_with_a_token_refuses_a_worker_without_one() -> None:
    async with worker_server(None) as (worker, server):
        pool = ChannelPool(TOKEN, connect_timeout_s=2.0)
        try:
            with pytest.raises(PeerUnverifiedError):
                await ControlClient(server.url, pool).call(reserve(), ReserveResponse, 2.0)
        finally:
            await pool.aclose()
        assert worker.reserved == []
        # Neither side with a token: a loopback cluster assembled by hand works as before.
        pool = ChannelPool(None, connect_timeout_s=2.0)
        try:
            await ControlClient(server.url, pool).call(reserve(), ReserveResponse, 2.0)
        finally:
            await pool.aclose()
        assert worker.reserved == ["r1"]


async def test_a_worker_refuses_a_caller_that_cannot_prove() -> None:
    async with worker_server(TOKEN) as (worker, server):
        pool = ChannelPool(None, connect_timeout_s=2.0)
        try:
            with pytest.raises(RemoteError) as err:
                await ControlClient(server.url, pool).call(reserve(), ReserveResponse, 2.0)
        finally:
            await pool.aclose()
        assert err.value.frame.code is ErrorCode.UNAUTHORIZED and worker.reserved == []


def test_proofs_are_bound_to_side_nonces_and_endpoint() -> None:
    key = derive_key(TOKEN, KeyPurpose.CHANNEL)
    caller = CallerGreeting(key, endpoint("127.0.0.1", 7001))
    hello = MessageDecoder(ChannelHello).decode(caller.hello())
    challenges = MessageDecoder(ChannelChallenge)
    proofs = MessageDecoder(ChannelProof)

    worker = WorkerGreeting(key, endpoint("127.0.0.1", 7001))
    challenge = challenges.decode(worker.challenge(hello))
    # Reflected: the worker's own proof sent back as the caller's is not admitted.
    assert not worker.admits(ChannelProof(proof=challenge.proof))
    proof = proofs.decode(caller.answer(challenge))
    assert worker.admits(proof)
    # Replayed on another connection (the worker's fresh nonce): not admitted.
    again = WorkerGreeting(key, endpoint("127.0.0.1", 7001))
    again.challenge(hello)
    assert not again.admits(proof)
    # A worker serving another endpoint (what a relay would get) does not convince.
    elsewhere = WorkerGreeting(key, endpoint("127.0.0.1", 7002))
    with pytest.raises(PeerUnverifiedError):
        CallerGreeting(key, endpoint("127.0.0.1", 7001)).answer(
            challenges.decode(elsewhere.challenge(hello)))
    # Another cluster's key proves nothing here.
    other = WorkerGreeting(derive_key("another-token", KeyPurpose.CHANNEL),
                           endpoint("127.0.0.1", 7001))
    with pytest.raises(PeerUnverifiedError):
        CallerGreeting(key, endpoint("127.0.0.1", 7001)).answer(
            challenges.decode(other.challenge(hello)))
