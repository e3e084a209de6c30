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
from collections import OrderedDict

from common.contract.protocol import DecodeDestination


class FollowingDestinations:
    def __init__(self, hold_s: float = 10.0, max_held: int = 4096) -> None:
        self.hold_s = hold_s
        self.max_held = max_held
        self._waiting: dict[str, asyncio.Future[DecodeDestination]] = {}
        self._held: OrderedDict[str, tuple[float, DecodeDestination]] = OrderedDict()

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
        held = self._held.pop(request_id, None)
        if held is not None and now - held[0] <= self.hold_s:
            future.set_result(held[1])
        self._waiting[request_id] = future
        return future

    def deliver(self, request_id: str, destination: DecodeDestination, now: float) -> bool:
        """Hand `destination` to the prefill waiting for it (True), or hold it (False)."""
        future = self._waiting.get(request_id)
        if future is not None:
            if not future.done():
                future.set_result(destination)
            return True
        self._expire(now)
        self._held.pop(request_id, None)
        while len(self._held) >= self.max_held:
            self._held.popitem(last=False)  # the oldest: its request is the least likely to come
        self._held[request_id] = (now, destination)
        return False

    def forget(self, request_id: str) -> None:
        """The prefill of `request_id` ended: nobody waits for its destination any more."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def _expire(self, now: float) -> None:
        while self._held:
            request_id, (held_at, _) = next(iter(self._held.items()))
            if now - held_at <= self.hold_s:
                return
            del self._held[request_id]

    def check_invariants(self) -> None:
        both = self._waiting.keys() & self._held.keys()
        assert not both, f"waiting and held at once: {sorted(both)[:5]}"
        assert len(self._held) <= self.max_held, f"{len(self._held)} notices held"
        times = [held_at for held_at, _ in self._held.values()]
        assert times == sorted(times), "held notices out of arrival order"
