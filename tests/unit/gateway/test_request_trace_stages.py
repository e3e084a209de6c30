"""The request timeline's prefill queue (gateway/api/request_trace.py): what a prefill
worker reports as its queue, placed from the attempt's plan on and never past its first
token."""

from __future__ import annotations

from gateway.api.request_trace import RequestTrace
from gateway.routing.router import RoutePlan
from telemetry.tracing import NO_TRACING


def trace() -> RequestTrace:
    return RequestTrace.begin(NO_TRACING, "/v1/completions", "m", "r", "standard", None,
                              arrived_s=100.0, arrived_unix_ns=0, num_prompt_tokens=10,
                              max_tokens=4)


def test_the_queue_starts_at_the_attempts_plan_and_ends_by_its_first_token() -> None:
    t = trace()
    t.admitted(100.002)
    t.planned(0, RoutePlan("d0", "p0", 0), 100.010)
    t.planned(1, RoutePlan("d0", "p1", 0), 100.050)  # a retry: its own plan counts
    t.prefill_queue("p1", 30.0, now_s=100.200)
    stage = t.stages[-1]
    assert stage.name == "prefill_queue" and stage.detail == "on p1"
    assert (round(stage.start_ms, 6), round(stage.end_ms, 6)) == (50.0, 80.0)
    t.prefill_queue("p1", 500.0, now_s=100.200)  # a report longer than the attempt
    assert round(t.stages[-1].end_ms, 6) == 200.0
