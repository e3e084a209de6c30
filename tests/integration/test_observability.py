"""Observability of a real `pdserve up` cluster (1 prefill + 1 decode worker, API keys on):

- a real Prometheus server scrapes the gateway and both workers, and every PromQL
  expression of the shipped Grafana dashboard returns data;

The traffic: a long prompt handed off P -> D (a KV transfer), short chats on two tiers, and
one request over its key's rate limit (a 429: the `rejected` SLO outcome).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import openai
import pytest
from prometheus_server import PrometheusServer
from up_process import REPO, UpProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "pdserve.json"
ADMIN_KEY, LIMITED_KEY = "sk-observability-admin", "sk-observability-limited"
LONG_PROMPT = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 80)
TIERS = """
[tiers.handoff]
priority = 1
ttft_ms = 60000
tpot_ms = 5000
max_queued = 16
max_running = 16
local_prefill_max_tokens = 0

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
def up(tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(TIERS)
    keys = f"{ADMIN_KEY}:standard:header+admin,{LIMITED_KEY}:limited"
    process = UpProcess("--tiers", str(tiers), log_dir=tmp_path_factory.mktemp("up-logs"),
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
    jobs = {"pdserve-gateway": [up.url.removeprefix("http://")]}
    for worker in workers:
        jobs.setdefault(f"pdserve-{worker['role']}", []).append(
            worker["control_url"].removeprefix("http://"))
    prometheus = PrometheusServer(jobs, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            health = prometheus.targets_up()
            if len(health) == 3 and set(health.values()) == {"up"}:
                break
            time.sleep(0.5)
        assert set(prometheus.targets_up().values()) == {"up"}, prometheus.targets_up()
        _send_traffic(up)
        # Every query at one moment a few scrapes after the traffic, as one dashboard refresh.
        at = time.time() + 3
        time.sleep(5)
        missing = {title: query for title, query in
                   ((title, _fill_variables(expr)) for title, expr in _dashboard_expressions())
                   if not _has_data(prometheus.query(query, at))}
        assert not missing, f"dashboard queries without data: {missing}"
    finally:
        prometheus.stop()
