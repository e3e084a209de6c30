"""The scheduler's waiting queue: WAITING and PREEMPTED requests, best rank first.

A heap of (rank key, request) with lazy deletion: a request that leaves the queue other
than by `pop` (aborted or ended while waiting) is `forget`-ed, which only counts it out;
its entry stays in the heap until it reaches the top, where `head` drops it, its status no
longer being a waiting one (the scheduler sets a leaving request's status right after).

    push ──▶ [heap] ──head()──▶ the best waiting request ──pop()──▶ admitted
               │  forget(request): counted out at once, its entry dropped at the top later

Invariants (`check_invariants`): the entries whose request still waits are distinct
requests, `len` of them.
"""

from __future__ import annotations

import heapq

from engine.request import Request, RequestStatus

WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._num_live = 0

    def __len__(self) -> int:
        """Requests waiting (not the heap's entries, stale ones included)."""
        return self._num_live

    def push(self, key: tuple[int, float, int], request: Request) -> None:
        """Queue a WAITING or PREEMPTED request under its rank key (smaller: better)."""
        heapq.heappush(self._heap, (key, request))
        self._num_live += 1

    def head(self) -> Request | None:
        """The best-ranked waiting request, left in the queue; None when none waits."""
        heap = self._heap
        while heap:
            request = heap[0][1]
            if request.status in WAITING_STATES:
                return request
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
        return [r for _, r in self._heap if r.status in WAITING_STATES]

    def check_invariants(self) -> None:
        waiting = self.waiting()
        assert len(waiting) == len({id(r) for r in waiting}) == self._num_live, \
            "the waiting queue's entries and its count disagree"
