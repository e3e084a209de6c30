"""Admission control: which requests start now, which wait, and which are turned away.

Owned by the gateway (one per process, not shared); all time comes from the injected
`clock` (monotonic seconds), so tests drive it by hand. The controller decides; the HTTP
layer carries out (answers 429 with Retry-After, wakes a waiting handler).

Lifecycle of a request:

    submit ──> ADMITTED (running) ──release/cancel──> gone
       │
       ├────> QUEUED ──(slot frees, picked)──> ADMITTED
       │        ├──expire (its tier's wait limit passed)──> REJECTED
       │        ├──shed (a more urgent tier needs the queue room)──> REJECTED
       │        └──cancel (client gone)──> gone
       └────> REJECTED (tier queue full / deadline unmeetable / no room)

Order: a slot goes to the queued request of the most urgent tier (smallest `priority`)
whose tier is under its own `max_running`, earliest TTFT deadline first. So a queued
interactive request is admitted before any queued batch request, and batch, capped by
its own `max_running`, cannot take every slot.

Early rejection: a request that must queue gets an estimate of its wait — the requests
ahead of it times the mean time between two slots freeing (mean running time / slots,
learned from releases). If `now + wait` is past its wait limit (`TierSpec.wait_limit_ms`:
the tier's `max_wait_ms`, by default its TTFT target) it is rejected at once (429,
Retry-After = the estimate) instead of being served later than that; a tier whose wait
limit is longer than its TTFT target is served late instead. Lower tiers have more
requests ahead, so under overload they are rejected first; when the shared queue is
full, an arrival sheds the least urgent queued request of a strictly lower tier. Queued
requests are ordered by TTFT deadline (arrival + target), whatever their wait limit.

Protection (`set_protection`, driven by gateway/admission/capacity.py only while the most
urgent tier is predicted or measured to miss its target): lower tiers may hold at most
`protected_share` of the slots, and a lower-tier arrival that cannot start at once is
rejected (429, reason "overload") instead of queueing behind the urgent tier. While the
urgent tier meets its target, a lower tier is refused only when its own wait cannot fit.

Invariants (`check_invariants`):
  * queued and running ids are disjoint; per-tier counts match the entries;
  * per tier, num_running <= max_running and num_queued <= max_queued;
  * work-conserving: while a slot is free, no tier with room has a queued request (room
    includes, under protection, the lower tiers' share).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.admission.tiers import TierSpec


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Rejected:
    request_id: str
    retry_after_s: float
    reason: str  # "tier_queue_full" | "queue_full" | "deadline" | "shed" | "overload"


@dataclass(frozen=True, slots=True)
class Queued:
    request_id: str
    expected_wait_s: float
    shed: tuple[Rejected, ...] = ()  # queued requests pushed out to make room for this one


@dataclass(slots=True)
class _TierState:
    spec: TierSpec
    heap: list[tuple[float, int, str]] = field(default_factory=list)  # (deadline, seq, id)
    num_queued: int = 0
    num_running: int = 0


@dataclass(frozen=True, slots=True)
class _Waiting:
    tier: str
    deadline: float  # TTFT deadline: the queue's order
    seq: int
    expires: float  # the wait limit: rejected when still queued then


class AdmissionController:
    def __init__(self, tiers: Sequence[TierSpec], max_running_total: int, max_queued_total: int,
                 clock: Callable[[], float], initial_service_s: float = 2.0,
                 service_ewma_alpha: float = 0.1, protected_share: float = 0.5) -> None:
        if max_running_total < 1 or max_queued_total < 0:
            raise ValueError("max_running_total must be >= 1 and max_queued_total >= 0")
        if not 0 <= protected_share <= 1:
            raise ValueError("protected_share must be in [0, 1]")
        self._tiers = {t.name: _TierState(t) for t in tiers}
        # Most urgent first; the stable sort keeps the given order among equal priorities.
        self._by_priority = sorted(self._tiers.values(), key=lambda s: s.spec.priority)
        self.max_running_total = max_running_total
        self.max_queued_total = max_queued_total
        self._clock = clock
        self._mean_service_s = initial_service_s
        self._alpha = service_ewma_alpha
        self._seq = itertools.count()
        self._waiting: dict[str, _Waiting] = {}
        self._running: dict[str, tuple[str, float]] = {}  # id -> (tier, admitted at)
        self._top_priority = self._by_priority[0].spec.priority if self._by_priority else 0
        self.protected_share = protected_share
        self.protecting = False

    # ------------------------------------------------------------ queries

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._waiting)

    def num_running_in(self, tier: str) -> int:
        return self._tiers[tier].num_running

    def num_queued_in(self, tier: str) -> int:
        return self._tiers[tier].num_queued

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def is_queued(self, request_id: str) -> bool:
        return request_id in self._waiting

    @property
    def mean_service_s(self) -> float:
        return self._mean_service_s

    @property
    def urgent_tiers(self) -> tuple[str, ...]:
        """The tiers of the most urgent priority: the ones protection serves."""
        return tuple(s.spec.name for s in self._by_priority
                     if s.spec.priority == self._top_priority)

    def num_queued_urgent(self) -> int:
        return sum(self._tiers[name].num_queued for name in self.urgent_tiers)

    def urgent_wait_s(self) -> float:
        """The queue wait of the most urgent tier's requests: 0 while none of them waits
        (they start at once, and their backend TTFT says how they fare), else the expected
        wait behind the queue (side-effect free)."""
        waits = [self._expected_wait_s(state) for state in self._by_priority
                 if state.spec.priority == self._top_priority and state.num_queued > 0]
        return max(waits, default=0.0)

    # ------------------------------------------------------------ commands

    def submit(self, request_id: str, tier: str) -> Admitted | Queued | Rejected:
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id} was already submitted")
        state = self._tiers[tier]  # KeyError: the caller classified against other tiers
        now = self._clock()
        deadline = now + state.spec.ttft_ms / 1000.0
        expires = now + state.spec.wait_limit_ms / 1000.0
        # Work-conserving state: while this tier has a free slot, nobody is queued who could
        # take it, so admitting now jumps no queue.
        if self._has_free_slot(state):
            self._start(request_id, tier, now)
            return Admitted(request_id)
        wait_s = self._expected_wait_s(state)
        if self.protecting and state.spec.priority != self._top_priority:
            return Rejected(request_id, max(1.0, wait_s), "overload")
        if state.num_queued >= state.spec.max_queued:
            return Rejected(request_id, wait_s, "tier_queue_full")
        if now + wait_s > expires:
            return Rejected(request_id, wait_s, "deadline")
        shed: tuple[Rejected, ...] = ()
        if self.num_queued >= self.max_queued_total:
            victim = self._least_urgent_queued(below_priority=state.spec.priority)
            if victim is None:
                return Rejected(request_id, wait_s, "queue_full")
            victim_tier = self._tiers[self._waiting[victim].tier]
            self._remove_waiting(victim)
            shed = (Rejected(victim, self._expected_wait_s(victim_tier), "shed"),)
        self._enqueue(request_id, state, deadline, expires)
        return Queued(request_id, wait_s, shed)

    def release(self, request_id: str) -> tuple[str, ...]:
        """A running request finished; returns the ids admitted into the freed slot(s)."""
        tier, admitted_at = self._running.pop(request_id)
        self._tiers[tier].num_running -= 1
        service_s = max(0.0, self._clock() - admitted_at)
        self._mean_service_s += self._alpha * (service_s - self._mean_service_s)
        return self._drain()

    def cancel(self, request_id: str) -> tuple[str, ...]:
        """The client went away: forget the request wherever it is; returns admitted ids."""
        if request_id in self._waiting:
            self._remove_waiting(request_id)
            return ()
        if request_id in self._running:
            tier, _ = self._running.pop(request_id)
            self._tiers[tier].num_running -= 1
            return self._drain()
        return ()

    def expire(self) -> tuple[Rejected, ...]:
        """Reject queued requests whose wait limit has passed (call it periodically)."""
        now = self._clock()
        late = [rid for rid, w in self._waiting.items() if w.expires <= now]
        for rid in late:
            self._remove_waiting(rid)
        return tuple(Rejected(rid, self._mean_service_s / self.max_running_total, "deadline")
                     for rid in late)

    def set_protection(self, on: bool) -> tuple[str, ...]:
        """Protect the most urgent tier (see the module docstring); never preempts.
        Returns the ids admitted when protection ends."""
        self.protecting = on
        return self._drain()

    def set_capacity(self, max_running_total: int) -> tuple[str, ...]:
        """The cluster grew or shrank. Never preempts; returns ids admitted by a larger one."""
        if max_running_total < 1:
            raise ValueError("max_running_total must be >= 1")
        self.max_running_total = max_running_total
        return self._drain()

    # ------------------------------------------------------------ internals

    def _has_free_slot(self, state: _TierState) -> bool:
        return (self.num_running < self.max_running_total
                and state.num_running < state.spec.max_running
                and self._within_share(state))

    def _within_share(self, state: _TierState) -> bool:
        """Under protection, lower tiers together stay within their share of the slots."""
        if not self.protecting or state.spec.priority == self._top_priority:
            return True
        lower = sum(s.num_running for s in self._by_priority
                    if s.spec.priority != self._top_priority)
        return lower < int(self.protected_share * self.max_running_total)

    def _queued_ahead(self, priority: int) -> int:
        return sum(s.num_queued for s in self._by_priority if s.spec.priority <= priority)

    def _expected_wait_s(self, state: _TierState) -> float:
        ahead = self._queued_ahead(state.spec.priority) + 1
        wait_s = ahead * self._mean_service_s / self.max_running_total
        if state.num_running >= state.spec.max_running > 0:
            tier_wait_s = (state.num_queued + 1) * self._mean_service_s / state.spec.max_running
            wait_s = max(wait_s, tier_wait_s)
        elif state.spec.max_running == 0:
            wait_s = float("inf")
        return wait_s

    def _start(self, request_id: str, tier: str, now: float) -> None:
        self._running[request_id] = (tier, now)
        self._tiers[tier].num_running += 1

    def _enqueue(self, request_id: str, state: _TierState, deadline: float,
                 expires: float) -> None:
        seq = next(self._seq)
        self._waiting[request_id] = _Waiting(state.spec.name, deadline, seq, expires)
        heapq.heappush(state.heap, (deadline, seq, request_id))
        state.num_queued += 1

    def _remove_waiting(self, request_id: str) -> None:
        # The heap entry stays and is skipped when popped (its id is no longer waiting).
        waiting = self._waiting.pop(request_id)
        self._tiers[waiting.tier].num_queued -= 1

    def _pop_head(self, state: _TierState) -> str | None:
        while state.heap:
            _, seq, rid = heapq.heappop(state.heap)
            waiting = self._waiting.get(rid)
            if waiting is not None and waiting.seq == seq:
                self._remove_waiting(rid)
                return rid
        return None

    def _drain(self) -> tuple[str, ...]:
        admitted = []
        now = self._clock()
        while self.num_running < self.max_running_total:
            candidates = [s for s in self._by_priority
                          if s.num_queued > 0 and s.num_running < s.spec.max_running
                          and self._within_share(s)]
            if not candidates:
                break
            top = candidates[0].spec.priority
            # Equal priorities: the earliest deadline across those tiers goes first.
            state = min((s for s in candidates if s.spec.priority == top),
                        key=lambda s: self._head_deadline(s))
            rid = self._pop_head(state)
            if rid is None:
                break
            self._start(rid, state.spec.name, now)
            admitted.append(rid)
        return tuple(admitted)

    def _head_deadline(self, state: _TierState) -> float:
        while state.heap:
            deadline, seq, rid = state.heap[0]
            waiting = self._waiting.get(rid)
            if waiting is not None and waiting.seq == seq:
                return deadline
            heapq.heappop(state.heap)
        return float("inf")

    def _least_urgent_queued(self, below_priority: int) -> str | None:
        for state in reversed(self._by_priority):
            if state.spec.priority <= below_priority:
                return None
            if state.num_queued:
                return max((rid for rid, w in self._waiting.items() if w.tier == state.spec.name),
                           key=lambda rid: (self._waiting[rid].deadline, self._waiting[rid].seq))
        return None

    def check_invariants(self) -> None:
        assert not (self._waiting.keys() & self._running.keys()), "request both queued and running"
        for name, state in self._tiers.items():
            queued = sum(1 for w in self._waiting.values() if w.tier == name)
            running = sum(1 for t, _ in self._running.values() if t == name)
            assert state.num_queued == queued, f"{name}: num_queued {state.num_queued} != {queued}"
            assert state.num_running == running, f"{name}: num_running {state.num_running} != {running}"
            assert running <= state.spec.max_running, f"{name}: over its max_running"
            assert queued <= state.spec.max_queued, f"{name}: over its max_queued"
        assert self.num_queued <= self.max_queued_total, "over max_queued_total"
        if self.num_running < self.max_running_total:
            for state in self._tiers.values():
                assert not (state.num_queued and state.num_running < state.spec.max_running
                            and self._within_share(state)), \
                    f"{state.spec.name}: queued while a slot is free"
