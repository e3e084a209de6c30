"""The agent's audit trail: every decision, where an operator can find it.

Each `Decision` (agent/decision.py: what was seen, which rule fired, what was done, the
outcome) becomes one `AgentEvent` (its JSON spelling) and goes to:
  * the JSON-lines file given with --audit-log (appended, flushed per event);
  * the Redis stream `{ns}:agent_events`, which the gateway serves as GET /admin/agent/events
    (best effort: with Redis down the file and the counters still get it);
  * Prometheus counters on the agent's /metrics: pdserve_agent_decisions_total{rule,
    action,outcome} with outcome done | dry_run | held | failed;
  * one log line (and, with `echo`, one JSON line there).
Root-cause reports (agent/root_cause.py) go the same ways: the file (one JSON line each),
the Redis stream `{ns}:agent_reports` (GET /admin/agent/reports), the counter
pdserve_agent_reports_total{tier,cause} and one log line.
A decision held for the same reason as the last time it was seen (same worker, epoch, rule
and action; the figures in the reason aside) is recorded once, not at every tick: the log
says when something changed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO

import msgspec

from agent.decision import Decision, EventAction, EventRule, OutcomeKind, RoleSwitch
from protocol.root_cause_report import RootCauseReport
from state.agent_state import AgentState
from state.redis_state import REDIS_FAILURES, raise_if_cancelling
from telemetry.metrics import MetricsRegistry

log = logging.getLogger(__name__)
_DIGITS = re.compile(r"\d+(\.\d+)?")


class Audit:
    def __init__(self, agent_state: AgentState, metrics: MetricsRegistry,
                 path: Path | None = None, echo: IO[str] | None = None) -> None:
        self.agent_state = agent_state
        self.echo = echo  # also write each event here as a JSON line (`--once`: stdout)
        self.decisions = metrics.counter("pdserve_agent_decisions_total",
                                         "the agent's decisions, by rule, action and outcome",
                                         ("rule", "action", "outcome"))
        self.reports = metrics.counter("pdserve_agent_reports_total",
                                       "root-cause reports, by tier and first cause "
                                       "(none: nothing observed explains the drop)",
                                       ("tier", "cause"))
        self.path = path
        self._file: IO[bytes] | None = None
        # (worker, epoch, rule, action) -> the last held reason, its figures masked
        self._last_held: dict[tuple[str, int, EventRule, EventAction | RoleSwitch], str] = {}
        self.num_redis_failures = 0

    def open(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    async def record(self, decision: Decision) -> bool:
        """Record one decision; False when it repeats the last held one (not recorded)."""
        outcome = decision.outcome
        key = (decision.worker_id, decision.epoch, decision.rule, decision.action)
        if outcome.kind is OutcomeKind.HELD:
            reason = _DIGITS.sub("#", str(outcome))  # "acted on 2.0 s ago" repeats itself
            if self._last_held.get(key) == reason:
                return False
            self._last_held[key] = reason
        else:
            self._last_held.pop(key, None)
        event = decision.to_event()
        self.decisions.inc(rule=event.rule, action=event.action, outcome=outcome.label)
        acted = outcome.kind not in (OutcomeKind.DRY_RUN, OutcomeKind.HELD)
        level = logging.WARNING if acted else logging.INFO
        log.log(level, "%s %s (epoch %d): %s -> %s: %s", event.rule, event.worker_id,
                event.epoch, event.evidence, event.action, event.outcome)
        await self._write(msgspec.json.encode(event), lambda: self.agent_state.record(event))
        return True

    async def report(self, report: RootCauseReport) -> None:
        """Record one root-cause report."""
        cause = report.cause
        self.reports.inc(tier=report.tier, cause=cause.kind.value if cause else "none")
        log.warning("root cause, tier %s: %s -> %s", report.tier, report.trigger,
                    f"{cause.kind.value} ({cause.stage.value}): {cause.evidence}" if cause
                    else "nothing observed explains it")
        await self._write(msgspec.json.encode(report),
                          lambda: self.agent_state.record_report(report))

    async def _write(self, line: bytes, store: Callable[[], Awaitable[object]]) -> None:
        """One JSON line to the file and the echo, then `store()` into Redis (a failure
        there is counted, not raised: the file keeps the record)."""
        if self._file is not None:
            self._file.write(line + b"\n")
            self._file.flush()
        if self.echo is not None:
            print(line.decode(), file=self.echo, flush=True)
        try:
            await store()
        except REDIS_FAILURES as exc:
            raise_if_cancelling(exc)
            self.num_redis_failures += 1
