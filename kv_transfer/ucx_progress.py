"""Progress of one ucxx worker on the event loop, asleep on the worker's epoll fd when idle.

Why not ucxx's own "blocking" progress mode: it arms the worker (`ucp_worker_arm`) once,
at start-up, and never again, so after the first event its epoll fd stays readable and the
loop calls the reader on every iteration: a worker that has moved one transfer then uses a
whole core while idle. This driver re-arms after every burst of activity, as UCX requires:

    fd readable ──▶ progress ──▶ arming task: progress once per loop iteration (ready
                                 callbacks run and I/O is polled in between) until
                                 `linger_s` has passed since the last activity, then
                                 arm(); busy (events pending) ──▶ again; armed ──▶ done:
                                 the fd wakes the loop at the next event

Lingering keeps a transfer's messages flowing without an epoll wake-up per message (the
throughput of polling while there is work), and costs nothing once the worker sleeps.
    kick() (an operation was posted) ──▶ progress at once ──▶ arming task as above
    every `safety_period_s` ──▶ the same, in case an event was missed (bounded, not a spin)

Lifecycle: created with the worker (start) → ... → stop(): the reader, the timer and the
arming task are removed; the worker is not progressed any more.

Invariants (`check_invariants`): at most one arming task exists; the fd reader is registered
exactly while the worker is armed (asleep), never while the arming task runs; while started
the safety timer is pending.
"""

from __future__ import annotations

import asyncio

from ucxx._lib.libucxx import UCXWorker


class BlockingProgress:
    def __init__(self, worker: UCXWorker, loop: asyncio.AbstractEventLoop,
                 safety_period_s: float = 1.0, linger_s: float = 0.02) -> None:
        self._worker = worker
        self._loop = loop
        self._safety_period_s = safety_period_s
        self._linger_s = linger_s
        self._active_until = loop.time() + linger_s
        worker.init_blocking_progress_mode()
        self._fd: int = worker.epoll_file_descriptor
        self._arming: asyncio.Task[None] | None = None
        self._reading = False  # the fd reader is registered (only while armed)
        self._started = True
        self.num_wakeups = 0  # fd events and kicks handled
        self.num_progress_calls = 0
        self._timer: asyncio.TimerHandle | None = loop.call_later(safety_period_s, self._tick)
        self._wake()

    @property
    def is_armed(self) -> bool:
        """True when asleep: the next UCX event (and nothing else) wakes the loop."""
        return self._reading

    def kick(self) -> None:
        """An operation was posted: move it along now, and re-arm once idle again."""
        if self._started:
            self._wake()

    def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self._stop_reading()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._arming is not None:
            self._arming.cancel()
            self._arming = None

    def _wake(self) -> None:
        """Activity: progress now, keep progressing until idle for `linger_s`, then arm.

        Unarmed, the fd stays readable, so the reader is off until the worker is armed."""
        self.num_wakeups += 1
        self._active_until = self._loop.time() + self._linger_s
        self._stop_reading()
        self._progress()
        if self._arming is None or self._arming.done():
            self._arming = self._loop.create_task(self._arm(), name="ucx-arm")

    def _tick(self) -> None:
        self._timer = self._loop.call_later(self._safety_period_s, self._tick)
        if self._reading:  # asleep: make sure no event was missed
            self._progress()
            if not self._worker.arm():
                self._wake()

    async def _arm(self) -> None:
        while self._started:
            self._progress()
            await asyncio.sleep(0)  # one loop iteration: ready callbacks run, I/O is polled
            if self._loop.time() < self._active_until:
                continue  # recent activity: more is likely to follow at once
            if self._worker.arm():
                self._start_reading()
                return

    def _progress(self) -> None:
        self.num_progress_calls += 1
        self._worker.progress()

    def _start_reading(self) -> None:
        if not self._reading:
            self._loop.add_reader(self._fd, self._wake)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False

    def check_invariants(self) -> None:
        arming = self._arming is not None and not self._arming.done()
        assert not (arming and self._reading), "reading the fd while not armed"
        if self._started:
            assert self._timer is not None, "the safety timer is gone"
            assert arming or self._reading, "neither armed nor arming: nothing progresses"
