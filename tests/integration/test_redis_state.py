"""The routing state against a real Redis server: registry, leases, load, prefix index."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from launcher.redis_server import RedisServer
from protocol.messages import PrefixIndexEvent, Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.prefix_index_mirror import PrefixIndexMirror
from state.redis_state import RedisState, StaleEpochError, connect, live_epochs
from worker.publisher import WorkerPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def make_info(worker_id: str, role: Role = Role.DECODE) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model="tiny", control_url="http://127.0.0.1:1",
                      num_kv_blocks=64, block_size=16)


def make_load(running: int = 0) -> WorkerLoad:
    return WorkerLoad(num_running=running, num_kv_blocks_total=64)


@pytest.fixture
async def state(redis_url: str) -> AsyncIterator[RedisState]:
    # A namespace per test: tests share one server and never see each other's keys.
    st = RedisState(connect(redis_url), namespace=f"t{uuid.uuid4().hex[:8]}")
    yield st
    await st.aclose()


async def wait_for(predicate, timeout_s: float, interval_s: float = 0.02) -> float:
    """Seconds until predicate() (sync or async) is true; fails the test at timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic() - start
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


async def test_each_start_gets_a_higher_epoch_and_fences_the_older(state: RedisState) -> None:
    first = WorkerPublisher(state, make_info("d0"), make_load, period_s=0.1, lease_ttl_s=1.0)
    e1 = await first.start()
    second = WorkerPublisher(state, make_info("d0"), make_load, period_s=0.1, lease_ttl_s=1.0)
    e2 = await second.start()
    assert e2 == e1 + 1
    assert (await state.list_workers())["d0"].epoch == e2
    await wait_for(lambda: first.fenced, 2.0)  # the zombie stops writing on its own
    with pytest.raises(StaleEpochError):
        await state.apply_index_event(PrefixIndexEvent(worker_id="d0", epoch=e1, inserted=[1]))
    await first.stop()  # must not deregister the live successor
    assert "d0" in await state.list_workers()
    await second.stop()
    assert await state.list_workers() == {}


async def test_lease_expires_within_ttl_when_heartbeats_stop(state: RedisState) -> None:
    publisher = WorkerPublisher(state, make_info("p0", Role.PREFILL), make_load,
                                period_s=0.1, lease_ttl_s=0.5)
    await publisher.start()
    await asyncio.sleep(0.7)  # longer than the TTL: heartbeats must be keeping it alive
    assert "p0" in await state.list_workers()
    await publisher.stop(deregister=False)  # a crash: no goodbye
    gone_after_s = await wait_for(lambda: _absent(state, "p0"), 3.0)
    assert gone_after_s < 0.5 + 0.2


async def _absent(state: RedisState, worker_id: str) -> bool:
    return worker_id not in await state.list_workers()


async def test_graceful_deregister_removes_worker_and_its_index_entries(state: RedisState) -> None:
    publisher = WorkerPublisher(state, make_info("d1"), make_load, period_s=0.1)
    await publisher.start()
    await publisher.set_draining()
    assert (await state.list_workers())["d1"].draining
    publisher.record_inserted([11, 12])
    await wait_for(lambda: _holders(state, [11]), 2.0)
    await publisher.stop()
    assert await state.list_workers() == {}
    assert await state.list_worker_ids() == []
    assert await state.query_prefix_holders([11, 12]) == [{}, {}]


async def _holders(state: RedisState, hashes: list[int]) -> bool:
    return all(await state.query_prefix_holders(hashes))


async def test_load_is_published_every_period(state: RedisState) -> None:
    running = {"n": 1}
    publisher = WorkerPublisher(state, make_info("d2"), lambda: make_load(running["n"]),
                                period_s=0.1, lease_ttl_s=1.0)
    await publisher.start()
    loads = await state.list_loads()
    assert loads["d2"].load.num_running == 1 and loads["d2"].epoch == publisher.epoch
    running["n"] = 7
    took_s = await wait_for(lambda: _running(state, "d2", 7), 1.0)
    assert took_s < 0.5
    await publisher.stop()
    assert await state.list_loads() == {}


async def _running(state: RedisState, worker_id: str, n: int) -> bool:
    load = (await state.list_loads()).get(worker_id)
    return load is not None and load.load.num_running == n


