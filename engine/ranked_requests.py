"""The scheduler's running requests, kept in rank order as they come and go.

Every step seats the best-ranked running requests (engine/scheduler.py) and a request
that needs a block and finds none preempts the worst-ranked one. A request's rank key is
fixed when it registers (engine/request_rank.py), so the order changes only when one
joins or leaves: it is kept here, sorted on insertion, instead of sorted again at every
step (a sort of 256 requests cost about 50 us a step).

    add(request, key) ──▶ [ best ... worst ] ──remove(request)──▶
                             best(n): the first n    worst(): the last

Invariants (`check_invariants`): the ranked list holds exactly the mapping's requests,
each once, in increasing key order.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator

from engine.request import Request

RankKey = tuple[int, float, int]  # smaller is better; unique per request (request_rank.py)


class RankedRequests:
    def __init__(self) -> None:
        self._by_id: dict[str, Request] = {}
        self._keys: list[RankKey] = []  # sorted; _ranked[i] has key _keys[i]
        self._ranked: list[Request] = []

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def values(self) -> Iterator[Request]:
        return iter(self._ranked)

    def add(self, request: Request, key: RankKey) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"{request.request_id} is already running")
        at = bisect_right(self._keys, key)
        self._keys.insert(at, key)
        self._ranked.insert(at, request)
        self._by_id[request.request_id] = request

    def remove(self, request: Request) -> None:
        """`request` leaves (KeyError if it is not the one running under its id)."""
        if self._by_id.get(request.request_id) is not request:
            raise KeyError(f"{request.request_id} is not running")
        at = self._ranked.index(request)  # requests compare by identity
        del self._keys[at], self._ranked[at], self._by_id[request.request_id]

    def best(self, n: int) -> list[Request]:
        """The n best-ranked, best first (a copy: the caller may add and remove meanwhile)."""
        return self._ranked[:n]

    def worst(self) -> Request:
        """The worst-ranked (IndexError when none runs)."""
        return self._ranked[-1]

    def check_invariants(self) -> None:
        assert len(self._keys) == len(self._ranked) == len(self._by_id), "sizes disagree"
        assert self._keys == sorted(self._keys), "not in rank order"
        assert all(self._by_id.get(r.request_id) is r for r in self._ranked), \
            "the ranked list and the mapping hold different requests"
