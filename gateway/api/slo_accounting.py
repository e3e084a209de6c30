"""Did a request meet its tier's targets? Classified once per request, from the server side.

TTFT is measured from the request's arrival at the gateway (before its body is read, so
admission queueing and tokenisation count), TPOT as the mean gap between the later tokens:
the same two numbers a benchmark client computes. Every request that reaches a tier ends
in exactly one outcome:

    met           finished, TTFT <= ttft_ms and TPOT <= tpot_ms
    missed_ttft   finished, only the TTFT target missed
    missed_tpot   finished, only the TPOT target missed
    missed_both   finished, both missed
    rejected      refused with 429 (admission deadline, a full queue, a rate limit)
    shed          refused with 429 to serve a more urgent tier (codes shed, overload)
    failed        a 503 or an error after the headers: no answer to the end
    aborted       the client went away before the end

`RequestTiming` is filled in as the answer streams (`TimedBatches` wraps the backend's
batches); `slo_outcome` (pure) classifies it; the gateway counts the result in
`pdserve_gateway_slo_requests_total{tier,outcome}` (goodput = the rate of `met`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from gateway.admission.tiers import TierSpec
from gateway.api.backend import TokenDelta

SHED_CODES = frozenset({"shed", "overload"})


class SloOutcome(enum.Enum):
    MET = "met"
    MISSED_TTFT = "missed_ttft"
    MISSED_TPOT = "missed_tpot"
    MISSED_BOTH = "missed_both"
    REJECTED = "rejected"
    SHED = "shed"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(slots=True)
class RequestTiming:
    tier: TierSpec
    arrived_s: float  # monotonic seconds
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    finished: bool = False  # a finish reason reached the gateway
    finish_reason: str | None = None  # as the client sees it (stop, length)

    def observe(self, batch: list[TokenDelta], now: float) -> None:
        """A batch of deltas reached the client at `now`."""
        for delta in batch:
            if delta.num_tokens:
                if self.first_token_s is None:
                    self.first_token_s = now
                self.last_token_s = now
                self.num_tokens += delta.num_tokens
            if delta.finish_reason is not None:
                self.finished = True
                self.finish_reason = delta.finish_reason.value

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrived_s

    @property
    def tpot_s(self) -> float:
        if self.num_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return 0.0
        return (self.last_token_s - self.first_token_s) / (self.num_tokens - 1)


def slo_outcome(timing: RequestTiming, refusal: tuple[int, str] | None,
                client_gone: bool) -> SloOutcome:
    """The one outcome of a request (see the module docstring); `refusal` is the
    (status, code) of a 429/503 it was answered with, before or after its headers."""
    if refusal is not None:
        status, code = refusal
        if status == 429:
            return SloOutcome.SHED if code in SHED_CODES else SloOutcome.REJECTED
        return SloOutcome.FAILED
    if not timing.finished or timing.ttft_s is None:
        return SloOutcome.ABORTED if client_gone else SloOutcome.FAILED
    ttft_ok = timing.ttft_s * 1000 <= timing.tier.ttft_ms
    tpot_ok = timing.tpot_s * 1000 <= timing.tier.tpot_ms
    if ttft_ok and tpot_ok:
        return SloOutcome.MET
    if tpot_ok:
        return SloOutcome.MISSED_TTFT
    return SloOutcome.MISSED_TPOT if ttft_ok else SloOutcome.MISSED_BOTH


async def timed_batches(batches: AsyncGenerator[list[TokenDelta], None], timing: RequestTiming,
                        clock: Callable[[], float] = time.monotonic
                        ) -> AsyncGenerator[list[TokenDelta], None]:
    """`batches`, unchanged, noting in `timing` when tokens arrive and whether one finishes."""
    try:
        async for batch in batches:
            timing.observe(batch, clock())
            yield batch
    finally:
        await batches.aclose()
