"""The asyncio side of admission: handlers wait here until `AdmissionController` admits them.

The controller decides (pure state machine, injected clock); the gate turns its decisions
into awaits and HTTP errors:

    enter() ── rate limit ──> controller.submit ─┬─ Admitted ───────────────> cluster slot
                                                  ├─ Queued ── future set ──> cluster slot
                                                  │     └─ deadline / shed ─> ApiError 429
                                                  └─ Rejected ──────────────> ApiError 429
            cluster slot (with shared limits: gateway/admission/shared_limits.py, the limits of every
            replica together) ── held ──> return;  refused ──> local slot back, ApiError 429
    leave() ── cluster slot back ── controller.release ──> wake the handlers it admitted

With shared limits the key's token rate is charged in Redis too, so a key's limit holds
across replicas; without (one gateway, unit tests) the local `TokenRateLimiter`.

A waiter's wait ends at its tier's wait limit (`TierSpec.wait_limit_ms`: by default the
TTFT target; no background expiry task needed); a waiter
cancelled while queued (client gone) is removed from the queue in `finally`.

Lifecycle of one request here: enter() → (rate limited: 429) → admitted at once, or
waiting on its future → admitted (woken by a leave) | refused (deadline, shed: 429) |
cancelled (client gone) → ... → leave(), exactly once per successful enter().

Invariants (`check_invariants`, plus the controller's): a request id is in `_waiters` only
while it is queued in the controller and its future is still pending.
"""

from __future__ import annotations

import asyncio

from gateway.admission.admission import AdmissionController, Admitted, Queued, Rejected
from gateway.admission.rate_limit import TokenRateLimiter
from gateway.admission.shared_limits import SharedLimits
from gateway.admission.tiers import TierSpec
from gateway.api.errors import ApiError, rate_limited

_REJECT_MESSAGES = {
    "tier_queue_full": "The {tier} tier's queue is full; retry later.",
    "queue_full": "The server's queue is full; retry later.",
    "deadline": "The server cannot start this request within the {tier} tier's "
                "wait limit ({limit}); retry later.",
    "shed": "This request was shed to serve more urgent ones; retry later.",
    "overload": "The server is overloaded and serves more urgent tiers first; this {tier} "
                "request was not queued; retry later.",
}


