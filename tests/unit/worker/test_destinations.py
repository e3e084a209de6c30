"""Destinations that follow their PrefillRequest: delivered, held when early, bounded."""

from __future__ import annotations

import asyncio

import pytest

from protocol.messages import DecodeDestination
from worker.handoff import FollowingDestinations


def dest(worker: str = "d1", blocks: tuple[int, ...] = (1, 2)) -> DecodeDestination:
    return DecodeDestination(worker_id=worker, epoch=3, kv_address="addr", block_ids=list(blocks))


def test_a_notice_for_a_waiting_prefill_resolves_its_future() -> None:
    async def main() -> None:
        book = FollowingDestinations()
        future = book.expect("r", now=0.0)
        assert not future.done() and len(book) == 1
        assert book.deliver("r", dest(), now=0.5) is True
        assert await asyncio.wait_for(future, 1) == dest()
        assert book.deliver("r", dest("d2"), now=0.6) is True  # a repeat changes nothing
        assert future.result() == dest()
        book.forget("r")
        assert len(book) == 0 and book.num_held == 0
        book.check_invariants()

    asyncio.run(main())


def test_a_notice_that_overtook_its_request_is_held_until_the_request_comes() -> None:
    async def main() -> None:
        book = FollowingDestinations(hold_s=10.0)
        assert book.deliver("early", dest(), now=1.0) is False
        assert book.num_held == 1
        book.check_invariants()
        future = book.expect("early", now=5.0)
        assert future.done() and future.result() == dest()
        assert book.num_held == 0
        book.check_invariants()

    asyncio.run(main())


def test_a_held_notice_expires_and_the_held_ones_are_bounded() -> None:
    async def main() -> None:
        book = FollowingDestinations(hold_s=10.0, max_held=3)
        book.deliver("stale", dest(), now=0.0)
        future = book.expect("stale", now=20.0)  # too late: the notice is not used
        assert not future.done()
        for i in range(5):
            book.deliver(f"r{i}", dest(), now=30.0 + i)
        assert book.num_held == 3  # the oldest were dropped
        assert not book.expect("r0", now=35.0).done()
        assert book.expect("r4", now=35.0).done()
        book.deliver("late", dest(), now=100.0)  # everything older than hold_s is purged
        assert book.num_held == 1
        book.check_invariants()

    asyncio.run(main())


def test_forget_cancels_a_waiting_future_and_a_request_is_expected_once() -> None:
    async def main() -> None:
        book = FollowingDestinations()
        future = book.expect("r", now=0.0)
        with pytest.raises(ValueError, match="already expected"):
            book.expect("r", now=0.0)
        book.forget("r")
        assert future.cancelled() and len(book) == 0
        book.forget("r")  # idempotent
        assert book.deliver("r", dest(), now=1.0) is False  # held: nobody waits any more

    asyncio.run(main())
