"""The drill's pure parts: which scenarios a layout allows, when a victim is out and the
cluster whole again, and how a row is judged."""

from __future__ import annotations

import pytest

from drill.recovery import (Victim, ejected_at_ms, others_ejected, replaced, victim_out,
                            workers_whole)
from drill.row import DrillRow, judge, markdown_table
from drill.scenario import BY_NAME, Layout, has_peer, select
from drill.target_cluster import AgentEventRow, WorkerRow


def layout(roles: list[str], gateways: int = 1, faults: bool = True,
           local: bool = True) -> Layout:
    return Layout(roles=roles, num_gateways=gateways, has_agent=True, has_redis=True,
                  can_set_faults=faults, has_local_processes=local)


def worker(id: str, role: str = "decode", epoch: int = 1, state: str = "ready") -> WorkerRow:
    return WorkerRow(id=id, role=role, pid=100, epoch=epoch, control_url="http://x", state=state)


def row(**changes: object) -> DrillRow:
    base = dict(scenario="kill-decode", victim="decode-1", has_peer=True, sent=10, ok=10,
                refused_429=0, failed_by_kind={}, failed_in_flight=0, answers_checked=5,
                answers_broken=0, ejected_after_s=0.5, recovered_after_s=20.0,
                held_kv_blocks=0, held_tables=0, held_reservations=0, health_lies=[])
    return DrillRow(**{**base, **changes})  # type: ignore[arg-type]


def test_the_default_selection_follows_the_layout() -> None:
    chosen, skipped = select(None, layout(["prefill", "decode", "decode"]))
    names = [s.name for s in chosen]
    assert "kill-gateway" not in names and "slow-decode" in names
    assert any(line.startswith("kill-gateway:") for line in skipped)
    chosen, _ = select(None, layout(["prefill", "prefill", "decode", "decode"], gateways=2))
    assert len(chosen) == len(BY_NAME)
    # One decode worker: nobody to compare its steps with; no fault injection: no faults.
    chosen, _ = select(None, layout(["prefill", "decode"], faults=False))
    assert {"slow-decode", "stall-transfer", "fail-decode", "fail-prefill", "delay-decode",
            "partition-decode", "partition-prefill"}.isdisjoint(s.name for s in chosen)
    # A cluster on another host: no process of it is signalled from here; its workers'
    # control ports are degraded by their own fault proxies.
    chosen, _ = select(None, layout(["prefill", "decode", "decode"], local=False))
    assert [s.name for s in chosen] == ["slow-decode", "stall-transfer", "fail-decode",
                                        "fail-prefill", "delay-decode", "partition-decode",
                                        "partition-prefill"]


def test_a_named_scenario_the_layout_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="kill-gateway"):
        select(["kill-decode", "kill-gateway"], layout(["prefill", "decode"]))
    with pytest.raises(ValueError, match="unknown"):
        select(["kill-everything"], layout(["prefill", "decode"]))


def test_both_workers_count_in_either_group() -> None:
    both = layout(["both", "both"])
    assert has_peer(BY_NAME["kill-decode"], both) and has_peer(BY_NAME["kill-prefill"], both)
    assert not has_peer(BY_NAME["kill-prefill"], layout(["prefill", "decode", "decode"]))


def test_a_victim_is_out_when_unlisted_not_ready_or_replaced() -> None:
    victim = Victim("decode-1", 100, "decode-1", 1)
    assert not victim_out(victim, [worker("decode-0"), worker("decode-1")])
    assert victim_out(victim, [worker("decode-0")])
    assert victim_out(victim, [worker("decode-1", state="ejected")])
    assert victim_out(victim, [worker("decode-1", epoch=2)])


def test_the_audit_trail_dates_the_ejection_after_the_fault_only() -> None:
    victim = Victim("decode-1", 100, "decode-1", 1)
    events = [AgentEventRow(900, "decode-1", 1, "dead", "eject+restart", "done: ..."),
              AgentEventRow(1500, "decode-1", 1, "dead", "eject+restart", "held: limit"),
              AgentEventRow(1700, "decode-1", 1, "dead", "eject+restart", "done: killed"),
              AgentEventRow(1600, "decode-0", 1, "slow", "eject", "done")]
    assert ejected_at_ms(victim, events, since_unix_ms=1000) == 1700
    assert others_ejected(victim, events, since_unix_ms=1000) == ["decode-0 (slow)"]


