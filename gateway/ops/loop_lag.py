"""How late the gateway's event loop runs: the relay's share of a streamed request's time.

A worker's token frame reaches the gateway's socket and waits there until the event loop
gets to it; the gateway then writes it to the client from that same callback
(gateway/api/stream_writer.py). With the loop busy (many streams, long prompts being
tokenized, a core shared with a worker) every frame waits as long as the loop runs late,
and the client sees it in its time per output token beside the decode worker's own steps.
The operations agent cannot tell one from the other without this figure
(agent/root_cause.py's relay stage).

    a sampling task:  every `period_s`: sleep(period_s); lag = time slept - period_s
    mean_ms(a, b):    the mean lag of the samples taken in [a, b] (wall-clock seconds,
                      as a request's record dates it), or the first one after a when none
                      was taken in it (a stream shorter than a period); None: no sample

Lifecycle: start() → a sample every `period_s` → stop() (cancelled and awaited). The
samples of the last `keep_s` are kept. Invariant: samples are in time order.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable, Sequence

PERIOD_S = 0.05  # 20 wake-ups a second: a few microseconds of the loop's time each
KEEP_S = 600.0


def mean_in_window(times: Sequence[float], total_ms: Sequence[float], start: float,
                   end: float) -> float | None:
    """The mean lag of the samples taken at `times` (ascending) within [start, end], from
    `total_ms` (the running sum of the lags, sample by sample); the first sample's after
    `start` where none lies within; None where none lies after it. O(log n); pure."""
    first = bisect.bisect_left(times, start)
    last = bisect.bisect_right(times, end)
    if first >= len(times):
        return None
    last = max(last, first + 1)
    before = total_ms[first - 1] if first else 0.0
    return (total_ms[last - 1] - before) / (last - first)


class LoopLag:
    def __init__(self, period_s: float = PERIOD_S, keep_s: float = KEEP_S,
                 clock: Callable[[], float] = time.time) -> None:
        if period_s <= 0 or keep_s < period_s:
            raise ValueError("need 0 < period_s <= keep_s")
        self.period_s = period_s
        self._clock = clock
        self._keep = int(keep_s / period_s) + 1
        self._times: list[float] = []
        self._total_ms: list[float] = []  # running sum of the kept lags
        self._task: asyncio.Task[None] | None = None

    def record(self, at: float, lag_ms: float) -> None:
        if self._times:
            at = max(at, self._times[-1])  # a wall clock stepped back keeps the order
        total = (self._total_ms[-1] if self._total_ms else 0.0) + max(0.0, lag_ms)
        self._times.append(at)
        self._total_ms.append(total)
        if len(self._times) >= 2 * self._keep:  # drop the older half: amortized O(1)
            dropped = self._total_ms[self._keep - 1]
            del self._times[:self._keep]
            self._total_ms = [t - dropped for t in self._total_ms[self._keep:]]

    def mean_ms(self, start: float, end: float) -> float | None:
        return mean_in_window(self._times, self._total_ms, start, end)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.period_s)
            slept = time.monotonic() - before
            self.record(self._clock(), (slept - self.period_s) * 1000)
