"""Observability of a real `pdserve up` cluster (1 prefill + 1 decode worker, API keys on,
traces exported to a real OTLP/HTTP receiver):

- one long prompt handed off P -> D is one trace: spans from the gateway, the prefill and
  the decode worker, under the client's `traceparent`, nested, with the GenAI attributes;
- a real Prometheus server scrapes the gateway, both workers and the agent; every PromQL
  expression of the shipped Grafana dashboard returns data, and so does the agent's
  desired worker count per role;
- the cluster page (/dashboard) in real headless Chromium shows the workers and tiers of
  the running cluster and the request that was refused; a screenshot is saved
  (to $PDSERVE_SCREENSHOT_DIR too when set: docs/observability.md's picture).

The traffic: a long prompt handed off P -> D (a KV transfer), short chats on two tiers, and
one request over its key's rate limit (a 429: the `rejected` SLO outcome).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import openai
import pytest
from chromium_page import ChromiumPage
from otlp_receiver import OtlpReceiver, ReceivedSpan
from prometheus_server import PrometheusServer
from up_process import HANDOFF_TIER, LONG_PROMPT, REPO, UpProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "pdserve.json"
ADMIN_KEY, LIMITED_KEY = "sk-observability-admin", "sk-observability-limited"
TIERS = HANDOFF_TIER + """
[tiers.limited]
priority = 2
ttft_ms = 60000
tpot_ms = 5000
max_queued = 16
max_running = 16
tokens_per_min = 60
"""
# Grafana's own variables in the dashboard's expressions, filled in to cover all the test's
# traffic (any other `$` would be a variable this test does not know).
GRAFANA_VARIABLES = {"$__rate_interval": "2m"}


@pytest.fixture(scope="module")
def receiver():
    otlp = OtlpReceiver()
    yield otlp
    otlp.stop()


@pytest.fixture(scope="module")
def up(tmp_path_factory, receiver: OtlpReceiver):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(TIERS)
    keys = f"{ADMIN_KEY}:standard:header+admin,{LIMITED_KEY}:limited"
    process = UpProcess("--prefill", "1", "--decode", "1", "--tiers", str(tiers),
                        "--otlp-endpoint", receiver.url,
                        log_dir=tmp_path_factory.mktemp("up-logs"),
                        env={"PDSERVE_API_KEYS": keys})
    yield process
    process.stop()


def _client(up: UpProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key=key, max_retries=0, timeout=120)


def _send_traffic(up: UpProcess) -> None:
    admin = _client(up, ADMIN_KEY)
    model = admin.models.list().data[0].id
    stream = admin.chat.completions.create(
        model=model, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=8,
        temperature=0, stream=True, extra_headers={"x-pdserve-tier": "handoff"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    for tier in ("interactive", "standard"):
        for _ in range(2):
            answer = admin.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hello."}],
                max_tokens=6, temperature=0, extra_headers={"x-pdserve-tier": tier})
            assert answer.usage.completion_tokens >= 1
    with pytest.raises(openai.RateLimitError):
        _client(up, LIMITED_KEY).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=100)


def _dashboard_expressions() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    found = [(panel["title"], target["expr"]) for panel in panels
             for target in panel.get("targets", []) if target.get("expr")]
    assert len(found) >= 10, "the dashboard lost its queries"
    return found


def _fill_variables(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    unknown = re.findall(r"\$\w+", expr)
    assert not unknown, f"unknown dashboard variables {unknown} in {expr}"
    return expr


def _has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


def test_every_dashboard_query_returns_data_from_a_real_prometheus(up: UpProcess,
                                                                   tmp_path: Path) -> None:
    workers = up.workers()
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    jobs = {"pdserve-gateway": [up.url.removeprefix("http://")],
            "pdserve-agent": [_agent_metrics_address(up)]}
    for worker in workers:
        jobs.setdefault(f"pdserve-{worker['role']}", []).append(
            worker["control_url"].removeprefix("http://"))
    prometheus = PrometheusServer(jobs, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = prometheus.targets_up()
            if len(health) == 4 and set(health.values()) == {"up"}:
                break
            time.sleep(0.5)
        assert set(prometheus.targets_up().values()) == {"up"}, prometheus.targets_up()
        _send_traffic(up)
        # Every query at one moment a few scrapes after the traffic, as one dashboard refresh.
        at = time.time() + 3
        time.sleep(5)
        answers = {(title, query): prometheus.query(query, at) for title, query in
                   ((title, _fill_variables(expr)) for title, expr in _dashboard_expressions())}
        missing = {key: result for key, result in answers.items() if not _has_data(result)}
        assert not missing, f"dashboard queries without data: {missing}"
        # The agent's capacity plan, what an autoscaler scales on (deploy/kubernetes/
        # overlays/autoscale): one desired count per role, once the workers fitted models.
        deadline = time.monotonic() + 30
        roles: dict[str, float] = {}
        while time.monotonic() < deadline and len(roles) < 3:
            roles = {r["metric"]["role"]: float(r["value"][1]) for r in
                     prometheus.query("pdserve_agent_desired_workers", time.time())}
            time.sleep(1.0)
        assert set(roles) == {"prefill", "decode", "total"}, roles
        assert all(count >= 1 for count in roles.values()), roles
    finally:
        prometheus.stop()


def _agent_metrics_address(up: UpProcess, timeout_s: float = 30.0) -> str:
    """host:port of the agent's /metrics, from the line it logs when it binds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for log in up.log_dir.glob("*.log"):
            found = re.search(r"pdserve agent: /metrics on http://(\S+)",
                              log.read_text(errors="replace"))
            if found:
                return found.group(1)
        time.sleep(0.2)
    raise AssertionError(f"no agent /metrics line in {sorted(up.log_dir.glob('*.log'))}")


