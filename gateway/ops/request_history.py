"""The gateway's memory of finished requests, for the cluster page (gateway/ops/cluster_page.py):
per-tier outcome counts in fixed time buckets, and the last requests that did not meet
their targets (slow, refused, failed or aborted) with their stage timelines.

    observe(record, now_unix_s)   one finished request (gateway/api/request_trace.py's record)
    attainment(now_unix_s)        the last `num_buckets` buckets, oldest first, each
                                  {tier: OutcomeCounts}; empty buckets included
    window_s(now_unix_s)          the time those counts cover (less for a young gateway,
                                  so a rate over it is not diluted by time it did not run)
    recent()                      the last `max_recent` requests that missed, newest first

Bounded: at most `num_buckets` buckets and `max_recent` records, whatever the traffic.
Invariant (`check_invariants`): bucket starts are distinct multiples of `bucket_s`, kept
in order, and none is older than the window.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

from gateway.api.request_trace import RequestRecord

MET = frozenset({"met"})
MISSED = frozenset({"missed_ttft", "missed_tpot", "missed_both"})
REFUSED = frozenset({"rejected", "shed"})


class OutcomeCounts(msgspec.Struct):
    met: int = 0
    missed: int = 0  # finished late (TTFT, TPOT or both)
    refused: int = 0  # 429: rejected or shed
    failed: int = 0  # 503s, errors, clients gone

    def add(self, outcome: str) -> None:
        if outcome in MET:
            self.met += 1
        elif outcome in MISSED:
            self.missed += 1
        elif outcome in REFUSED:
            self.refused += 1
        else:
            self.failed += 1


class Bucket(msgspec.Struct):
    start_unix_s: int
    tiers: dict[str, OutcomeCounts]


class RequestHistory:
    def __init__(self, bucket_s: int = 10, num_buckets: int = 30, max_recent: int = 40,
                 started_unix_s: float | None = None) -> None:
        """`started_unix_s`: when counting began (default: now)."""
        if bucket_s < 1 or num_buckets < 1 or max_recent < 0:
            raise ValueError("bucket_s and num_buckets must be >= 1, max_recent >= 0")
        self.started_unix_s = time.time() if started_unix_s is None else started_unix_s
        self.bucket_s, self.num_buckets = bucket_s, num_buckets
        self._buckets: deque[Bucket] = deque()
        self._recent: deque[RequestRecord] = deque(maxlen=max_recent)

    def _start(self, now_unix_s: float) -> int:
        return int(now_unix_s // self.bucket_s) * self.bucket_s

    def _expire(self, now_unix_s: float) -> None:
        oldest = self._start(now_unix_s) - (self.num_buckets - 1) * self.bucket_s
        while self._buckets and self._buckets[0].start_unix_s < oldest:
            self._buckets.popleft()

    def observe(self, record: RequestRecord, now_unix_s: float) -> None:
        self._expire(now_unix_s)
        start = self._start(now_unix_s)
        if not self._buckets or self._buckets[-1].start_unix_s < start:
            self._buckets.append(Bucket(start, {}))
        # A clock that stepped back lands in the newest bucket rather than reordering them.
        bucket = self._buckets[-1]
        bucket.tiers.setdefault(record.tier, OutcomeCounts()).add(record.outcome)
        if record.outcome not in MET:
            self._recent.append(record)

    def attainment(self, now_unix_s: float) -> list[Bucket]:
        self._expire(now_unix_s)
        kept = {b.start_unix_s: b for b in self._buckets}
        newest = self._start(now_unix_s)
        starts = range(newest - (self.num_buckets - 1) * self.bucket_s, newest + 1, self.bucket_s)
        return [kept.get(start) or Bucket(start, {}) for start in starts]

    def window_s(self, now_unix_s: float) -> float:
        """The seconds the counts cover: the whole window, or less since counting began."""
        return max(0.0, min(self.num_buckets * self.bucket_s, now_unix_s - self.started_unix_s))

    def recent(self) -> list[RequestRecord]:
        return list(reversed(self._recent))

    def check_invariants(self) -> None:
        starts = [b.start_unix_s for b in self._buckets]
        assert starts == sorted(set(starts)), f"buckets out of order: {starts}"
        assert all(s % self.bucket_s == 0 for s in starts), "a bucket off the grid"
        assert len(starts) <= self.num_buckets, "more buckets than the window holds"
