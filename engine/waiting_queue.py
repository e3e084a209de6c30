"""The scheduler's waiting queue: WAITING and PREEMPTED requests, in prefill order.

A heap of (prefill key, request) (engine/request_rank.py: a waiting request's key does not
change while it waits) with lazy deletion: a request that leaves the queue other than by
`pop` (aborted or ended while waiting) is `forget`-ed, which only counts it out; its entry
stays in the heap until it reaches the top, where `head` drops it, its status no longer
being a waiting one (the scheduler sets a leaving request's status right after).

    push ──▶ [heap] ──head()──▶ the first waiting request ──pop()──▶ admitted
               │  forget(request): counted out at once, its entry dropped at the top later

Invariants (`check_invariants`): the entries whose request still waits are distinct
requests, `len` of them, none of which has computed anything or holds a block table; each
is queued under its current key.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from engine.request import Request, RequestStatus
from engine.request_rank import PrefillKey

WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[PrefillKey, Request]] = []
        self._num_live = 0

    def __len__(self) -> int:
        """Requests waiting (not the heap's entries, stale ones included)."""
        return self._num_live

    def push(self, key: PrefillKey, request: Request) -> None:
        """Queue a WAITING or PREEMPTED request under its key (smaller: earlier)."""
        heapq.heappush(self._heap, (key, request))
        self._num_live += 1

    def head(self) -> Request | None:
        """The first waiting request, left in the queue; None when none waits."""
        entry = self.head_entry()
        return None if entry is None else entry[1]

    def head_entry(self) -> tuple[PrefillKey, Request] | None:
        """The first waiting request with its key, left in the queue; None when none waits."""
        heap = self._heap
        while heap:
            if heap[0][1].status in WAITING_STATES:
                return heap[0]
            heapq.heappop(heap)  # left while waiting: dropped now
        return None

    def pop(self) -> Request:
        """Take the head out (it is being admitted). Precondition: `head()` is not None."""
        request = heapq.heappop(self._heap)[1]
        assert request.status in WAITING_STATES, "pop() without a waiting head"
        self._num_live -= 1
        return request

    def forget(self, request: Request) -> None:
        """`request`, still waiting, leaves otherwise than by `pop`; the caller sets its new
        status next, which makes its entry stale."""
        assert request.status in WAITING_STATES, f"{request.request_id} is not waiting"
        self._num_live -= 1

    def waiting(self) -> list[Request]:
        """The requests that still wait, in heap order."""
        return [r for _, r in self.entries()]

    def entries(self) -> list[tuple[PrefillKey, Request]]:
        """The requests that still wait with their keys, in heap order."""
        return [(k, r) for k, r in self._heap if r.status in WAITING_STATES]

    def check_invariants(self, key_of: Callable[[Request], PrefillKey] | None = None) -> None:
        """`key_of`: the owner's key of a request, which each waiting one must be queued
        under (it has computed nothing, so holds nothing)."""
        entries = self.entries()
        assert len(entries) == len({id(r) for _, r in entries}) == self._num_live, \
            "the waiting queue's entries and its count disagree"
        for key, request in entries:
            assert request.num_computed_tokens == 0 and not request.block_ids
            assert key_of is None or key == key_of(request), "queued under a stale key"
