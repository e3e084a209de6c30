"""The line of reservations waiting for free KV blocks (worker/block_waiters.py).

The pool here is a counter of free blocks behind the two engine calls the line uses
(`call`, `submit`), so the order of service can be checked exactly."""

from __future__ import annotations

import asyncio

import pytest
from manual_clock import ManualClock, settle

from protocol.messages import ReserveRequest
from protocol.worker_load import WorkerLoad
from worker.block_waiters import BlockWaiters, ReservationAborted, refusal


class Pool:
    """Free blocks and who holds what; `reserve` takes `len(prompt)` blocks or none."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.held: dict[str, int] = {}
        self.tries: list[str] = []

    def reserve(self, rid: str, prompt: list[int]) -> object | None:
        self.tries.append(rid)
        if len(prompt) > self.free:
            return None
        self.free -= len(prompt)
        self.held[rid] = len(prompt)
        return ("held", rid)

    def release_reservation(self, rid: str) -> None:
        self.free += self.held.pop(rid, 0)

    async def call(self, fn, timeout_s: float = 30.0):
        await asyncio.sleep(0)  # a command waits for the engine thread
        return fn(self)

    def submit(self, fn, what: str) -> None:
        fn(self)


def request(rid: str, blocks: int, priority: int = 0, wait_ms: int = 60_000) -> ReserveRequest:
    return ReserveRequest(request_id=rid, prompt_token_ids=[1] * blocks, timeout_ms=60_000,
                          wait_ms=wait_ms, priority=priority)


def test_waiters_are_served_by_priority_then_arrival_and_only_the_head_tries() -> None:
    async def main() -> None:
        pool = Pool(free=0)
        pool.held["running"] = 5
        changes: list[tuple[int, str | None]] = []
        line = BlockWaiters(poll_s=0.01, on_change=lambda n, outcome: changes.append((n, outcome)))
        order: list[str] = []

        async def wait(rid: str, blocks: int, priority: int) -> None:
            if await line.reserve(pool, request(rid, blocks, priority), lambda: False):
                order.append(rid)

        tasks = []
        for rid, blocks, priority in (("low-big", 3, 0), ("high", 1, 5), ("low-small", 1, 0)):
            tasks.append(asyncio.create_task(wait(rid, blocks, priority)))
            await settle()
        line.check_invariants()
        assert len(line) == 3 and "high" in line
        pool.tries.clear()
        for _ in range(5):
            await asyncio.sleep(0.02)
        # Only the head (the higher priority) tried while nothing was free.
        assert set(pool.tries) == {"high"}
        pool.release_reservation("running")  # 5 blocks free: all three fit, in line order
        line.notify()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert order == ["high", "low-big", "low-small"]
        assert pool.free == 0 and pool.held == {"high": 1, "low-big": 3, "low-small": 1}
        line.check_invariants()
        assert len(line) == 0
        assert [c for c in changes if c[1] is not None] == [(2, "served"), (1, "served"),
                                                             (0, "served")]

    asyncio.run(main())


def test_a_big_head_is_not_passed_by_smaller_requests_behind_it() -> None:
    async def main() -> None:
        pool = Pool(free=2)
        line = BlockWaiters(poll_s=0.01)
        big = asyncio.create_task(line.reserve(pool, request("big", 3), lambda: False))
        await settle()
        small = asyncio.create_task(line.reserve(pool, request("small", 1), lambda: False))
        await settle()
        # "small" would fit now, but it arrived after "big" at the same priority: it
        # neither tried the pool nor took a block.
        for _ in range(3):
            await asyncio.sleep(0.02)
        assert not big.done() and not small.done()
        assert "small" not in pool.tries[1:] and pool.free == 2
        pool.free += 2  # 4 free: big takes 3, then small takes 1
        line.notify()
        assert await asyncio.wait_for(big, 5.0) == ("held", "big")
        assert await asyncio.wait_for(small, 5.0) == ("held", "small")
        assert pool.free == 0

    asyncio.run(main())


def test_a_wait_ends_at_its_deadline_or_at_an_abort_and_leaves_nothing_held() -> None:
    async def main() -> None:
        pool = Pool(free=0)
        outcomes: list[str | None] = []
        line = BlockWaiters(poll_s=0.01, on_change=lambda n, outcome: outcomes.append(outcome))
        with ManualClock() as clock:
            late = asyncio.create_task(line.reserve(pool, request("late", 1, wait_ms=30_000),
                                                    lambda: False))
            await settle()
            await clock.advance(25.0)
            assert not late.done()
            await clock.advance(10.0)
            assert await asyncio.wait_for(late, 5.0) is None
        aborted = asyncio.create_task(line.reserve(pool, request("aborted", 1), lambda: False))
        await settle()
        assert line.cancel("aborted") and not line.cancel("nobody")
        with pytest.raises(ReservationAborted, match="aborted while waiting"):
            await asyncio.wait_for(aborted, 5.0)
        stopping = [False]
        drained = asyncio.create_task(line.reserve(pool, request("drained", 1),
                                                   lambda: stopping[0]))
        await settle()
        stopping[0] = True
        assert await asyncio.wait_for(drained, 5.0) is None
        assert [o for o in outcomes if o] == ["timed_out", "cancelled", "cancelled"]
        assert len(line) == 0 and pool.held == {}
        line.check_invariants()

    asyncio.run(main())


def test_a_cancelled_wait_frees_what_its_last_try_took() -> None:
    async def main() -> None:
        pool = Pool(free=0)
        line = BlockWaiters(poll_s=0.01)
        task = asyncio.create_task(line.reserve(pool, request("gone", 2), lambda: False))
        await settle()
        pool.free = 2
        line.notify()
        await asyncio.sleep(0)  # the try is on its way to the "engine"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Whether or not the try had taken the blocks, the release queued behind it frees them.
        assert pool.held == {} and pool.free == 2 and len(line) == 0

    asyncio.run(main())


def test_no_wait_asked_answers_at_once_and_a_prompt_larger_than_the_pool_is_an_error() -> None:
    async def main() -> None:
        pool = Pool(free=0)
        line = BlockWaiters()
        assert await line.reserve(pool, request("now", 1, wait_ms=0), lambda: False) is None
        assert len(line) == 0

        class Small(Pool):
            def reserve(self, rid: str, prompt: list[int]) -> object | None:
                raise ValueError("the prompt needs 9 KV blocks; this worker's pool has 8")

        with pytest.raises(ValueError, match="9 KV blocks"):
            await line.reserve(Small(0), request("huge", 9), lambda: False)

    asyncio.run(main())


def test_refusal_names_what_ran_out() -> None:
    # 33 prompt tokens + 1 position = 3 blocks of 16.
    message = refusal(request("r", 33, wait_ms=1500), 16,
                      WorkerLoad(num_kv_blocks_used=7, num_kv_blocks_total=8))
    assert message == ("KV cache full: the prompt needs 3 blocks, 1 of 8 are free within "
                       "1500 ms; retry later or on another worker")


def test_an_abort_during_the_first_try_releases_what_it_took() -> None:
    async def main() -> None:
        pool = Pool(free=10)
        line = BlockWaiters()
        task = asyncio.create_task(line.reserve(pool, request("r", 3), lambda: False))
        await asyncio.sleep(0)  # the first try is on the "engine thread" now
        assert "r" in line and line.cancel("r")
        with pytest.raises(ReservationAborted, match="aborted while reserving"):
            await task
        assert pool.tries == ["r"] and pool.held == {} and pool.free == 10
        line.check_invariants()

    asyncio.run(main())


def test_an_abort_handled_before_its_reservation_refuses_it_for_a_while() -> None:
    async def main() -> None:
        pool = Pool(free=10)
        line = BlockWaiters(abort_memory_s=10.0, max_aborts_remembered=2)
        with ManualClock() as clock:
            assert not line.cancel("early")  # nothing to cancel yet: remembered
            with pytest.raises(ReservationAborted, match="before the reservation"):
                await line.reserve(pool, request("early", 2), lambda: False)
            assert pool.tries == []  # never reached the pool
            line.cancel("late")
            await clock.advance(11.0)
            assert await line.reserve(pool, request("late", 2), lambda: False) == ("held", "late")
            for rid in ("a", "b", "c"):  # bounded: the oldest is forgotten
                line.cancel(rid)
            line.check_invariants()
            assert await line.reserve(pool, request("a", 1), lambda: False) == ("held", "a")
            with pytest.raises(ReservationAborted):
                await line.reserve(pool, request("c", 1), lambda: False)

    asyncio.run(main())
