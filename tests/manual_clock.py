"""A clock the test moves: deadline tests jump time instead of sleeping through it.

`ManualClock` replaces the running asyncio loop's `time()` by real time plus an offset the
test advances. Every deadline in the code under test (asyncio.timeout, loop.call_at, aiohttp's
timers) reads that clock, so advancing it past a deadline fires it at the next loop iteration,
and advancing it to just before leaves it pending: whether a deadline fired is then a fact
about the code, not about how busy the machine was.
"""

from __future__ import annotations

import asyncio


class ManualClock:
    """Use inside the loop under test: `with ManualClock() as clock: await clock.advance(s)`."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        assert isinstance(self._loop, asyncio.BaseEventLoop), \
            "ManualClock needs asyncio's own event loop (its time() can be replaced)"
        self._real_time = self._loop.time
        self.offset_s = 0.0

    def __enter__(self) -> ManualClock:
        self._loop.time = self._time  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self._loop.time  # back to the class's method

    def _time(self) -> float:
        return self._real_time() + self.offset_s

    async def advance(self, seconds: float) -> None:
        """Move the clock forward, then let the loop run the callbacks that became due."""
        self.offset_s += seconds
        await settle()


async def settle(iterations: int = 20) -> None:
    """Let the loop run a few rounds of ready callbacks (timers due now, I/O ready now)."""
    for _ in range(iterations):
        await asyncio.sleep(0)
