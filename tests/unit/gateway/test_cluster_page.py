"""The cluster page's routes (static files, the admin-only data) and the request span the
handler makes, on a real aiohttp server with a scripted backend."""

from __future__ import annotations

import json

import pytest

from gateway.admission.tiers import load_tier_config
from gateway.ops import cluster_page
from gateway.ops.admin_access import AdminAccess
from gateway.ops.ops_api import ADMIN as ADMIN_ACCESS
from gateway.ops.ops_api import CLUSTER, HISTORY, worker_row
from gateway.ops.request_history import RequestHistory
from gateway.upstream.cluster import WorkerEntry
from protocol.messages import LoadReport, Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from tests.unit.gateway.gateway_harness import MODEL, Harness, ScriptedBackend

ADMIN, USER = "sk-admin-key", "sk-user-key"
TIERS = load_tier_config(None, {"PDSERVE_API_KEYS": f"{ADMIN}:standard:admin,{USER}:standard"})


class NoWorkers:
    agent_state = None  # a gateway that reads no agent state: no reports

    def entries(self) -> list:
        return []


def _page_routes(app) -> None:
    app[CLUSTER], app[HISTORY] = NoWorkers(), RequestHistory()
    app[ADMIN_ACCESS] = AdminAccess(admin_token=None, loopback_only=True)
    cluster_page.install(app)


@pytest.fixture
def harness():
    h = Harness(ScriptedBackend(), tiers=TIERS, install=_page_routes)
    yield h
    h.close()


def test_the_page_and_its_assets_are_served_with_a_strict_policy(harness: Harness) -> None:
    status, headers, body = harness.call("GET", "/dashboard")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b"/dashboard/app.js" in body and b"http" not in body.split(b"<body")[0]  # no CDN
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    for name, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
        status, headers, body = harness.call("GET", f"/dashboard/{name}")
        assert status == 200 and headers["Content-Type"].startswith(kind) and body


@pytest.mark.parametrize("path", ["/dashboard/dashboard.html.bak", "/dashboard/..%2f..%2fREADME.md",
                                  "/dashboard/%2e%2e", "/dashboard/app.js/x"])
def test_anything_else_under_the_page_is_an_openai_style_404(harness: Harness, path: str) -> None:
    status, _, body = harness.call("GET", path)
    assert status == 404 and json.loads(body)["error"]["type"]


@pytest.mark.parametrize("key, status", [(None, 401), ("sk-wrong", 401), (USER, 403)])
def test_the_data_needs_an_admin_key(harness: Harness, key: str | None, status: int) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    got, _, body = harness.call("GET", "/admin/cluster", headers=headers)
    assert got == status and json.loads(body)["error"]["message"]


def test_the_data_lists_tiers_buckets_and_no_workers(harness: Harness) -> None:
    status, _, body = harness.call("GET", "/admin/cluster",
                                   headers={"Authorization": f"Bearer {ADMIN}"})
    data = json.loads(body)
    assert status == 200 and data["models"] == [MODEL] and data["workers"] == []
    assert {t["name"] for t in data["tiers"]} == {"interactive", "standard", "batch"}
    assert len(data["attainment"]) == 30 and data["bucket_s"] == 10
    assert 0 <= data["window_s"] < 60  # the history began with this test
    assert data["recent"] == [] and data["agent_events"] == [] and data["agent_reports"] == []


def test_a_request_span_takes_the_clients_traceparent_and_ignores_a_bad_one() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from telemetry.tracing import start_tracing

    tracing = start_tracing("pdserve-gateway", "http://127.0.0.1:9")
    exporter = InMemorySpanExporter()
    tracing._provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[attr-defined]
    backend = ScriptedBackend()
    history = RequestHistory()
    h = Harness(backend, tracing=tracing, count=True,
                install=lambda app: app.__setitem__(HISTORY, history))
    try:
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        for traceparent in (parent, "00-not-a-trace-01"):
            status, _, _ = h.call("POST", "/v1/completions", json=body,
                                  headers={"traceparent": traceparent})
            assert status == 200
        spans = [s for s in exporter.get_finished_spans() if s.name == f"text_completion {MODEL}"]
        assert len(spans) == 2
        assert spans[0].context.trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
        assert spans[0].parent.span_id == int("b7ad6b7169203331", 16)
        assert spans[1].parent is None  # a malformed header starts a new trace
        assert spans[0].attributes["gen_ai.usage.output_tokens"] == 2
        assert spans[0].attributes["gen_ai.response.finish_reasons"] == ("length",)
        # The workers are told the request span, so their spans become its children.
        sent = backend.requests[0].trace.traceparent
        assert sent.split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
        assert sent.split("-")[2] == f"{spans[0].context.span_id:016x}"
        assert history.recent() == []  # both met: not listed
    finally:
        h.close()
        tracing._provider.shutdown()  # type: ignore[attr-defined]


def test_a_worker_row_shows_its_kv_cache_and_host_tier_occupancy() -> None:
    info = WorkerInfo(worker_id="decode-1", role=Role.DECODE, model=MODEL,
                      control_url="http://127.0.0.1:1", num_kv_blocks=64, block_size=16)
    load = WorkerLoad(num_kv_blocks_used=16, num_kv_blocks_total=64, num_host_blocks_used=300,
                      num_host_blocks_total=1000)
    row = worker_row(WorkerEntry(info, "decode-1", LoadReport(worker_id="decode-1", epoch=0,
                                                              load=load)))
    assert row.load is not None
    assert (row.load["kv_blocks_used"], row.load["kv_blocks_total"]) == (16, 64)
    assert (row.load["host_blocks_used"], row.load["host_blocks_total"]) == (300, 1000)
