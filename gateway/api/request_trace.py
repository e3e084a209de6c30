"""One request's stages as the gateway sees them: a timeline for the cluster page's recent
requests (gateway/dashboard.py) and, with tracing on, the request's spans.

    begin     arrival: the request span ("chat <model>" / "text_completion <model>", kind
              server, parent = the client's `traceparent`), GenAI request attributes
    admitted  admission done: child span "admission" from arrival to now
    planned   a route chosen for attempt n: child span "route" (pdserve.route = local |
              split, the workers, how it was chosen and the predicted TTFT)
    failed    an attempt's worker failed: event "attempt_failed" (then a retry or a
              migration, or the end)
    finish    the answer is over: usage, finish reasons, the SLO outcome, error.type; the
              span ends

The workers' spans (prefill, kv_transfer, decode: worker/request_spans.py) hang
under the request span through `traceparent`, which upstream puts in each PrefillRequest
and DecodeRequest. With tracing off the span is the do-nothing one; the timeline is kept
all the same (a few small objects per request).

Times: `now_s` arguments are time.monotonic() seconds; the stage list holds milliseconds
since arrival; spans get wall-clock nanoseconds derived from the arrival's pair, except the
request span's end, read off the wall clock itself (as the workers' spans are).
"""

from __future__ import annotations

import time

import msgspec

from gateway.api.slo_accounting import RequestTiming, SloOutcome
from gateway.routing.retry_policy import LegFailed
from gateway.routing.router import RoutePlan
from telemetry.tracing import Span, Tracing

OPERATIONS = {"chat": "chat", "completions": "text_completion"}


class Stage(msgspec.Struct, frozen=True, array_like=True):
    name: str  # queued, route, prefill (admitted -> token 1), prefill_queue, decode, retry
    start_ms: float  # since arrival
    end_ms: float
    detail: str = ""


class RequestRecord(msgspec.Struct, frozen=True):
    """One finished request as the cluster page lists it."""

    request_id: str
    tier: str
    outcome: str  # gateway/api/slo_accounting.py's outcomes
    arrived_unix_ms: int
    ttft_ms: float | None
    tpot_ms: float | None
    num_tokens: int
    route: str | None  # local | split, of the last attempt
    workers: list[str]
    stages: list[Stage]
    error: str | None
    trace_id: str | None
    num_prompt_tokens: int = 0


