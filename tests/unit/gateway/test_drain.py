"""The gateway's drain: running requests finish, late ones are cut and may answer."""

from __future__ import annotations

import asyncio

from gateway.api.drain import Drain


def test_running_requests_finish_then_late_ones_are_cut_and_answer() -> None:
    async def scenario() -> None:
        drain = Drain()
        answered: list[str] = []

        async def request(name: str, work_s: float) -> None:
            with drain.track():
                try:
                    await asyncio.sleep(work_s)
                    answered.append(f"{name}: done")
                except asyncio.CancelledError:
                    if not drain.was_cut():
                        raise
                    answered.append(f"{name}: cut")

        quick = asyncio.create_task(request("quick", 0.05))
        slow = asyncio.create_task(request("slow", 10.0))
        await asyncio.sleep(0.01)
        assert drain.num_in_flight == 2
        drain.check_invariants()
        num_cut = await drain.drain(timeout_s=0.3)
        assert num_cut == 1 and sorted(answered) == ["quick: done", "slow: cut"]
        await asyncio.gather(quick, slow)  # the cut one answered and returned normally
        assert drain.num_in_flight == 0 and drain.draining
        drain.check_invariants()

    asyncio.run(scenario())


def test_a_drain_with_nothing_running_returns_at_once_and_other_cancels_still_cancel() -> None:
    async def scenario() -> None:
        drain = Drain()

        async def request() -> None:
            with drain.track():
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    assert not drain.was_cut()  # a client hang-up, not the drain
                    raise

        task = asyncio.create_task(request())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        assert await drain.drain(timeout_s=5.0) == 0

    asyncio.run(scenario())