class AdmissionGate:
    def __init__(self, controller: AdmissionController, limiter: TokenRateLimiter,
                 shared: SharedLimits | None = None) -> None:
        self._controller = controller
        self._limiter = limiter
        self._shared = shared
        self._waiters: dict[str, asyncio.Future[None]] = {}

    @property
    def shared(self) -> SharedLimits | None:
        return self._shared

    @property
    def controller(self) -> AdmissionController:
        return self._controller

    async def enter(self, request_id: str, tier: TierSpec, key_id: str | None,
                    num_tokens: int) -> None:
        """Return once admitted; raises ApiError(429) when refused or too late."""
        if key_id is not None and tier.tokens_per_min is not None:
            wait_s = await self._charge(key_id, num_tokens, tier.tokens_per_min)
            if wait_s is not None:
                hint = (" This request alone exceeds the limit; lower max_tokens."
                        if num_tokens > tier.tokens_per_min else "")
                raise rate_limited(f"Rate limit of {tier.tokens_per_min} tokens per minute "
                                   f"reached for this API key.{hint}", wait_s, code="rate_limit_exceeded")
        try:
            await self._wait_for_admission(request_id, tier)
            await self._hold_cluster_slot(request_id, tier)
        except BaseException:
            if key_id is not None and tier.tokens_per_min is not None:
                self._refund(key_id, num_tokens, tier.tokens_per_min)
            raise

    def leave(self, request_id: str, tier: TierSpec, key_id: str | None,
              num_unused_tokens: int) -> None:
        """The request ended (finished, failed or client gone); called exactly once per
        successful `enter`."""
        if key_id is not None and tier.tokens_per_min is not None:
            self._refund(key_id, num_unused_tokens, tier.tokens_per_min)
        if self._shared is not None:
            self._shared.release(request_id)
        self._wake(self._controller.release(request_id))

    async def _charge(self, key_id: str, num_tokens: int, tokens_per_min: int) -> float | None:
        if self._shared is not None:
            return await self._shared.charge(key_id, num_tokens, tokens_per_min)
        return self._limiter.try_consume(key_id, num_tokens, tokens_per_min)

    def _refund(self, key_id: str, num_tokens: int, tokens_per_min: int) -> None:
        if self._shared is not None:
            self._shared.refund(key_id, num_tokens, tokens_per_min)
        else:
            self._limiter.refund(key_id, num_tokens, tokens_per_min)

    async def _hold_cluster_slot(self, request_id: str, tier: TierSpec) -> None:
        """With shared limits, also a slot of the whole cluster's; holds the local slot
        meanwhile and gives it back when refused or cancelled."""
        if self._shared is None:
            return
        try:
            refused = await self._shared.acquire(request_id, tier,
                                                 self._controller.max_running_total,
                                                 self._controller.mean_service_s)
        except BaseException:
            self._wake(self._controller.cancel(request_id))
            raise
        if refused is not None:
            self._wake(self._controller.cancel(request_id))
            raise _rejection(Rejected(request_id, refused.retry_after_s, refused.reason), tier)

    async def _wait_for_admission(self, request_id: str, tier: TierSpec) -> None:
        outcome = self._controller.submit(request_id, tier.name)
        if isinstance(outcome, Admitted):
            return
        if isinstance(outcome, Rejected):
            raise _rejection(outcome, tier)
        assert isinstance(outcome, Queued)
        for shed in outcome.shed:
            waiter = self._waiters.pop(shed.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(_rejection(shed, tier))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = future
        try:
            await asyncio.wait_for(future, timeout=tier.wait_limit_ms / 1000.0)
        except TimeoutError:
            raise _rejection(Rejected(request_id, self._controller.mean_service_s, "deadline"),
                             tier) from None
        finally:
            self._waiters.pop(request_id, None)
            if not (future.done() and not future.cancelled() and future.exception() is None):
                # Not admitted (timed out, shed, cancelled): leave the queue, or give back
                # a slot granted in the same instant the wait was abandoned.
                self._wake(self._controller.cancel(request_id))

    def _wake(self, admitted_ids: tuple[str, ...]) -> None:
        for rid in admitted_ids:
            waiter = self._waiters.pop(rid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            elif waiter is None or waiter.done():
                # Its handler is gone; hand the slot on.
                self._wake(self._controller.cancel(rid))

    def set_capacity(self, max_running_total: int) -> None:
        """A new concurrency limit (gateway/admission/capacity.py); a larger one admits at once."""
        self._wake(self._controller.set_capacity(max_running_total))

    def set_protection(self, on: bool) -> None:
        """Shed lower tiers early while the most urgent one is at risk (gateway/admission/capacity.py)."""
        if on != self._controller.protecting:
            self._wake(self._controller.set_protection(on))

    def check_invariants(self) -> None:
        self._controller.check_invariants()
        for rid, waiter in self._waiters.items():
            assert self._controller.is_queued(rid), f"{rid} waits but is not queued"
            assert not waiter.done(), f"{rid}'s wait ended but it is still listed"


def _rejection(rejected: Rejected, tier: TierSpec) -> ApiError:
    limit_ms = tier.wait_limit_ms
    limit = (f"its time-to-first-token target, {limit_ms:g} ms" if tier.max_wait_ms is None
             else f"{limit_ms / 1000:g} s")
    message = _REJECT_MESSAGES[rejected.reason].format(tier=tier.name, limit=limit)
    return rate_limited(message, rejected.retry_after_s, code=rejected.reason)
