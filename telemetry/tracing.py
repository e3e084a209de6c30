"""OpenTelemetry traces, off unless an OTLP endpoint is given: one seam every process uses.

    tracing = start_tracing("pdserve-gateway", endpoint)   # endpoint None: NO_TRACING
    span = tracing.start("chat default", parent=traceparent, kind="server", attributes=...)
    child = span.child("admission", start_ns=..., attributes=...); child.end()
    message.traceparent = span.traceparent                  # W3C, to the next process
    span.end(); await tracing.shutdown()                    # flushes what is queued

Off (no endpoint, or the `tracing` extra not installed with a warning logged), every call is
a method of one do-nothing object and nothing is imported: the cost per request is a
handful of calls that return at once, and nothing is ever exported. On, spans go through
the SDK's batching processor to OTLP/HTTP (protobuf) at `<endpoint>/v1/traces`; exporting
runs in the SDK's own thread, never on the event loop.

The parent travels between processes as a W3C `traceparent` string
("00-<32 hex trace id>-<16 hex span id>-<2 hex flags>"), in the client's HTTP header and in
the `traceparent` field of PrefillRequest and DecodeRequest (protocol/messages.py).
A malformed one from a client starts a new trace rather than failing the request.

Attribute values are str, bool, int, float or a list of one of them (OpenTelemetry's rule);
None values are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from protocol.messages import TRACEPARENT_PATTERN

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)
SPAN_KINDS = ("internal", "server", "client")
Attributes = Mapping[str, object]
log = logging.getLogger(__name__)


def valid_traceparent(value: str | None) -> str | None:
    """`value` when it is a well-formed W3C traceparent (version 00 or later), else None."""
    if value is None:
        return None
    value = value.strip().lower()
    if not _TRACEPARENT.match(value) or value.startswith("ff-"):
        return None
    _, trace_id, span_id, _ = value.split("-")
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return value


class Span(Protocol):
    @property
    def traceparent(self) -> str | None: ...
    @property
    def trace_id(self) -> str | None: ...
    def set(self, attributes: Attributes) -> None: ...
    def event(self, name: str, attributes: Attributes = ...) -> None: ...
    def child(self, name: str, attributes: Attributes = ..., start_ns: int | None = ...,
              kind: str = ...) -> Span: ...
    def fail(self, error_type: str, message: str = ...) -> None: ...
    def end(self, end_ns: int | None = ...) -> None: ...


class Tracing(Protocol):
    @property
    def enabled(self) -> bool: ...
    def start(self, name: str, parent: str | None = ..., attributes: Attributes = ...,
              start_ns: int | None = ..., kind: str = ...) -> Span: ...
    async def shutdown(self) -> None: ...


class _NoSpan:
    traceparent = None
    trace_id = None

    def set(self, attributes: Attributes) -> None:
        pass

    def event(self, name: str, attributes: Attributes = {}) -> None:
        pass

    def child(self, name: str, attributes: Attributes = {}, start_ns: int | None = None,
              kind: str = "internal") -> Span:
        return self

    def fail(self, error_type: str, message: str = "") -> None:
        pass

    def end(self, end_ns: int | None = None) -> None:
        pass


NO_SPAN: Span = _NoSpan()


class _NoTracing:
    enabled = False

    def start(self, name: str, parent: str | None = None, attributes: Attributes = {},
              start_ns: int | None = None, kind: str = "internal") -> Span:
        return NO_SPAN

    async def shutdown(self) -> None:
        pass


NO_TRACING: Tracing = _NoTracing()


def _clean(attributes: Attributes) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, Sequence) and not isinstance(value, str):
            value = list(value)
        out[key] = value
    return out


class _OtelSpan:
    def __init__(self, tracing: _OtelTracing, span: Any) -> None:
        self._tracing, self._span = tracing, span
        context = span.get_span_context()
        self.trace_id: str | None = f"{context.trace_id:032x}"
        self.traceparent: str | None = (f"00-{context.trace_id:032x}-{context.span_id:016x}-"
                                        f"{int(context.trace_flags):02x}")

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(_clean(attributes))

    def event(self, name: str, attributes: Attributes = {}) -> None:
        self._span.add_event(name, _clean(attributes))

    def child(self, name: str, attributes: Attributes = {}, start_ns: int | None = None,
              kind: str = "internal") -> Span:
        return self._tracing.start(name, self.traceparent, attributes, start_ns, kind)

    def fail(self, error_type: str, message: str = "") -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, message or error_type))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_time=end_ns)


class _OtelTracing:
    enabled = True

    def __init__(self, service_name: str, endpoint: str, instance_id: str | None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        resource = {"service.name": service_name}
        if instance_id:
            resource["service.instance.id"] = instance_id
        self._provider = TracerProvider(resource=Resource.create(resource))
        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url, timeout=5), schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._kinds = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER,
                       "client": SpanKind.CLIENT}
        self.endpoint = url

    def start(self, name: str, parent: str | None = None, attributes: Attributes = {},
              start_ns: int | None = None, kind: str = "internal") -> Span:
        from opentelemetry.context import Context

        parent = valid_traceparent(parent)
        context = self._propagator.extract({"traceparent": parent}) if parent else Context()
        span = self._tracer.start_span(name, context=context, kind=self._kinds[kind],
                                       attributes=_clean(attributes), start_time=start_ns)
        return _OtelSpan(self, span)

    async def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop."""
        await asyncio.to_thread(self._provider.shutdown)


def start_tracing(service_name: str, endpoint: str | None,
                  instance_id: str | None = None) -> Tracing:
    """Tracing to `endpoint` (an OTLP/HTTP base URL), or NO_TRACING when it is None or empty,
    or when the SDK is not installed (then a warning says how to get it)."""
    if not endpoint:
        return NO_TRACING
    try:
        tracing = _OtelTracing(service_name, endpoint, instance_id)
    except ImportError as exc:
        log.warning("traces are off: the OpenTelemetry SDK is not installed (%s); "
                    "pip install 'pdserve[tracing]'", exc)
        return NO_TRACING
    log.info("exporting traces to %s", tracing.endpoint)
    return tracing