def _trace_spans(receiver: OtlpReceiver, trace_id: str, names: set[str],
                 timeout_s: float = 20.0) -> dict[str, ReceivedSpan]:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in receiver.spans() if s.trace_id == trace_id]
        by_name = {s.name: s for s in spans}
        if names <= set(by_name) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert names <= set(by_name), f"spans of the trace: {sorted(by_name)}; wanted {sorted(names)}"
    assert len(spans) == len(by_name), f"a span name twice: {[s.name for s in spans]}"
    return by_name


def _inside(child: ReceivedSpan, parent: ReceivedSpan, slack_ns: int = 2_000_000) -> bool:
    return parent.start_ns - slack_ns <= child.start_ns <= child.end_ns <= parent.end_ns + slack_ns


def _offsets(name: str, child: ReceivedSpan, parent: ReceivedSpan) -> str:
    return (f"{name}: starts {(child.start_ns - parent.start_ns) / 1e6:.3f} ms after the "
            f"request span, ends {(child.end_ns - parent.end_ns) / 1e6:.3f} ms after it")


def test_a_handoff_request_is_one_trace_across_gateway_prefill_and_decode(
        up: UpProcess, receiver: OtlpReceiver) -> None:
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    admin = _client(up, ADMIN_KEY)
    model = admin.models.list().data[0].id
    fresh_prompt = f"Note {secrets.token_hex(4)}. {LONG_PROMPT}"  # no cached prefix
    stream = admin.chat.completions.create(
        model=model, messages=[{"role": "user", "content": fresh_prompt}], max_tokens=8,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-pdserve-tier": "handoff",
                       "traceparent": f"00-{client_trace}-{client_span}-01"})
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 8
    request_name = f"chat {model}"
    spans = _trace_spans(receiver, client_trace, {request_name, "admission", "route",
                                                  "prefill", "kv_transfer", "decode"})
    root, prefill, transfer, decode = (spans[n] for n in (request_name, "prefill",
                                                          "kv_transfer", "decode"))
    # Three processes, one trace under the client's span.
    assert {s.service for s in spans.values()} == {"pdserve-gateway", "pdserve-prefill",
                                                   "pdserve-decode"}
    assert (root.service, prefill.service, transfer.service, decode.service) == \
        ("pdserve-gateway", "pdserve-prefill", "pdserve-prefill", "pdserve-decode")
    assert root.parent_span_id == client_span
    for name in ("admission", "route", "prefill", "decode"):
        assert spans[name].parent_span_id == root.span_id, name
        assert _inside(spans[name], root), _offsets(name, spans[name], root)
    assert transfer.parent_span_id == prefill.span_id and _inside(transfer, prefill)
    assert prefill.start_ns <= decode.start_ns  # D is asked after token 1 came from P
    # The GenAI attributes on the request span, pdserve's own on the stages.
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == model
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["pdserve.tier"] == "handoff" and a["pdserve.route"] == "split"
    assert a["pdserve.slo.outcome"] == "met" and "error.type" not in a
    assert spans["route"].attributes["pdserve.route"] == "split"
    assert spans["route"].attributes["pdserve.route.prefill_worker"].startswith("prefill")
    p = prefill.attributes
    assert p["pdserve.prefill.tokens"] == usage.prompt_tokens > 512
    assert p["pdserve.prefill.cached_tokens"] <= 16  # the chat template's first block
    assert p["pdserve.prefill.chunks"] >= 2  # more than one 512-token step
    t = transfer.attributes
    assert t["pdserve.kv.bytes"] > 0 and t["pdserve.kv.blocks"] >= usage.prompt_tokens // 16
    assert t["pdserve.kv.backend"] in ("ucx", "tcp") and t["pdserve.kv.gbps"] > 0
    assert t["pdserve.kv.status"] == "done"
    # Its cost: copy units (layers x K/V x runs of consecutive blocks), posting vs wire time.
    assert t["pdserve.kv.descriptors"] >= 2 * 30  # the default model's 30 layers, one run
    assert t["pdserve.kv.post_ms"] > 0 and t["pdserve.kv.wire_ms"] >= 0
    d = decode.attributes
    assert d["gen_ai.usage.output_tokens"] == 8 and d["pdserve.decode.tokens"] == 7
    assert d["pdserve.decode.steps"] >= 7 and d["gen_ai.response.finish_reasons"] == ["length"]


