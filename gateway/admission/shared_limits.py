"""Admission limits shared by every gateway replica of a cluster, through Redis.

Each replica keeps its own admission controller (gateway/admission/admission.py: priorities, its
queue, early rejection); what must hold for the cluster as a whole is checked here, in
Redis (gateway/admission/limit_store.py): a tier's `max_running` and `max_queued`, the concurrency
limit over all tiers, and every API key's `tokens_per_min`. So N replicas together admit
what one would.

    slot:   acquire() ─ Redis: admitted ─────────────────────────────> held
                      ├ Redis: queued ── ask again every poll_s ──> held | refused (wait
                      │                                             limit, queue full)
                      └ Redis lost or slower than op_timeout_s ──> the local fallback
            release() ─> held no more; the sync task drops it in Redis (at once, batched)
    tokens: charge() in Redis (or the local fallback); refund() batched by the sync task

The sync task (one per replica, `start`/`stop`) sends releases and refunds as soon as
there are any (a lone replica's releases wait for the next renewal), and every
`sync_period_s` renews this replica's leases (`lease_s`) and its own entry in the gateway
list, which says how many replicas are live. A replica that dies frees its slots when
their leases lapse.

Solo fast path: while this replica is the only one live in Redis and was started as the
only one (`replicas_hint` 1, the default of a single gateway), its own admission
controller already enforces every limit exactly, so `acquire` and `charge` decide locally
without a round trip; the slots it holds are still published by the sync, so a replica
that joins counts them. Error: until this replica's next sync sees the newcomer (one
period), both admit on their own.

Fallback: while Redis is unreachable (or slower than `op_timeout_s`), each replica admits
up to 1/N of every limit on its own (`fallback_limit`: N = the replicas last seen live,
at least `replicas_hint`), so the cluster stays within the limits instead of admitting
without any. `mode` says which one is in force (/ready, /metrics). The sync task keeps
trying Redis; on the first success the replica's held slots are written back (renewed as
if new) and shared admission resumes. Error while switching: slots admitted on the
fallback count in Redis from the next sync, so the cluster can exceed a limit by at most
what the replicas admitted locally, until those requests end.

Invariants (`check_invariants`): a request id is held at most once (`_held` is keyed by
it); waiting counts are never negative; the releases kept for Redis are bounded; nothing
here waits on Redis without a deadline.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from gateway.admission.limit_store import LimitStore, SyncBatch
from gateway.admission.rate_limit import TokenRateLimiter
from gateway.admission.tiers import TierSpec
from state.redis_state import REDIS_FAILURES, raise_if_cancelling

log = logging.getLogger(__name__)

MAX_POLL_S = 0.25  # the longest a waiter goes without asking Redis again
MAX_PENDING_RELEASES = 10_000  # releases kept for a Redis that is away


class LimitMode(enum.StrEnum):
    SHARED = "shared"  # limits held in Redis, across every replica
    SOLO = "solo"  # the only replica: its own limits are the cluster's (slots published)
    LOCAL = "local"  # Redis unreachable: this replica alone, 1/N of each limit


@dataclass(frozen=True, slots=True)
class SlotRefused:
    reason: str  # "tier_queue_full" | "deadline"
    retry_after_s: float


def fallback_limit(limit: int, num_replicas: int) -> int:
    """One replica's share of a cluster limit while Redis is unreachable: the floor of
    1/N (N replicas never admit more than the limit together), at least 1 where the limit
    admits anything."""
    if limit <= 0:
        return 0
    return max(1, limit // max(1, num_replicas))


class SharedLimits:
    def __init__(self, store: LimitStore, clock: Callable[[], float], replicas_hint: int = 1,
                 gateway_id: str | None = None, lease_s: float = 10.0,
                 sync_period_s: float = 1.0, poll_s: float = 0.02) -> None:
        if replicas_hint < 1:
            raise ValueError("replicas_hint must be >= 1")
        self._store = store
        self._clock = clock
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self.replicas_hint = replicas_hint
        self.num_replicas_seen = 0  # live replicas in the last successful sync
        self._lease_ms = int(lease_s * 1000)
        self._sync_period_s = sync_period_s
        self._poll_s = poll_s
        self.mode = LimitMode.SHARED
        self._held: dict[str, str] = {}  # request id -> tier
        self._num_waiting: Counter[str] = Counter()  # waiting for a slot, by tier
        self._released: list[tuple[str, str]] = []  # (tier, member) to drop in Redis
        self._refunds: list[tuple[str, int, int]] = []
        self._local_tokens = TokenRateLimiter(clock)  # the fallback's buckets
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def num_replicas(self) -> int:
        """The N of the fallback's 1/N."""
        return max(self.replicas_hint, self.num_replicas_seen)

    @property
    def solo(self) -> bool:
        """The solo fast path is in force (see the module docstring)."""
        return (self.mode is LimitMode.SHARED and self.replicas_hint == 1
                and self.num_replicas_seen == 1)

    def status(self) -> dict[str, object]:
        mode = LimitMode.SOLO if self.solo else self.mode
        return {"mode": mode.value, "replicas": self.num_replicas,
                "gateway_id": self.gateway_id}

    # ------------------------------------------------------------ slots

    async def acquire(self, request_id: str, tier: TierSpec, max_running_total: int,
                      mean_service_s: float) -> SlotRefused | None:
        """Wait for a cluster-wide slot of `tier`; None once held (then `release` it
        exactly once), else why not. Gives up at the tier's wait limit."""
        if request_id in self._held:
            raise ValueError(f"request {request_id} already holds a slot")
        if self.solo:
            self._held[request_id] = tier.name
            return None
        member = f"{self.gateway_id}/{request_id}"
        deadline = self._clock() + tier.wait_limit_ms / 1000.0
        held = False
        self._num_waiting[tier.name] += 1
        try:
            while True:
                answer, num_ahead = await self._try_acquire(member, tier, max_running_total,
                                                            deadline)
                if answer is True:
                    held = True
                    self._held[request_id] = tier.name
                    return None
                if answer is False:
                    return SlotRefused("tier_queue_full", self._retry_after_s(tier, mean_service_s))
                if self._clock() >= deadline:
                    return SlotRefused("deadline", self._retry_after_s(tier, mean_service_s))
                # Far back in the line, ask less often: Redis serves every replica's waiters.
                rounds_ahead = num_ahead // max(1, tier.max_running)
                await asyncio.sleep(min(MAX_POLL_S, self._poll_s * (1 + rounds_ahead)))
        finally:
            self._num_waiting[tier.name] -= 1
            if not held:
                # Whatever Redis holds for it (a queue entry, or a slot granted in the same
                # instant the wait was abandoned) goes with the next sync.
                self._queue_release(tier.name, member)

    def release(self, request_id: str) -> None:
        tier = self._held.pop(request_id)  # KeyError: released twice, or never held
        self._queue_release(tier, f"{self.gateway_id}/{request_id}")

    async def _try_acquire(self, member: str, tier: TierSpec, max_running_total: int,
                           deadline: float) -> tuple[bool | None, int]:
        """(True: admitted | False: refused, the queue is full | None: ask again, and how
        many wait ahead)."""
        if self.mode is LimitMode.SHARED:
            try:
                answer = await self._store.acquire(
                    tier.name, member, tier.max_running, tier.max_queued, max_running_total,
                    self._lease_ms, int((deadline - self._clock()) * 1000))
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                self._fall_back(exc)
            else:
                return {1: True, -1: False}.get(answer.state), answer.num_ahead
        # The fallback (rare): counted from what this replica holds.
        num_in_tier = sum(1 for held_tier in self._held.values() if held_tier == tier.name)
        if (num_in_tier < fallback_limit(tier.max_running, self.num_replicas)
                and len(self._held) < fallback_limit(max_running_total, self.num_replicas)):
            return True, 0
        num_ahead = self._num_waiting[tier.name] - 1
        if num_ahead >= fallback_limit(tier.max_queued, self.num_replicas):
            return False, num_ahead
        return None, num_ahead

    def _retry_after_s(self, tier: TierSpec, mean_service_s: float) -> float:
        per_slot_s = mean_service_s / max(1, tier.max_running)
        return max(1.0, (self._num_waiting[tier.name] + 1) * per_slot_s)

    # ------------------------------------------------------------ token rates

    async def charge(self, key_id: str, num_tokens: int, tokens_per_min: int) -> float | None:
        """Charge a key for a request; None when allowed, else seconds until it fits."""
        if self.mode is LimitMode.SHARED and not self.solo:
            try:
                return await self._store.charge(key_id, num_tokens, tokens_per_min)
            except REDIS_FAILURES as exc:
                raise_if_cancelling(exc)
                self._fall_back(exc)
        return self._local_tokens.try_consume(key_id, num_tokens,
                                              self._local_rate(tokens_per_min))

    def refund(self, key_id: str, num_tokens: int, tokens_per_min: int) -> None:
        if num_tokens <= 0:
            return
        if self.mode is LimitMode.SHARED and not self.solo:
            self._refunds.append((key_id, num_tokens, tokens_per_min))
            self._wake.set()
        else:
            self._local_tokens.refund(key_id, num_tokens, self._local_rate(tokens_per_min))

    def _local_rate(self, tokens_per_min: int) -> int:
        """The rate of the local buckets: all of it alone (solo), 1/N on the fallback."""
        return tokens_per_min if self.solo else max(1, tokens_per_min // self.num_replicas)

    # ------------------------------------------------------------ the sync task

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="shared-limits-sync")

    async def stop(self) -> None:
        """Cancel the sync task, then hand back this replica's slots (one last try)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for request_id in list(self._held):
            self.release(request_id)
        if self._released or self._refunds:
            try:
                await self.sync_once(renew=False)
            except REDIS_FAILURES:
                pass  # their leases lapse instead

    async def _run(self) -> None:
        next_renewal = 0.0
        while True:
            renew = self._clock() >= next_renewal
            if renew or self.mode is LimitMode.SHARED:  # on the fallback: once a period
                try:
                    await self.sync_once(renew=renew)
                except REDIS_FAILURES as exc:
                    raise_if_cancelling(exc)
                    self._fall_back(exc)
                raise_if_cancelling()  # a stop that redis-py swallowed
            if renew:
                next_renewal = self._clock() + self._sync_period_s
            self._wake.clear()
            wait_s = max(0.0, next_renewal - self._clock())
            if self.mode is LimitMode.LOCAL:
                await asyncio.sleep(wait_s)
                continue
            try:
                async with asyncio.timeout(wait_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def sync_once(self, renew: bool) -> None:
        """Send what was released and refunded; with `renew`, also renew (or write back)
        every held slot and this replica's entry. Raises one of REDIS_FAILURES; what was
        taken from the lists then goes back to them."""
        released, self._released = self._released, []
        refunds, self._refunds = self._refunds, []
        held = ([(tier, f"{self.gateway_id}/{rid}") for rid, tier in self._held.items()]
                if renew else [])
        try:
            num_live = await self._store.sync(self.gateway_id, self._lease_ms,
                                              SyncBatch(released, held, refunds))
        except BaseException:
            self._released[:0] = released
            self._refunds[:0] = refunds
            raise
        self.num_replicas_seen = num_live
        if self.mode is LimitMode.LOCAL and renew:
            log.warning("Redis is reachable again: admission limits are shared by the %d "
                        "gateway replica(s) again", num_live)
            self.mode = LimitMode.SHARED

    def _queue_release(self, tier: str, member: str) -> None:
        # Kept while Redis is away too (sent when it is back), but only the newest: older
        # entries' leases have lapsed by then anyway.
        self._released.append((tier, member))
        if len(self._released) > MAX_PENDING_RELEASES:
            del self._released[:len(self._released) - MAX_PENDING_RELEASES]
        if not self.solo:  # alone, nobody waits for it: it goes with the next renewal
            self._wake.set()

    def _fall_back(self, exc: BaseException) -> None:
        if self.mode is LimitMode.SHARED:
            self.mode = LimitMode.LOCAL
            log.warning("Redis unreachable or slow (%s): each of the %d gateway replica(s) "
                        "now admits 1/%d of every limit on its own until it is back",
                        type(exc).__name__, self.num_replicas, self.num_replicas)

    def check_invariants(self) -> None:
        assert all(n >= 0 for n in self._num_waiting.values()), "negative waiting count"
        assert len(self._released) <= MAX_PENDING_RELEASES