def test_whole_needs_every_worker_and_a_killed_one_at_a_new_epoch() -> None:
    victim = Victim("decode-1", 100, "decode-1", 1)
    ids = {"decode-0", "decode-1"}
    kill, slow = BY_NAME["kill-decode"], BY_NAME["slow-decode"]
    assert not workers_whole(kill, victim, ids, [worker("decode-0"), worker("decode-1")])
    assert workers_whole(kill, victim, ids, [worker("decode-0"), worker("decode-1", epoch=2)])
    assert not workers_whole(kill, victim, ids, [worker("decode-0"),
                                                 worker("decode-1", epoch=2, state="ejected")])
    assert workers_whole(slow, victim, ids, [worker("decode-0"), worker("decode-1")])
    # A worker whose engine failed exits: whole again only as a new process.
    fail = BY_NAME["fail-decode"]
    assert not workers_whole(fail, victim, ids, [worker("decode-0"), worker("decode-1")])
    assert workers_whole(fail, victim, ids, [worker("decode-0"), worker("decode-1", epoch=2)])
    agent = Victim("agent", 7)
    assert not replaced(agent, [], 1) and not replaced(agent, [7], 1) and replaced(agent, [8], 1)


def test_a_clean_row_passes() -> None:
    assert judge(row(), 60, excuse_in_flight=False) == []


@pytest.mark.parametrize("changes, words", [
    ({"failed_by_kind": {"stream_error": 2}}, "2 failed with a peer left"),
    ({"answers_broken": 1}, "1 broken answers"),
    ({"held_tables": 3}, "held after: 3 tables"),
    ({"recovered_after_s": None}, "not recovered within 60 s"),
    ({"recovered_after_s": 61.0}, "not recovered within 60 s"),
    ({"health_lies": ["decode-1: 3 samples"]}, "/health 200 while refusing"),
    # 3 of 8 in SLO after recovery against all 6 before: below 100% - (10% + 1/8).
    ({"attainment_before": 1.0, "sent_before": 6, "attainment_after": 0.375,
      "sent_after": 8}, "in SLO after recovery 38% of 8, against 100% of 6 before"),
])
def test_each_broken_expectation_fails_the_row(changes: dict, words: str) -> None:
    problems = judge(row(**changes), 60, excuse_in_flight=False)
    assert len(problems) == 1 and problems[0].startswith(words), problems


def test_failures_are_excused_without_a_peer_and_in_flight_at_a_gateway_kill() -> None:
    lonely = row(has_peer=False, failed_by_kind={"stream_error": 2})
    assert judge(lonely, 60, excuse_in_flight=False) == []
    gateway = row(scenario="kill-gateway", failed_by_kind={"connection_dropped": 2},
                  failed_in_flight=2)
    assert judge(gateway, 60, excuse_in_flight=True) == []
    assert judge(row(failed_by_kind={"connection_dropped": 3}, failed_in_flight=2), 60,
                 excuse_in_flight=True) == ["1 failed with a peer left (connection_dropped 3)"]


def test_attainment_after_recovery_is_judged_with_slack_and_only_on_enough_requests() -> None:
    def judged(before: float, after: float, sent_after: int, sent_before: int = 10) -> bool:
        return bool(judge(row(attainment_before=before, sent_before=sent_before,
                              attainment_after=after, sent_after=sent_after), 60,
                          excuse_in_flight=False))

    assert not judged(1.0, 0.8, 5)  # one of five missed: within 10% + 1/5
    assert judged(1.0, 0.6, 5)  # two of five
    assert not judged(0.5, 0.4, 20)  # as bad as before: back to its baseline
    assert not judged(1.0, 0.0, 4)  # too few after to judge
    assert not judged(1.0, 0.0, 20, sent_before=3)  # too few before
    assert not judged(1.0, 1.0, 20) and judged(0.9, 0.6, 20)


def test_the_table_has_a_line_per_row_with_its_verdict() -> None:
    bad = row(scenario="stop-decode", answers_broken=1)
    bad.problems = judge(bad, 60, excuse_in_flight=False)
    lines = markdown_table([row(), bad]).splitlines()
    assert len(lines) == 4 and lines[2].endswith("| pass |")
    assert "FAIL: 1 broken answers" in lines[3]


def test_attainment_counts_the_requests_within_their_tiers_targets() -> None:
    from bench.slo import SLOTarget
    from bench.sse_client import RequestRecord
    from drill.row import attainment

    slos = {"batch": SLOTarget(ttft_ms=1000, tpot_ms=100)}

    def record(ttft_ms: float, error: str | None = None) -> RequestRecord:
        return RequestRecord(index=0, class_name="c", tier="batch", scheduled_s=0.0,
                             start_s=0.0, ttft_ms=ttft_ms, e2e_ms=ttft_ms + 500,
                             output_tokens=11, error=error)

    assert attainment([], slos) is None
    assert attainment([record(200), record(1500), record(100, "timeout"), record(900)],
                      slos) == 0.5
    table = markdown_table([row(attainment_before=1.0, attainment_after=0.75)])
    assert "| 100% / 75% |" in table
