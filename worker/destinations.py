"""Destinations that follow their PrefillRequest (`destination_follows`).

The gateway sends the ReserveRequest to the decode worker and the PrefillRequest to this
worker at once; the decode worker's answer (where the KV goes) reaches here later, in a
DestinationNotice, while the prompt computes. The push waits for it; nothing else does
(the first token is sent as soon as it is sampled).

Lifecycle of one request's destination:

    expect(rid) ─▶ WAITING (a future) ─ deliver(rid, d) ─▶ KNOWN (the future's result)
                                      └ forget(rid) (the prefill stream ended) ─▶ gone
    deliver(rid, d) before expect(rid) ─▶ HELD (the notice overtook its request: two
        calls, handled by two tasks) ─ expect(rid) within `hold_s` ─▶ KNOWN;  else dropped

Invariants (`check_invariants`): a request id is never both waiting and held; at most
`max_held` notices are held, each for at most `hold_s`.
"""

from __future__ import annotations

import asyncio

from protocol.messages import DecodeDestination
from worker.recent_entries import RecentEntries


class FollowingDestinations:
    def __init__(self, hold_s: float = 10.0, max_held: int = 4096) -> None:
        self._waiting: dict[str, asyncio.Future[DecodeDestination]] = {}
        self._held: RecentEntries[DecodeDestination] = RecentEntries(hold_s, max_held)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def expect(self, request_id: str, now: float) -> asyncio.Future[DecodeDestination]:
        """The future of `request_id`'s destination (already done if its notice came first)."""
        if request_id in self._waiting:
            raise ValueError(f"{request_id}: a destination is already expected")
        future: asyncio.Future[DecodeDestination] = asyncio.get_running_loop().create_future()
        held = self._held.pop(request_id, now)
        if held is not None:
            future.set_result(held)
        self._waiting[request_id] = future
        return future

    def deliver(self, request_id: str, destination: DecodeDestination, now: float) -> bool:
        """Hand `destination` to the prefill waiting for it (True), or hold it (False)."""
        future = self._waiting.get(request_id)
        if future is not None:
            if not future.done():
                future.set_result(destination)
            return True
        self._held.put(request_id, destination, now)
        return False

    def forget(self, request_id: str) -> None:
        """The prefill of `request_id` ended: nobody waits for its destination any more."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def check_invariants(self) -> None:
        both = [request_id for request_id in self._waiting if request_id in self._held]
        assert not both, f"waiting and held at once: {sorted(both)[:5]}"
        self._held.check_invariants()
