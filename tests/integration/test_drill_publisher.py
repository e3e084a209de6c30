"""Where a drill's rows go besides its table, against a real Redis and a real HTTP
scrape: each row an audit event (what /admin/agent/events shows), and the drill's own
/metrics counting rounds, verdicts and failed requests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest

from drill.publisher import DrillMetrics, DrillPublisher, audit_event
from drill.row import DrillRow
from state.agent_state import AgentState
from state.redis_state import RedisState, connect

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def row(scenario: str, problems: list[str], failed: int = 0) -> DrillRow:
    return DrillRow(scenario=scenario, victim="decode-1-ab12cd (pid 42)", has_peer=True,
                    sent=10, ok=10 - failed, refused_429=0,
                    failed_by_kind={"timeout": failed} if failed else {}, failed_in_flight=0,
                    answers_checked=4, answers_broken=0, ejected_after_s=3.5,
                    recovered_after_s=11.0, held_kv_blocks=0, held_tables=0,
                    held_reservations=0, health_lies=[], problems=problems)


def test_a_row_becomes_an_audit_event_naming_its_victim_and_verdict() -> None:
    event = audit_event(row("partition-decode", []), 1_000)
    assert (event.worker_id, event.rule, event.action, event.outcome) == \
        ("decode-1-ab12cd", "drill:partition-decode", "drill", "done: pass")
    assert "ejected after 3.5 s, whole after 11.0 s" in event.evidence
    failed = audit_event(row("kill-decode", ["2 failed with a peer left (timeout 2)"], 2), 0)
    assert failed.outcome == "failed: 2 failed with a peer left (timeout 2)"


@pytest.fixture
async def audit(redis_url: str) -> AsyncIterator[AgentState]:
    yield AgentState(RedisState(connect(redis_url), "drill-publisher-test"))


async def test_rows_reach_the_audit_log_and_the_metrics(audit: AgentState) -> None:
    publisher = DrillPublisher(DrillMetrics(), audit)
    await publisher.start(0)
    try:
        assert publisher.url is not None
        await publisher.publish([row("kill-decode", []), row("stop-decode", [])])
        await publisher.publish([row("kill-decode", ["held after: 6 KV blocks"], 1),
                                 row("stop-decode", [])])
        events = await audit.recent_events(10)
        assert [(e.rule, e.outcome.split(":")[0]) for e in events] == [
            ("drill:stop-decode", "done"), ("drill:kill-decode", "failed"),
            ("drill:stop-decode", "done"), ("drill:kill-decode", "done")]  # newest first
        async with aiohttp.ClientSession() as session:
            async with session.get(publisher.url, timeout=aiohttp.ClientTimeout(5)) as reply:
                assert reply.status == 200
                text = await reply.text()
        for line in ('pdserve_drill_rounds_total 2',
                     'pdserve_drill_rows_total{scenario="kill-decode",verdict="pass"} 1',
                     'pdserve_drill_rows_total{scenario="kill-decode",verdict="fail"} 1',
                     'pdserve_drill_failed_requests_total{scenario="kill-decode"} 1',
                     'pdserve_drill_recovered_seconds{scenario="stop-decode"} 11',
                     'pdserve_drill_last_round_passed 0'):
            assert line in text.splitlines(), text
    finally:
        await publisher.stop()