class RequestTrace:
    def __init__(self, span: Span, request_id: str, tier: str, arrived_s: float,
                 arrived_unix_ns: int, num_prompt_tokens: int = 0) -> None:
        self.span, self.request_id, self.tier = span, request_id, tier
        self.num_prompt_tokens = num_prompt_tokens
        self.arrived_s, self.arrived_unix_ns = arrived_s, arrived_unix_ns
        self.stages: list[Stage] = []
        self.route: str | None = None
        self.workers: list[str] = []
        self._admitted_s: float | None = None

    @classmethod
    def begin(cls, tracing: Tracing, endpoint: str, model: str, request_id: str, tier: str,
              client_traceparent: str | None, arrived_s: float, arrived_unix_ns: int,
              num_prompt_tokens: int, max_tokens: int) -> RequestTrace:
        operation = OPERATIONS.get(endpoint, endpoint)
        span = tracing.start(f"{operation} {model}", client_traceparent, kind="server",
                             start_ns=arrived_unix_ns, attributes={
                                 "gen_ai.operation.name": operation,
                                 "gen_ai.request.model": model,
                                 "gen_ai.request.max_tokens": max_tokens,
                                 "gen_ai.usage.input_tokens": num_prompt_tokens,
                                 "pdserve.tier": tier, "pdserve.request_id": request_id})
        return cls(span, request_id, tier, arrived_s, arrived_unix_ns, num_prompt_tokens)

    @property
    def traceparent(self) -> str | None:
        """For the workers' messages: their spans become children of the request span."""
        return self.span.traceparent

    def _ms(self, now_s: float) -> float:
        return round((now_s - self.arrived_s) * 1000, 3)

    def _unix_ns(self, now_s: float) -> int:
        return self.arrived_unix_ns + int((now_s - self.arrived_s) * 1e9)

    def admitted(self, now_s: float) -> None:
        self._admitted_s = now_s
        self.stages.append(Stage("queued", 0.0, self._ms(now_s)))
        self.span.child("admission", start_ns=self.arrived_unix_ns).end(self._unix_ns(now_s))

    def planned(self, attempt: int, plan: RoutePlan, now_s: float) -> None:
        self.route = plan.kind
        self.workers = [w for w in (plan.prefill_worker_id, plan.decode_worker_id) if w]
        predicted = plan.predicted
        at_ns = self._unix_ns(now_s)
        self.span.child("route", start_ns=at_ns, attributes={
            "pdserve.route": plan.kind, "pdserve.route.attempt": attempt,
            "pdserve.route.how": "predicted" if predicted else "rule",
            "pdserve.route.prefill_worker": plan.prefill_worker_id,
            "pdserve.route.decode_worker": plan.decode_worker_id,
            "pdserve.route.cached_tokens": plan.cached_tokens,
            "pdserve.route.predicted_ttft_s": predicted.ttft_s if predicted else None,
            "pdserve.route.predicted_tpot_s": predicted.tpot_s if predicted else None,
        }).end(at_ns)
        self.span.set({"pdserve.route": plan.kind})
        self.stages.append(Stage("route", self._ms(now_s), self._ms(now_s),
                                 f"attempt {attempt}: {plan.kind} via {' -> '.join(self.workers)}"))

    def prefill_queue(self, worker_id: str, queue_ms: float, now_s: float) -> None:
        """The prefill worker's report, with its first token at `now_s`: the prompt waited
        `queue_ms` in its queue before its first chunk, from the attempt's plan on (the
        message's way there is in it, on the gateway's clock); no longer than the attempt."""
        start = next((s.start_ms for s in reversed(self.stages) if s.name == "route"),
                     self._ms(self._admitted_s if self._admitted_s is not None
                              else self.arrived_s))
        end = min(self._ms(now_s), start + queue_ms)
        self.stages.append(Stage("prefill_queue", start, end, f"on {worker_id}"))

    def failed(self, failure: LegFailed, now_s: float) -> None:
        self.span.event("attempt_failed", {"pdserve.worker": failure.worker_id,
                                           "pdserve.phase": failure.phase.value,
                                           "error.type": failure.kind.value})
        self.stages.append(Stage("retry", self._ms(now_s), self._ms(now_s),
                                 f"{failure.phase.value} on {failure.worker_id}: "
                                 f"{failure.kind.value}"))

    def finish(self, timing: RequestTiming, outcome: SloOutcome, error: str | None,
               now_s: float | None = None) -> RequestRecord:
        """End the span; the request as the cluster page lists it."""
        # The workers' spans end on their own wall clocks; the request's end is read off
        # the same clock, so a child never outlasts it when the wall clock drifts from the
        # monotonic one (a slewed or stepped clock) during the request.
        end_ns = time.time_ns() if now_s is None else self._unix_ns(now_s)
        now_s = time.monotonic() if now_s is None else now_s
        start = self._admitted_s if self._admitted_s is not None else self.arrived_s
        first, last = timing.first_token_s, timing.last_token_s
        if first is not None:
            self.stages.append(Stage("prefill", self._ms(start), self._ms(first),
                                     "admitted to the first token"))
            self.stages.append(Stage("decode", self._ms(first), self._ms(last or first),
                                     f"{timing.num_tokens} tokens"))
        self.span.set({"gen_ai.usage.output_tokens": timing.num_tokens,
                       "gen_ai.response.finish_reasons":
                           [timing.finish_reason] if timing.finish_reason else None,
                       "pdserve.slo.outcome": outcome.value,
                       "pdserve.ttft_s": timing.ttft_s})
        if error is not None:
            self.span.fail(error)
        self.span.end(end_ns)
        ttft = timing.ttft_s
        return RequestRecord(
            request_id=self.request_id, tier=self.tier, outcome=outcome.value,
            arrived_unix_ms=self.arrived_unix_ns // 1_000_000,
            ttft_ms=None if ttft is None else round(ttft * 1000, 3),
            tpot_ms=round(timing.tpot_s * 1000, 3) if timing.num_tokens > 1 else None,
            num_tokens=timing.num_tokens, route=self.route, workers=self.workers,
            stages=list(self.stages), error=error, trace_id=self.span.trace_id,
            num_prompt_tokens=self.num_prompt_tokens)