async def test_prefix_index_insert_evict_and_restart_purges_stale_epoch(state: RedisState) -> None:
    mirror = PrefixIndexMirror(state, block_ms=100)
    await mirror.start()
    a = WorkerPublisher(state, make_info("a"), make_load, period_s=0.1)
    b = WorkerPublisher(state, make_info("b"), make_load, period_s=0.1, lease_ttl_s=0.5)
    await a.start()
    await b.start()
    a.record_inserted([1, 2, 3, 4])
    b.record_inserted([1, 2])
    await wait_for(lambda: mirror.overlap([1, 2, 3, 4]) == {"a": 4, "b": 2}, 2.0)
    a.record_evicted([3, 4])  # evicting the tail of a chain shortens a's match
    await wait_for(lambda: mirror.overlap([1, 2, 3, 4]) == {"a": 2, "b": 2}, 2.0)
    assert [set(r) for r in await state.query_prefix_holders([1, 3])] == [{"a", "b"}, set()]

    # "a" restarts: its old entries are purged from Redis and from every mirror.
    await a.stop(deregister=False)
    a2 = WorkerPublisher(state, make_info("a"), make_load, period_s=0.1)
    await a2.start()
    assert a2.epoch == a.epoch + 1
    await wait_for(lambda: mirror.overlap([1, 2]) == {"b": 2}, 2.0)
    assert [set(r) for r in await state.query_prefix_holders([1, 2])] == [{"b"}, {"b"}]
    a2.record_inserted([1])
    await wait_for(lambda: mirror.overlap([1, 2]) == {"a": 1, "b": 2}, 2.0)
    assert mirror.index.epochs["a"] == a2.epoch
    mirror.check_invariants()

    # "b" dies for good: readers ignore it at once (no lease), purge removes its entries.
    await b.stop(deregister=False)
    await wait_for(lambda: _absent(state, "b"), 5.0)
    live = live_epochs(await state.list_workers())
    assert mirror.overlap([1, 2], live) == {"a": 1}
    assert await state.purge_expired_worker("b")
    assert not await state.purge_expired_worker("a")  # alive: refused
    await wait_for(lambda: mirror.overlap([1, 2]) == {"a": 1}, 2.0)
    await a2.stop()
    await mirror.stop()


async def test_mirror_replays_after_disconnect_and_resnapshots_after_trim(state: RedisState) -> None:
    await state.apply_index_event(PrefixIndexEvent(worker_id="w", epoch=1, inserted=[5, 6]))
    mirror = PrefixIndexMirror(state, block_ms=100)
    await mirror.start()
    assert mirror.num_snapshots == 1 and mirror.overlap([5, 6]) == {"w": 2}

    await mirror.stop()  # disconnected: misses these two events
    await state.apply_index_event(PrefixIndexEvent(worker_id="w", epoch=1, evicted=[6]))
    await state.apply_index_event(PrefixIndexEvent(worker_id="v", epoch=1, inserted=[5]))
    await mirror.start()
    assert mirror.num_snapshots == 1, "events still in the stream must be replayed"
    assert mirror.overlap([5, 6]) == {"w": 1, "v": 1}

    await mirror.stop()
    await state.apply_index_event(PrefixIndexEvent(worker_id="v", epoch=1, inserted=[6]))
    await state.apply_index_event(PrefixIndexEvent(worker_id="u", epoch=1, inserted=[5]))
    await state.trim_events(1)  # the first missed event is gone: replay would be wrong
    await mirror.start()
    assert mirror.num_snapshots == 2
    assert mirror.overlap([5, 6]) == {"w": 1, "v": 2, "u": 1}
    mirror.check_invariants()
    await mirror.stop()


@pytest.mark.timeout(60)
async def test_redis_restart_publisher_reconnects_and_republishes() -> None:
    server = RedisServer()
    server.start()
    state = RedisState(connect(server.url), op_timeout_s=0.5)
    reader = RedisState(connect(server.url), op_timeout_s=0.5)
    publisher = WorkerPublisher(state, make_info("d9"), make_load, period_s=0.1, lease_ttl_s=1.0,
                                backoff_max_s=0.2)
    mirror = PrefixIndexMirror(reader, block_ms=100, backoff_max_s=0.2)
    try:
        epoch = await publisher.start()
        publisher.record_inserted([100, 101])
        await mirror.start()
        await wait_for(lambda: mirror.overlap([100, 101]) == {"d9": 2}, 2.0)

        server.stop()  # every key is lost: the server keeps no data on disk
        await wait_for(lambda: not publisher.connected, 2.0)
        publisher.record_inserted([102])  # the engine keeps serving meanwhile
        await asyncio.sleep(2.0)
        server.start()  # same port, empty

        await wait_for(lambda: _running_epoch(reader, "d9", epoch), 5.0)
        await wait_for(lambda: _holders(reader, [100, 101, 102]), 5.0)
        await wait_for(lambda: mirror.overlap([100, 101, 102]) == {"d9": 3}, 5.0)
        assert publisher.num_errors > 0 and publisher.num_republishes >= 2
        assert mirror.num_snapshots >= 2
        mirror.check_invariants()
        publisher.check_invariants()
    finally:
        await mirror.stop()
        await publisher.stop()
        await state.aclose()
        await reader.aclose()
        server.stop()


async def _running_epoch(state: RedisState, worker_id: str, epoch: int) -> bool:
    info = (await state.list_workers()).get(worker_id)
    return info is not None and info.epoch == epoch
