"""One scenario's result: the row of the drill's table, and its judgement (pure).

A row passes when
  * no request failed, where a peer of the victim's role was left to serve it (the
    requests a killed gateway replica held when it died are excused: they were on its
    sockets, and no other process can finish them); refusals (429) are admission's
    answers to load, not failures, and are counted apart;
  * no answer was broken (a token duplicated or lost: bench/answer_check.py);
  * nothing is held once the cluster is idle: KV blocks in use, held block tables and
    reservations, summed over the workers;
  * the cluster recovered within the recovery timeout: every worker back and routable (a
    restarted one at a new epoch), the process killed replaced, a probe request answered;
  * no worker answered /health with 200 while it refused requests (its /ready said no)
    and the gateway listed it as routable;
  * the load was back within its SLO after recovery: the share of requests sent once the
    cluster was whole that met their tier's targets is at most `attainment_slack(n)` below
    the share of those that ended before the fault. Judged only where both sides had at least
    MIN_JUDGED requests; a few requests on shared cores make a noisy share, so the slack is
    10 points plus one request's worth.
"""

from __future__ import annotations

import msgspec

from bench.report import attains
from bench.sse_client import RequestRecord
from bench.slo import SLOTarget

MIN_JUDGED = 5  # requests on each side of the fault before attainment is judged


def attainment_slack(num_after: int) -> float:
    """How far below its share before the fault the share after recovery may fall."""
    return 0.1 + 1 / num_after


class DrillRow(msgspec.Struct):
    scenario: str
    victim: str  # what was hit, e.g. "decode-1-ab12cd (pid 4242)"
    has_peer: bool  # another process of the victim's role kept serving
    sent: int
    ok: int
    refused_429: int
    failed_by_kind: dict[str, int]  # load and answer checks, by error kind
    # Of those, requests in flight at the fault (sent before it; a frozen gateway replica:
    # from the fault until it was gone, the requests its socket may have held).
    failed_in_flight: int
    answers_checked: int
    answers_broken: int
    ejected_after_s: float | None  # fault → the victim first seen out of routing
    recovered_after_s: float | None  # fault → whole again (None: not within the timeout)
    held_kv_blocks: int | None  # None: not readable (the cluster's token unknown)
    held_tables: int | None
    held_reservations: int | None
    health_lies: list[str]  # "worker-id: N samples" of /health 200 while refusing
    others_ejected: list[str] = []  # "worker-id (rule)": peers the agent took out meanwhile
    # Shares of the load's requests within their tier's SLO: those ended before the fault,
    # and those sent once the cluster was whole again (None: none sent then); judged as
    # the module doc says.
    attainment_before: float | None = None
    attainment_after: float | None = None
    sent_before: int = 0  # the requests each share is of
    sent_after: int = 0
    problems: list[str] = []
    notes: list[str] = []

    @property
    def num_failed(self) -> int:
        return sum(self.failed_by_kind.values())


def judge(row: DrillRow, recovery_timeout_s: float, excuse_in_flight: bool) -> list[str]:
    """The expectations `row` breaks (empty: it passes); pure."""
    problems = []
    excused = row.failed_in_flight if excuse_in_flight else 0
    if row.has_peer and row.num_failed > excused:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(row.failed_by_kind.items()))
        problems.append(f"{row.num_failed - excused} failed with a peer left ({kinds})")
    if row.answers_broken:
        problems.append(f"{row.answers_broken} broken answers")
    held = {"KV blocks": row.held_kv_blocks, "tables": row.held_tables,
            "reservations": row.held_reservations}
    if any(held.values()):
        problems.append("held after: " + ", ".join(f"{v} {k}" for k, v in held.items() if v))
    if row.recovered_after_s is None or row.recovered_after_s > recovery_timeout_s:
        problems.append(f"not recovered within {recovery_timeout_s:g} s")
    if row.health_lies:
        problems.append("/health 200 while refusing: " + "; ".join(row.health_lies))
    before, after = row.attainment_before, row.attainment_after
    if before is not None and after is not None and min(row.sent_before, row.sent_after) \
            >= MIN_JUDGED and after < before - attainment_slack(row.sent_after):
        problems.append(f"in SLO after recovery {_share(after)} of {row.sent_after}, "
                        f"against {_share(before)} of {row.sent_before} before")
    return problems


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _held(row: DrillRow) -> str:
    values = (row.held_kv_blocks, row.held_tables, row.held_reservations)
    return " / ".join("?" if v is None else str(v) for v in values)


def attainment(records: list[RequestRecord], slos: dict[str, SLOTarget]) -> float | None:
    """The share of `records` within their tier's SLO (None: no record); pure."""
    if not records:
        return None
    return sum(attains(record, slos) for record in records) / len(records)


def markdown_table(rows: list[DrillRow]) -> str:
    lines = ["| scenario | victim | sent | ok | failed (by kind) | 429 | broken / checked "
             "| ejected s | recovered s | in SLO before / after "
             "| held blocks / tables / reservations "
             "| /health 200 while refusing | others ejected | verdict |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---|---|---|---|---|"]
    for r in rows:
        failed = ", ".join(f"{k} {v}" for k, v in sorted(r.failed_by_kind.items()))
        if r.failed_in_flight:
            failed += f" ({r.failed_in_flight} in flight at the fault)"
        verdict = "pass" if not r.problems else "FAIL: " + "; ".join(r.problems)
        lines.append(f"| {r.scenario} | {r.victim} | {r.sent} | {r.ok} | {failed or '0'} | "
                     f"{r.refused_429} | {r.answers_broken} / {r.answers_checked} | "
                     f"{_seconds(r.ejected_after_s)} | {_seconds(r.recovered_after_s)} | "
                     f"{_share(r.attainment_before)} / {_share(r.attainment_after)} | "
                     f"{_held(r)} | {'; '.join(r.health_lies) or 'none'} | "
                     f"{', '.join(r.others_ejected) or 'none'} | {verdict} |")
    return "\n".join(lines)