def test_a_refused_request_is_a_failed_span_with_its_error_type(
        up: UpProcess, receiver: OtlpReceiver) -> None:
    client_trace = secrets.token_hex(16)
    with pytest.raises(openai.RateLimitError):
        _client(up, LIMITED_KEY).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=100,
            extra_headers={"traceparent": f"00-{client_trace}-{secrets.token_hex(8)}-01"})
    root = next(iter(_trace_spans(receiver, client_trace, {"chat default"}).values()))
    assert root.attributes["error.type"] == "rate_limit_exceeded"
    assert root.attributes["pdserve.slo.outcome"] == "rejected"
    assert root.status_code == 2  # STATUS_CODE_ERROR


def test_the_cluster_page_shows_the_live_cluster_in_headless_chromium(
        up: UpProcess, tmp_path: Path) -> None:
    _send_traffic(up)  # a refused request for the page's recent list, charts with points
    with ChromiumPage(f"{up.url}/dashboard", tmp_path) as page:
        # Keys are configured: without one the page asks for it and shows no data.
        page.wait_for("document.body.dataset.state === 'needs-key'", timeout_s=30)
        assert page.evaluate("document.getElementById('content').hidden") is True
        page.evaluate(f"document.getElementById('key-input').value = {json.dumps(ADMIN_KEY)};"
                      "document.getElementById('key-form').requestSubmit(); true")
        page.wait_for("document.body.dataset.state === 'live'", timeout_s=30)
        page.wait_for("document.querySelectorAll('#recent tbody tr').length > 0", 30)
        shown_workers = page.evaluate(
            "[...document.querySelectorAll('#workers tbody tr')].map(r => r.dataset.workerId)")
        assert sorted(shown_workers) == sorted(w["id"] for w in up.workers())
        rows = page.evaluate("[...document.querySelectorAll('#workers tbody tr')]"
                             ".map(r => r.innerText)")
        assert all("ready" in row and "cpu" in row for row in rows), rows
        tiers = page.evaluate(
            "[...document.querySelectorAll('#tiers tbody tr')].map(r => r.dataset.tier)")
        assert {"interactive", "standard", "batch", "handoff", "limited"} <= set(tiers)
        outcomes = page.evaluate("[...document.querySelectorAll('#recent tbody tr')]"
                                 ".map(r => r.innerText)")
        assert any("limited" in row and "rejected" in row for row in outcomes), outcomes
        assert int(page.evaluate("document.getElementById('attainment-chart')"
                                 ".dataset.points")) > 0
        screenshot = tmp_path / "dashboard.png"
        page.screenshot(screenshot)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if target := os.environ.get("PDSERVE_SCREENSHOT_DIR"):
        shutil.copy(screenshot, Path(target) / "dashboard.png")
