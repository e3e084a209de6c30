"""Per-API-key token rate limits: one token bucket per key, time from an injected clock.

A request is charged `prompt_tokens + max_tokens` when it is accepted (the most it can
cost) and refunded what it did not generate when it ends, so a key cannot overrun its
limit with long generations that are already running.

Lifecycle of a bucket: created full on a key's first request; refills continuously at
`tokens_per_min / 60` per second up to `tokens_per_min`. Buckets exist only for
configured keys (the open API has none), so their number is bounded by the key list.

Invariant: 0 <= level <= capacity for every bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    level: float
    updated_at: float


class TokenRateLimiter:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def try_consume(self, key_id: str, num_tokens: int, tokens_per_min: int) -> float | None:
        """Charge the key; None when allowed, else seconds until the charge would fit.

        A charge larger than the whole bucket can never fit; its wait is the time to fill
        the bucket, and the caller should tell the client to ask for fewer tokens.
        """
        bucket = self._refill(key_id, tokens_per_min)
        if num_tokens <= bucket.level:
            bucket.level -= num_tokens
            return None
        missing = min(num_tokens, tokens_per_min) - bucket.level
        return missing * 60.0 / tokens_per_min

    def refund(self, key_id: str, num_tokens: int, tokens_per_min: int) -> None:
        bucket = self._refill(key_id, tokens_per_min)
        bucket.level = min(float(tokens_per_min), bucket.level + max(0, num_tokens))

    def level(self, key_id: str, tokens_per_min: int) -> float:
        return self._refill(key_id, tokens_per_min).level

    def _refill(self, key_id: str, tokens_per_min: int) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(key_id)
        if bucket is None:
            bucket = self._buckets[key_id] = _Bucket(float(tokens_per_min), now)
        elapsed = max(0.0, now - bucket.updated_at)
        bucket.level = min(float(tokens_per_min), bucket.level + elapsed * tokens_per_min / 60.0)
        bucket.updated_at = now
        return bucket

    def check_invariants(self, capacities: dict[str, int]) -> None:
        for key_id, bucket in self._buckets.items():
            assert 0 <= bucket.level <= capacities[key_id], f"{key_id}: level {bucket.level}"
