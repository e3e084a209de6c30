"""The network a drill degrades: when chunks may leave (pure), and the proxy that applies it
in front of a real control server on 127.0.0.1: calls through it prove the advertised
endpoint, and a delay, a partition and loss change when bytes arrive, never which."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import pytest

from protocol.messages import DecodeDestination, ReserveRequest, ReserveResponse
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, add_call, make_app
from rpc.errors import FrameDeadlineError
from rpc.fault_proxy import FaultProxy
from rpc.net_fault import NO_FAULT, RETRANSMIT_S, NetFault, release_at

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

TOKEN = "proxy-token"


# ---------------------------------------------------------------- the policy (pure)


def test_without_a_fault_or_once_healed_a_chunk_leaves_at_once() -> None:
    assert release_at(NO_FAULT, 5.0, 0.0, 0.0) == 5.0
    healed = NetFault(delay_s=1.0, partition=True, until_s=4.0)
    assert release_at(healed, 5.0, 0.0, 0.0) == 5.0
    assert release_at(healed, 5.0, 6.5, 0.0) == 6.5  # still behind a held chunk: in order
    later = NetFault(partition=True, from_s=7.0, until_s=9.0)
    assert release_at(later, 5.0, 0.0, 0.0) == 5.0  # before it starts


def test_delay_loss_and_partition_each_hold_a_chunk_back() -> None:
    delay = NetFault(delay_s=0.1, until_s=100.0)
    assert release_at(delay, 1.0, 0.0, 0.9) == pytest.approx(1.1)
    lossy = NetFault(delay_s=0.1, loss_ratio=0.25, until_s=100.0)
    assert release_at(lossy, 1.0, 0.0, 0.2) == pytest.approx(1.1 + RETRANSMIT_S)
    assert release_at(lossy, 1.0, 0.0, 0.3) == pytest.approx(1.1)
    cut = NetFault(partition=True, until_s=9.0)
    assert release_at(cut, 1.0, 0.0, 0.5) == 9.0


def test_release_times_never_go_back() -> None:
    rng = random.Random(3)
    fault = NetFault(delay_s=0.05, loss_ratio=0.3, until_s=50.0)
    previous = 0.0
    for step in range(1000):
        now = step * 0.01
        due = release_at(fault, now, previous, rng.random())
        assert due >= max(now, previous)
        previous = due


@pytest.mark.parametrize("fields", [dict(delay_s=-1.0), dict(loss_ratio=1.5),
                                    dict(until_s=-2.0), dict(from_s=3.0, until_s=2.0)])
def test_a_fault_out_of_range_is_refused(fields: dict) -> None:
    with pytest.raises(ValueError):
        NetFault(**fields)


# ---------------------------------------------------------------- the proxy (real sockets)


async def reserve(request: ReserveRequest) -> ReserveResponse:
    return ReserveResponse(request_id=request.request_id, destination=DecodeDestination(
        worker_id="d0", epoch=1, kv_address="tcp://x", block_ids=list(request.prompt_token_ids),
        num_prefix_blocks_held=0))


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[FaultProxy, ControlServer]]:
    app = make_app(token=TOKEN)
    add_call(app, ReserveRequest, reserve)
    server = ControlServer(app, token=TOKEN)
    await server.start()
    assert server.port is not None
    proxy = FaultProxy("127.0.0.1", random.Random(0))
    server.advertise(await proxy.start(0, server.port))
    yield proxy, server
    await server.stop()
    await proxy.stop()
    assert proxy.num_connections == 0
    server.check_invariants()


@pytest.fixture
async def client(proxied: tuple[FaultProxy, ControlServer]) -> AsyncIterator[ControlClient]:
    proxy, server = proxied
    assert server.url.endswith(f":{proxy.port}")  # callers dial the proxy
    pool = ChannelPool(TOKEN, connect_timeout_s=5)
    yield ControlClient(server.url, pool)
    await pool.aclose()


async def timed_call(client: ControlClient, rid: str, num_blocks: int = 3,
                     timeout_s: float = 5.0) -> float:
    start = time.monotonic()
    reply = await client.call(ReserveRequest(request_id=rid, prompt_token_ids=list(
        range(num_blocks)), timeout_ms=1000), ReserveResponse, timeout_s=timeout_s)
    assert reply.request_id == rid and reply.destination.block_ids == list(range(num_blocks))
    return time.monotonic() - start


async def test_a_call_through_the_proxy_proves_the_advertised_endpoint(
        proxied: tuple[FaultProxy, ControlServer], client: ControlClient) -> None:
    await timed_call(client, "plain")
    assert proxied[0].num_connections == 1


async def test_a_delay_holds_each_direction_back(proxied: tuple[FaultProxy, ControlServer],
                                                 client: ControlClient) -> None:
    proxy, _ = proxied
    await timed_call(client, "warm")  # the channel and its greeting, before the fault
    proxy.fault = NetFault(delay_s=0.2, until_s=time.monotonic() + 30)
    assert await timed_call(client, "late") >= 0.4  # the request's way and the answer's


async def test_a_partition_holds_every_byte_until_it_heals(
        proxied: tuple[FaultProxy, ControlServer], client: ControlClient) -> None:
    proxy, _ = proxied
    await timed_call(client, "warm")
    heals_at = time.monotonic() + 1.0
    proxy.fault = NetFault(partition=True, until_s=heals_at)
    with pytest.raises(FrameDeadlineError):  # a caller's deadline inside the partition
        await timed_call(client, "cut", timeout_s=0.3)
    await timed_call(client, "held", timeout_s=5.0)
    assert time.monotonic() >= heals_at
    await timed_call(client, "healed")


async def test_under_loss_many_calls_all_arrive_whole(
        proxied: tuple[FaultProxy, ControlServer], client: ControlClient) -> None:
    proxy, _ = proxied
    proxy.fault = NetFault(loss_ratio=0.3, until_s=time.monotonic() + 30)
    await asyncio.gather(*(timed_call(client, f"r{i}", num_blocks=1 + i % 50)
                           for i in range(60)))
