"""The tracing seam: off costs nothing and exports nothing; traceparent checking."""

from __future__ import annotations

import pytest

from telemetry.tracing import NO_SPAN, NO_TRACING, start_tracing, valid_traceparent

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize("endpoint", [None, ""])
def test_no_endpoint_is_no_tracing(endpoint: str | None) -> None:
    tracing = start_tracing("pdserve-test", endpoint)
    assert tracing is NO_TRACING and not tracing.enabled
    span = tracing.start("x", GOOD, {"a": 1})
    assert span is NO_SPAN and span.traceparent is None and span.trace_id is None
    assert span.child("y") is NO_SPAN


@pytest.mark.parametrize("value, expected", [
    (GOOD, GOOD), (GOOD.upper(), GOOD), (f" {GOOD} ", GOOD), (None, None), ("", None),
    ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None),  # all-zero trace id
    ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", None),
    ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),  # forbidden version
    ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),  # short
    ("garbage", None),
])
def test_traceparent_validation(value: str | None, expected: str | None) -> None:
    assert valid_traceparent(value) == expected


def test_spans_nest_and_carry_their_parent_when_on() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracing = start_tracing("pdserve-test", "http://127.0.0.1:9")  # never reached
    exporter = InMemorySpanExporter()
    tracing._provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[attr-defined]
    root = tracing.start("chat m", GOOD, {"gen_ai.request.model": "m", "skip": None})
    child = tracing.start("decode", root.traceparent)
    child.fail("worker_error", "boom")
    child.end()
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert root.trace_id == GOOD.split("-")[1]
    assert spans["chat m"].parent.span_id == int(GOOD.split("-")[2], 16)
    assert spans["decode"].parent.span_id == spans["chat m"].context.span_id
    assert spans["decode"].attributes["error.type"] == "worker_error"
    assert "skip" not in spans["chat m"].attributes
    tracing._provider.shutdown()  # type: ignore[attr-defined]


def test_workers_stream_untouched_when_tracing_is_off_or_the_request_untraced() -> None:
    import asyncio

    from protocol.messages import DecodeRequest, PrefillRequest
    from worker.request_spans import traced_decode, traced_prefill

    async def produce(request, out):
        yield request

    class Writer:  # the stream's FrameWriter, which these producers leave unused
        def send(self, frame: object) -> bool:
            return False

    out = Writer()

    prefill = PrefillRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1000,
                             traceparent=GOOD)
    decode = DecodeRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1000)

    async def frames(generator):
        return [frame async for frame in generator]

    off_prefill = traced_prefill(NO_TRACING, produce, "tcp")(prefill, out)
    assert off_prefill.ag_code is produce.__code__  # the producer itself, no wrapper
    assert off_prefill.ag_frame.f_locals["out"] is out  # with the stream's writer
    assert asyncio.run(frames(off_prefill)) == [prefill]
    tracing = start_tracing("pdserve-test", "http://127.0.0.1:9")
    untraced = traced_decode(tracing, produce)(decode, out)
    assert untraced.ag_code is produce.__code__  # untraced: the producer itself
    assert untraced.ag_frame.f_locals["out"] is out  # tokens may still leave through it
    asyncio.run(tracing.shutdown())


@pytest.mark.parametrize("bad", ["garbage", GOOD.upper(), GOOD + "-x", "00-" + "g" * 32 + "-00f067aa0ba902b7-01"])
def test_a_worker_message_with_a_malformed_traceparent_is_refused(bad: str) -> None:
    from protocol.messages import PrefillRequest, ProtocolError, decode, encode

    message = PrefillRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1000,
                             traceparent=bad)  # constructing does not validate; decoding does
    with pytest.raises(ProtocolError, match="traceparent"):
        decode(encode(message), PrefillRequest)
    good = PrefillRequest(request_id="r", prompt_token_ids=[1], timeout_ms=1000,
                          traceparent=GOOD)
    assert decode(encode(good), PrefillRequest).traceparent == GOOD
