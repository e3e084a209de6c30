"""The gateway's requests in flight, and how it stops without cutting a stream silently.

Lifecycle:

    SERVING ──begin()──▶ DRAINING: the listening socket is closed (by the caller); a new
                         request on a kept-alive connection gets 503 "shutting down";
                         running requests go on
            ──(all done, or the drain timeout)──▶ CUTTING: each request still running is
                         cancelled with SHUTDOWN; a stream answers it with an error event
                         and [DONE], a non-streamed request with a 503 body
            ──(each handler finished, bounded)──▶ STOPPED

Invariants (`check_invariants`): a handler task is in `_tasks` exactly while it runs
inside `track()`; once draining, nothing new is tracked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)

SHUTDOWN = "pdserve gateway shutting down"  # the cancellation message of a cut request


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.cutting = False
        self._tasks: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Wrap one request's handling (the caller checked `draining` first)."""
        task = asyncio.current_task()
        assert task is not None and not self.draining
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._tasks.discard(task)
            if not self._tasks:
                self._idle.set()

    def was_cut(self) -> bool:
        """In a handler catching CancelledError: True when the drain cut it (then it may
        answer the client instead of dying); the cancellation is taken back."""
        task = asyncio.current_task()
        if not self.cutting or task is None or task not in self._tasks:
            return False
        task.uncancel()
        return True

    async def drain(self, timeout_s: float, cut_timeout_s: float = 5.0) -> int:
        """Stop taking requests, wait up to `timeout_s` for the running ones, then cut the
        rest; returns how many were cut."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except TimeoutError:
            pass
        self.cutting = True
        late = list(self._tasks)
        log.warning("drain timeout (%.0f s): ending %d request(s) early", timeout_s, len(late))
        for task in late:
            task.cancel(SHUTDOWN)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), cut_timeout_s)
        return len(late)

    def check_invariants(self) -> None:
        for task in self._tasks:
            assert not task.done(), "a finished handler is still tracked"
        assert self._idle.is_set() == (not self._tasks)
