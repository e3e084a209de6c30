"""Where a drill's rows go besides its table: Prometheus metrics, and the cluster's audit
log (the operations agent's events in Redis, which `/admin/agent/events` and the cluster
page show), so a staging cluster drilled on a schedule (`--schedule`) keeps its record.

    DrillMetrics   pdserve_drill_* series of one drill process (GET /metrics on
                   --metrics-port): rounds, rows by scenario and verdict, failed requests,
                   the last ejection and recovery times
    audit_event()  one row as an audit event (pure): action "drill", rule "drill:SCENARIO"
    DrillPublisher serves the metrics (start / stop own the server) and records each row's
                   event (under the state's deadline; Redis down: logged, the drill goes on)

Lifecycle: start() (binds 127.0.0.1, port 0: the OS picks) → publish(rows) per round →
stop(). Invariant: every row published is counted once in `rows_total`.
"""

from __future__ import annotations

import sys

from aiohttp import web

from drill.row import DrillRow
from state.agent_state import AgentEvent, AgentState, now_unix_ms
from state.redis_state import REDIS_FAILURES
from telemetry.metrics import MetricsRegistry


class DrillMetrics:
    def __init__(self) -> None:
        self.registry = MetricsRegistry()
        r = self.registry
        self.rounds = r.counter("pdserve_drill_rounds_total", "drill rounds finished")
        self.rows = r.counter("pdserve_drill_rows_total", "scenarios run, by verdict",
                              ("scenario", "verdict"))
        self.failed = r.counter("pdserve_drill_failed_requests_total",
                                "requests that failed during a scenario", ("scenario",))
        self.ejected_s = r.gauge("pdserve_drill_ejected_seconds",
                                 "the last run's fault → victim out of routing", ("scenario",))
        self.recovered_s = r.gauge("pdserve_drill_recovered_seconds",
                                   "the last run's fault → whole again", ("scenario",))
        self.last_passed = r.gauge("pdserve_drill_last_round_passed",
                                   "1 when every row of the last round passed")

    def observe(self, rows: list[DrillRow]) -> None:
        self.rounds.inc()
        for row in rows:
            self.rows.inc(scenario=row.scenario, verdict="fail" if row.problems else "pass")
            self.failed.inc(row.num_failed, scenario=row.scenario)
            if row.ejected_after_s is not None:
                self.ejected_s.set(row.ejected_after_s, scenario=row.scenario)
            if row.recovered_after_s is not None:
                self.recovered_s.set(row.recovered_after_s, scenario=row.scenario)
        self.last_passed.set(float(all(not row.problems for row in rows)))


def audit_event(row: DrillRow, at_unix_ms: int) -> AgentEvent:
    """One row as an audit event (pure): the victim's worker id when a worker was hit."""
    victim = row.victim.split(" ", 1)[0]
    evidence = (f"{row.ok}/{row.sent} ok, {row.num_failed} failed, {row.answers_broken} "
                f"broken answers; ejected after {_seconds(row.ejected_after_s)}, whole after "
                f"{_seconds(row.recovered_after_s)}; victim {row.victim}")
    outcome = "done: pass" if not row.problems else "failed: " + "; ".join(row.problems)
    return AgentEvent(at_unix_ms=at_unix_ms, worker_id=victim, epoch=0,
                      rule=f"drill:{row.scenario}", evidence=evidence, action="drill",
                      outcome=outcome[:1000])


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


class DrillPublisher:
    def __init__(self, metrics: DrillMetrics, audit: AgentState | None) -> None:
        self.metrics = metrics
        self.audit = audit
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self, port: int | None) -> None:
        """Serve GET /metrics on 127.0.0.1:`port` (None: no server)."""
        if port is None:
            return
        app = web.Application()

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(text=self.metrics.registry.render(),
                                headers={"Content-Type": self.metrics.registry.content_type})

        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        host, bound = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{bound}/metrics"

    async def publish(self, rows: list[DrillRow]) -> None:
        self.metrics.observe(rows)
        if self.audit is None:
            return
        try:
            for row in rows:
                await self.audit.record(audit_event(row, now_unix_ms()), timeout_s=2.0)
        except REDIS_FAILURES as exc:
            print(f"pdserve drill: the audit log did not take this round's rows ({exc!r})",
                  file=sys.stderr)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        if self.audit is not None:
            await self.audit.state.aclose()
