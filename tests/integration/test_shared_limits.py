"""Admission limits shared by gateway replicas (gateway/admission/shared_limits.py) on a real Redis.

Two `SharedLimits` in one process stand for two gateway replicas of one cluster (one
namespace); the process-level test with two real gateways is test_gateway_replicas.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.admission.limit_store import LimitStore
from gateway.admission.shared_limits import LimitMode, SharedLimits, SlotRefused
from gateway.admission.tiers import TierSpec
from launcher.redis_server import RedisServer
from state.redis_state import connect

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def tier(max_running: int = 3, max_queued: int = 0, wait_ms: float = 2000.0) -> TierSpec:
    return TierSpec(name="standard", priority=1, ttft_ms=wait_ms, tpot_ms=100.0,
                    max_queued=max_queued, max_running=max_running, tokens_per_min=None)


class Replicas:
    def __init__(self, url: str, num: int = 2, op_timeout_s: float = 0.25) -> None:
        self.namespace = f"sl{uuid.uuid4().hex[:8]}"
        self.clients = [connect(url) for _ in range(num)]
        self.limits = [SharedLimits(LimitStore(c, self.namespace, op_timeout_s=op_timeout_s),
                                    time.monotonic, replicas_hint=num, sync_period_s=0.2)
                       for c in self.clients]

    async def start(self) -> None:
        for limits in self.limits:
            limits.start()

    async def close(self) -> None:
        for limits in self.limits:
            await limits.stop()
            limits.check_invariants()
        for client in self.clients:
            await client.aclose()


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[Replicas]:
    r = Replicas(redis_url)
    await r.start()
    yield r
    await r.close()


async def test_a_tier_limit_holds_across_replicas(replicas: Replicas) -> None:
    a, b = replicas.limits
    spec = tier(max_running=3, max_queued=0)
    assert await a.acquire("r1", spec, 100, 1.0) is None
    assert await b.acquire("r2", spec, 100, 1.0) is None
    assert await a.acquire("r3", spec, 100, 1.0) is None
    for limits, rid in ((a, "r4"), (b, "r5")):
        refused = await limits.acquire(rid, spec, 100, 1.0)
        assert isinstance(refused, SlotRefused) and refused.reason == "tier_queue_full"
        assert refused.retry_after_s >= 1.0
    b.release("r2")  # one slot back, on the other replica: the next one fits again
    await asyncio.wait_for(_until(lambda: _num_running(replicas, "standard"), 2), 2.0)
    assert await a.acquire("r6", spec, 100, 1.0) is None
    for limits, rid in ((a, "r1"), (a, "r3"), (a, "r6")):
        limits.release(rid)
    await asyncio.wait_for(_until(lambda: _num_running(replicas, "standard"), 0), 2.0)


async def test_the_total_limit_holds_across_tiers_and_replicas(replicas: Replicas) -> None:
    a, b = replicas.limits
    other = TierSpec(name="batch", priority=2, ttft_ms=500.0, tpot_ms=100.0, max_queued=0,
                     max_running=10, tokens_per_min=None)
    assert await a.acquire("r1", tier(max_running=10), 2, 1.0) is None
    assert await b.acquire("r2", other, 2, 1.0) is None
    assert isinstance(await a.acquire("r3", other, 2, 1.0), SlotRefused)
    a.release("r1")
    b.release("r2")


async def test_a_queued_request_gets_the_next_free_slot_in_order(replicas: Replicas) -> None:
    a, b = replicas.limits
    spec = tier(max_running=1, max_queued=2, wait_ms=5000.0)
    assert await a.acquire("r1", spec, 100, 1.0) is None
    first = asyncio.create_task(b.acquire("r2", spec, 100, 1.0))
    await asyncio.sleep(0.1)
    second = asyncio.create_task(a.acquire("r3", spec, 100, 1.0))
    await asyncio.sleep(0.1)
    full = await b.acquire("r4", spec, 100, 1.0)  # two wait already: the queue is full
    assert isinstance(full, SlotRefused) and full.reason == "tier_queue_full"
    a.release("r1")
    assert await asyncio.wait_for(first, 2.0) is None  # the earlier waiter, on the other replica
    assert not second.done()
    b.release("r2")
    assert await asyncio.wait_for(second, 2.0) is None
    a.release("r3")


async def test_a_waiter_gives_up_at_its_wait_limit(replicas: Replicas) -> None:
    a, b = replicas.limits
    spec = tier(max_running=1, max_queued=4, wait_ms=300.0)
    assert await a.acquire("r1", spec, 100, 1.0) is None
    started = time.monotonic()
    refused = await b.acquire("r2", spec, 100, 1.0)
    assert isinstance(refused, SlotRefused) and refused.reason == "deadline"
    assert 0.3 <= time.monotonic() - started < 1.0
    a.release("r1")
    # The abandoned queue entry goes with b's next sync, the slot with a's: then a newcomer
    # is not behind a ghost.
    await asyncio.wait_for(_until(lambda: _num_held(replicas, "standard"), (0, 0)), 5.0)
    assert await b.acquire("r3", tier(max_running=1, max_queued=0), 100, 1.0) is None
    b.release("r3")


async def test_a_cancelled_wait_leaves_nothing_behind(replicas: Replicas) -> None:
    a, b = replicas.limits
    spec = tier(max_running=1, max_queued=1, wait_ms=5000.0)
    assert await a.acquire("r1", spec, 100, 1.0) is None
    waiter = asyncio.create_task(b.acquire("r2", spec, 100, 1.0))
    await asyncio.sleep(0.1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    a.release("r1")
    await asyncio.wait_for(_until(lambda: _num_held(replicas, "standard"), (0, 0)), 5.0)
    assert await a.acquire("r3", tier(max_running=1, max_queued=0), 100, 1.0) is None
    a.release("r3")


async def test_a_key_token_rate_holds_across_replicas(replicas: Replicas) -> None:
    a, b = replicas.limits
    # A 600-token bucket: 5 charges of 110 fit, the 6th does not, whichever replica asks.
    outcomes = [await limits.charge("alice", 110, 600) for limits in (a, b) * 4]
    assert [o is None for o in outcomes] == [True] * 5 + [False] * 3
    assert 0 < outcomes[5] <= 60 * 110 / 600 + 0.1
    b.refund("alice", 110, 600)  # batched through the sync task
    await asyncio.sleep(0.3)
    assert await a.charge("alice", 110, 600) is None


async def test_replicas_fall_back_to_their_share_without_redis_and_recover() -> None:
    with RedisServer() as server:
        replicas = Replicas(server.url)
        await replicas.start()
        a, b = replicas.limits
        try:
            await asyncio.wait_for(_until(lambda: _replicas_seen(replicas), 2), 3.0)
            spec = tier(max_running=4, max_queued=0)
            assert await a.acquire("held", spec, 100, 1.0) is None
            server.stop()
            # Each admits floor(4 / 2) = 2 on its own: 4 together, never more.
            outcomes = [await limits.acquire(f"{i}-{n}", spec, 100, 1.0)
                        for i, limits in enumerate((a, b)) for n in range(4)]
            assert [o is None for o in outcomes] == [True, False, False, False,
                                                     True, True, False, False]
            assert a.mode is LimitMode.LOCAL and b.mode is LimitMode.LOCAL
            assert (await a.charge("bob", 200, 600)) is None  # 600 / 2: 300 here
            assert (await a.charge("bob", 200, 600)) is not None
            for rid in ("held", "0-0"):
                a.release(rid)
            server.start()  # same port; the sync tasks find it within a period
            await asyncio.wait_for(_until(lambda: (a.mode, b.mode),
                                          (LimitMode.SHARED, LimitMode.SHARED)), 5.0)
            # b's two fallback slots were written back: the shared limit counts them.
            await asyncio.wait_for(_until(lambda: _num_running(replicas, "standard"), 2), 3.0)
            assert await a.acquire("after-1", spec, 100, 1.0) is None
            assert await a.acquire("after-2", spec, 100, 1.0) is None
            assert isinstance(await a.acquire("after-3", spec, 100, 1.0), SlotRefused)
            for limits, rid in ((a, "after-1"), (a, "after-2"), (b, "1-0"), (b, "1-1")):
                limits.release(rid)
        finally:
            await replicas.close()


async def test_a_lone_replica_decides_locally_and_a_newcomer_sees_its_slots(redis_url: str
                                                                         ) -> None:
    alone = Replicas(redis_url, num=1)
    await alone.start()
    (a,) = alone.limits
    try:
        await asyncio.wait_for(_until(lambda: a.status()["mode"], "solo"), 3.0)
        spec = tier(max_running=2, max_queued=0)
        assert await a.acquire("r1", spec, 100, 1.0) is None
        assert await a.acquire("r2", spec, 100, 1.0) is None
        # Published by the next renewal, so that a replica joining counts them.
        await asyncio.wait_for(_until(lambda: _num_running(alone, "standard"), 2), 2.0)
        other = SharedLimits(LimitStore(alone.clients[0], alone.namespace), time.monotonic,
                             replicas_hint=1, sync_period_s=0.2)
        other.start()
        try:
            await asyncio.wait_for(_until(lambda: a.status()["mode"], "shared"), 3.0)
            await asyncio.wait_for(_until(lambda: other.status()["mode"], "shared"), 3.0)
            refused = await other.acquire("r3", spec, 100, 1.0)
            assert isinstance(refused, SlotRefused)
            a.release("r1")
            await asyncio.wait_for(_until(lambda: _num_running(alone, "standard"), 1), 2.0)
            assert await other.acquire("r4", spec, 100, 1.0) is None
            other.release("r4")
        finally:
            await other.stop()
        a.release("r2")
    finally:
        await alone.close()


async def _num_running(replicas: Replicas, tier_name: str) -> int:
    return await replicas.limits[0]._store.num_running(tier_name)


async def _num_held(replicas: Replicas, tier_name: str) -> tuple[int, int]:
    """(slots, queue entries) the tier holds in Redis."""
    store = replicas.limits[0]._store
    return await store.num_running(tier_name), await store.num_queued(tier_name)


async def _replicas_seen(replicas: Replicas) -> int:
    return min(limits.num_replicas_seen for limits in replicas.limits)


async def _until(probe, expected, interval_s: float = 0.02) -> None:
    while True:
        value = probe()
        if asyncio.iscoroutine(value):
            value = await value
        if value == expected:
            return
        await asyncio.sleep(interval_s)
