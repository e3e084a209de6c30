"""Reservations waiting for free KV blocks, served in (priority, arrival) order.

A reservation that finds too few free blocks in the pool waits in this line instead of
failing at once (up to the `wait_ms` the gateway gave it); one that arrives while others
wait joins the line without trying. Only the head of the line tries the pool: a large
prompt is not passed over forever by smaller ones behind it, and a higher priority (larger
number, as everywhere in the protocol) goes first.

    join(priority) -> place       enter the line
    wait(place, timeout_s)        until woken (blocks may have been freed) or a poll interval
    is_head(place)                only the head tries to reserve
    leave(place)                  served, timed out or cancelled: the next head is woken

    reserve(engine, request, stopped)   all of the above for one ReserveRequest

The worker calls `notify()` whenever it frees blocks (a reservation released, a stream
ended); the poll interval covers frees it does not see (a request finishing inside the
engine). An abort of a waiting request (`cancel`) ends its wait at once. A wait cancelled
while its reserve command is on the engine thread queues a release right behind it (the
engine runs commands in order), so no blocks are left behind. The first try of a
reservation that finds nobody waiting is findable by `cancel` too: an abort that arrives
while that try is on the engine thread releases what it took. An abort that finds nothing
is remembered for `abort_memory_s` (at most `max_aborts_remembered` ids;
worker/recent_entries.py): a reservation
handled after its own abort (two calls need not be handled in the order they were sent)
is refused, not held until its timeout. Invariants
(check_invariants): the line is sorted by (-priority, arrival), holds each place once,
`_by_id` names exactly the places in line, and no first try is in line.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.messages import ReserveRequest
from protocol.worker_load import WorkerLoad
from worker.recent_entries import RecentEntries

if TYPE_CHECKING:
    from engine.engine_thread import EngineThread
    from engine.kv_cache import Reservation as BlockReservation


class ReservationAborted(Exception):
    """The reservation was cancelled (an abort) before it held its blocks."""


@dataclass(order=True, slots=True)
class Place:
    rank: tuple[int, int]  # (-priority, arrival): smallest first
    request_id: str = field(compare=False, default="")
    woken: asyncio.Event = field(compare=False, default_factory=asyncio.Event)
    cancelled: bool = field(compare=False, default=False)


class BlockWaiters:
    def __init__(self, poll_s: float = 0.05,
                 on_change: Callable[[int, str | None], None] | None = None,
                 abort_memory_s: float = 10.0, max_aborts_remembered: int = 4096) -> None:
        """`on_change(length, outcome)` after each join (outcome None) and each wait's end
        (outcome "served", "timed_out" or "cancelled"): the worker's metrics."""
        self.poll_s = poll_s
        # Aborts that found nothing: their reservations may still be on their way.
        self._aborted: RecentEntries[bool] = RecentEntries(abort_memory_s, max_aborts_remembered)
        self._on_change = on_change or (lambda length, outcome: None)
        self._line: list[Place] = []
        self._by_id: dict[str, Place] = {}
        self._trying: dict[str, Place] = {}  # first tries on the engine thread (not in line)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._line)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id or request_id in self._trying

    def join(self, priority: int, request_id: str = "") -> Place:
        place = Place((-priority, next(self._arrivals)), request_id)
        bisect.insort(self._line, place)
        if request_id:
            self._by_id[request_id] = place
        if self._line[0] is place:
            place.woken.set()  # a new head tries at once
        return place

    def leave(self, place: Place) -> None:
        """Idempotent; wakes the next head (what freed nothing for one may suffice for it)."""
        if place in self._line:
            self._line.remove(place)
        if self._by_id.get(place.request_id) is place:
            del self._by_id[place.request_id]
        self.notify()

    def cancel(self, request_id: str) -> bool:
        """End the wait of `request_id` (an abort); True when it was waiting."""
        place = self._by_id.get(request_id) or self._trying.get(request_id)
        if place is None:
            self._aborted.put(request_id, True, asyncio.get_running_loop().time())
            return False
        place.cancelled = True
        place.woken.set()
        return True

    def is_head(self, place: Place) -> bool:
        return bool(self._line) and self._line[0] is place

    def notify(self) -> None:
        if self._line:
            self._line[0].woken.set()

    async def wait(self, place: Place, timeout_s: float) -> None:
        """Until `place` is woken, a poll interval passes or `timeout_s` (whichever first)."""
        try:
            async with asyncio.timeout(max(0.0, min(timeout_s, self.poll_s))):
                await place.woken.wait()
        except TimeoutError:
            pass
        place.woken.clear()

    async def reserve(self, engine: EngineThread, request: ReserveRequest,
                      stopped: Callable[[], bool]) -> BlockReservation | None:
        """Blocks for the request's prompt now, or after waiting in line up to its
        `wait_ms`; None when none came in time (or `stopped()`). Raises ReservationAborted
        when `cancel`led, ValueError when the prompt can never fit the pool."""
        rid, prompt = request.request_id, request.prompt_token_ids
        if self._aborted.pop(rid, asyncio.get_running_loop().time()):
            raise ReservationAborted(f"{rid}: aborted before the reservation was handled")
        if not self._line:  # nobody waits: try at once (else a newcomer would pass the line)
            trying = self._trying[rid] = Place((0, 0), rid)
            try:
                held = await engine.call(lambda e: e.reserve(rid, prompt))
            except asyncio.CancelledError:
                engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
                raise
            finally:
                del self._trying[rid]
            if trying.cancelled:  # aborted while the try ran: give back what it took
                if held is not None:
                    engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
                raise ReservationAborted(f"{rid}: aborted while reserving")
            if held is not None:
                return held
        if request.wait_ms == 0:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + request.wait_ms / 1000
        place = self.join(request.priority, rid)
        self._on_change(len(self._line), None)
        outcome = "cancelled"
        try:
            while not place.cancelled and not stopped():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    outcome = "timed_out"
                    return None
                await self.wait(place, remaining)
                if self.is_head(place) and not place.cancelled:
                    held = await engine.call(lambda e: e.reserve(rid, prompt))
                    if held is not None:
                        outcome = "served"
                        return held
            if place.cancelled:
                raise ReservationAborted(f"{rid}: aborted while waiting for KV blocks")
            return None
        except asyncio.CancelledError:
            # A reserve command may be on the engine thread: free what it takes, after it.
            engine.submit(lambda e: e.release_reservation(rid), f"release {rid}")
            raise
        finally:
            self.leave(place)
            self._on_change(len(self._line), outcome)

    def check_invariants(self) -> None:
        assert self._line == sorted(self._line), "block waiters out of order"
        assert len({id(p) for p in self._line}) == len(self._line), "a waiter is in line twice"
        assert all(self._by_id.get(p.request_id) is p for p in self._line if p.request_id), \
            "a waiter in line is not findable by its request id"
        assert len(self._by_id) <= len(self._line), "a request id names no waiter in line"
        assert not any(p in self._line for p in self._trying.values()), "a first try in line"
        self._aborted.check_invariants()


def refusal(request: ReserveRequest, block_size: int, load: WorkerLoad) -> str:
    """The OVERLOADED message of a reservation that found no room (pure)."""
    num_used, num_total = load.num_kv_blocks_used, load.num_kv_blocks_total
    needed = -(-(len(request.prompt_token_ids) + 1) // block_size)
    waited = f" within {request.wait_ms} ms" if request.wait_ms else ""
    return (f"KV cache full: the prompt needs {needed} blocks, {num_total - num_used} of "
            f"{num_total} are free{waited}; retry later or on another worker")
