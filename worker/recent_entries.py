"""Entries a worker remembers for a short while: bounded in number and in age.

What it is for: a message handled before the one it belongs to (two calls need not be
handled in the order they were sent), kept until its partner comes: a DestinationNotice
before its PrefillRequest (worker/handoff.py), an abort before its
reservation (worker/block_waiters.py).

    put(key, value, now)   remember (again, as new); drops what is older than `max_age_s`,
                           then the oldest while `max_entries` are held
    pop(key, now)          the value, once, if it is at most `max_age_s` old; else None

Invariants (`check_invariants`): at most `max_entries` entries, in the order they were put.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class RecentEntries(Generic[V]):
    def __init__(self, max_age_s: float, max_entries: int) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, value: V, now: float) -> None:
        while self._entries and now - next(iter(self._entries.values()))[0] > self.max_age_s:
            self._entries.popitem(last=False)
        self._entries.pop(key, None)
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)  # the oldest: the least likely to be claimed
        self._entries[key] = (now, value)

    def pop(self, key: str, now: float) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None or now - entry[0] > self.max_age_s:
            return None
        return entry[1]

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_entries, f"{len(self._entries)} entries held"
        times = [put_at for put_at, _ in self._entries.values()]
        assert times == sorted(times), "entries out of the order they were put"
