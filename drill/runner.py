"""A drill: each scenario in turn against one cluster, under a steady load.

One scenario:

    wait until whole ──▶ load + answer checks + /health watch start
      ──▶ --before-s ──▶ inject (drill/fault.py) ──▶ watch every 0.5 s until whole again
      (drill/recovery.py) or --recovery-timeout-s ──▶ --after-s ──▶ lift the fault
      ──▶ stop sending; the requests in flight finish ──▶ wait until idle, read what is
      held ──▶ DrillRow, judged (drill/row.py)

The load, the answer checker and the /health watch are tasks of one TaskGroup per
scenario; the `stop` event ends all three, and the group is left only once they ended.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

import msgspec

from bench.answer_check import CheckRecord, run_checks, summarize_checks
from bench.slo import SLOTarget
from drill.fault import FaultSettings, inject, lift, pick_worker, process_pids
from drill.recovery import (Victim, ejected_at_ms, others_ejected, replaced, victim_out,
                            workers_whole)
from drill.row import DrillRow, attainment, judge
from drill.scenario import TIMED_FAULTS, FaultKind, Layout, Scenario, Target, has_peer
from drill.steady_load import SteadyLoad, TimedRecord
from drill.target_cluster import TargetCluster, WorkerRow
from rpc.errors import ControlError

WATCH_PERIOD_S = 0.5
HEALTH_PERIOD_S = 1.0
ROUTED_AROUND_S = 5.0  # idle this long under load: the router sends it nothing


class DrillOptions(msgspec.Struct, frozen=True):
    before_s: float
    after_s: float
    fault_s: float  # how long stall-transfer's, delay-*'s and partition-*'s fault stays on
    recovery_timeout_s: float
    idle_timeout_s: float  # for the load to drain and the workers to let go after it
    check_tokens: int
    request_timeout_s: float
    faults: FaultSettings


def say(line: str) -> None:
    print(f"[drill {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


class Drill:
    def __init__(self, cluster: TargetCluster, layout: Layout, model: str,
                 make_load: Callable[[int], SteadyLoad], options: DrillOptions,
                 check_prompts: Sequence[str], slos: dict[str, SLOTarget]) -> None:
        """`make_load(i)`: the load of the i-th scenario (its own seed); `slos`: its
        workload's targets by tier (the rows' attainment)."""
        self.cluster = cluster
        self.layout = layout
        self.model = model
        self.make_load = make_load
        self.slos = slos
        self.options = options
        self.check_prompts = check_prompts

    async def wait_whole(self, timeout_s: float) -> list[WorkerRow]:
        """Until every worker of the layout is listed ready and a probe is answered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = await self.cluster.workers() or []
            ready = [w for w in workers if w.state == "ready"]
            if len(ready) >= len(self.layout.roles) and \
                    await self.cluster.probe_completion(self.model):
                return ready
            await asyncio.sleep(WATCH_PERIOD_S)
        raise RuntimeError(f"the cluster was not whole within {timeout_s:.0f} s")

    async def _watch_health(self, stop: asyncio.Event, lies: Counter[str]) -> None:
        """Counts samples where a routable worker answers /health 200 and /ready not."""
        while not stop.is_set():
            for worker in [w for w in await self.cluster.workers() or []
                           if w.state == "ready"]:
                health, ready = await self.cluster.worker_probes(worker)
                if health == 200 and ready is not None and ready != 200:
                    lies[worker.id] += 1
            try:
                await asyncio.wait_for(stop.wait(), HEALTH_PERIOD_S)
            except TimeoutError:
                pass

    async def _held_after(self) -> tuple[int | None, int | None, int | None]:
        """KV blocks used, held tables and reservations over the workers, once every one
        reads zero or the idle timeout passed (then the last figures; None: a worker's
        state could not be read, or the cluster's token is not known)."""
        if self.cluster.internal_token is None:
            return None, None, None
        deadline = time.monotonic() + self.options.idle_timeout_s
        while True:
            totals: list[int | None] = [0, 0, 0]
            for worker in await self.cluster.workers() or []:
                state = await self.cluster.worker_state(worker)
                for i, key in enumerate(("num_kv_blocks_used", "num_held_tables",
                                         "num_reservations")):
                    value = None if state is None else state.get(key, 0)
                    total = totals[i]
                    totals[i] = total + value if isinstance(value, int) and total is not None \
                        else None
            if totals == [0, 0, 0] or time.monotonic() > deadline:
                return totals[0], totals[1], totals[2]
            await asyncio.sleep(WATCH_PERIOD_S)

    async def _routed_around(self, victim: Victim, workers: list[WorkerRow], now: float,
                             idle_since: list[float]) -> bool:
        """Whether the slowed victim ran nothing for ROUTED_AROUND_S while the load went on:
        the router, which predicts each worker's steps from its fitted step model, sends a
        slow worker nothing, and the agent, which judges decode steps, then sees none.
        `idle_since` holds when its idle stretch began (empty: busy)."""
        mine = [w for w in workers if w.id == victim.worker_id and w.epoch == victim.epoch]
        state = await self.cluster.worker_state(mine[0]) if mine else None
        if state is None or state.get("num_running") or state.get("num_waiting"):
            idle_since.clear()
            return False
        if not idle_since:
            idle_since.append(now)
        return now - idle_since[0] >= ROUTED_AROUND_S

    async def _recover(self, scenario: Scenario, victim: Victim, expected_ids: set[str],
                       fault_at: float, fault_wall_ms: int, supervisor_pid: int | None,
                       notes: list[str]) -> tuple[float | None, float | None]:
        """(seconds to the first ejection, seconds to whole again); None: not seen."""
        ejected_s: float | None = None
        out = False  # ejected, or (slow-decode) routed around
        idle_since: list[float] = []
        lifted = scenario.fault not in (FaultKind.SLOW, *TIMED_FAULTS)
        num_before = len([p for p in process_pids(scenario.target, supervisor_pid)
                          if p != victim.pid]) + 1 \
            if not scenario.target.is_worker and supervisor_pid else 0
        deadline = fault_at + self.options.recovery_timeout_s
        while time.monotonic() < deadline:
            workers = await self.cluster.workers() or []
            now = time.monotonic()
            if ejected_s is None and victim.worker_id is not None:
                at_ms = ejected_at_ms(victim, await self.cluster.agent_events(),
                                      fault_wall_ms)
                if at_ms is not None:
                    ejected_s = max(0.0, (at_ms - fault_wall_ms) / 1000)
                elif workers and victim_out(victim, workers):
                    ejected_s = now - fault_at
                if ejected_s is not None:
                    out = True
                    say(f"{scenario.name}: {victim.worker_id} out after {ejected_s:.1f} s")
            if ejected_s is None and victim.worker_id is None and supervisor_pid is not None \
                    and scenario.fault is FaultKind.STOP and victim.pid not in \
                    process_pids(scenario.target, supervisor_pid):
                ejected_s = now - fault_at  # the frozen process is gone: killed by `pdserve up`
                say(f"{scenario.name}: pid {victim.pid} gone after {ejected_s:.1f} s")
            if scenario.fault is FaultKind.SLOW and not out and \
                    await self._routed_around(victim, workers, now, idle_since):
                out = True
                notes.append(f"routed around: ran nothing from {idle_since[0] - fault_at:.1f} s "
                             f"after the fault on, for {ROUTED_AROUND_S:g} s (not ejected)")
                say(f"{scenario.name}: {victim.worker_id} routed around")
            if not lifted and ((scenario.fault is FaultKind.SLOW and out) or (
                    scenario.fault in TIMED_FAULTS and now - fault_at >= self.options.fault_s)):
                await lift(self.cluster, scenario, victim)
                lifted = True
                notes.append(f"fault lifted after {now - fault_at:.1f} s")
            whole = lifted and workers_whole(scenario, victim, expected_ids, workers) \
                and (out or not scenario.expects_ejection)
            if whole and not scenario.target.is_worker and supervisor_pid is not None:
                whole = replaced(victim, process_pids(scenario.target, supervisor_pid),
                                 num_before)
            if whole and scenario.target is Target.GATEWAY:
                whole = await self.cluster.num_replicas_ready(self.layout.num_gateways) \
                    >= self.layout.num_gateways
            if whole and await self.cluster.probe_completion(self.model):
                return ejected_s, time.monotonic() - fault_at
            await asyncio.sleep(WATCH_PERIOD_S)
        return ejected_s, None

    async def _pushes(self, scenario: Scenario, workers: list[WorkerRow]) -> float | None:
        """stall-transfer: the KV pushes its victim completed so far (else None)."""
        if scenario.fault is not FaultKind.STALL:
            return None
        return await self.cluster.num_pushes(pick_worker(scenario, workers))

    async def run_scenario(self, index: int, scenario: Scenario) -> DrillRow:
        o = self.options
        workers = await self.wait_whole(o.recovery_timeout_s + o.idle_timeout_s)
        supervisor_pid = self.cluster.supervisor_pid(workers)
        expected_ids = {w.id for w in workers}
        stop = asyncio.Event()
        checks: list[CheckRecord] = []
        lies: Counter[str] = Counter()
        notes: list[str] = []
        victim: Victim | None = None
        ejected_s = recovered_s = None
        fault_at, fault_wall_ms = 0.0, 0
        pushes: float | None = None
        error: str | None = None  # the drill's own failure, not the cluster's
        say(f"{scenario.name}: load for {o.before_s:g} s, then the fault")
        async with asyncio.TaskGroup() as tg:
            load = tg.create_task(self.make_load(index).run(stop))
            tg.create_task(run_checks(self.cluster.url, self.model, o.check_tokens,
                                      o.request_timeout_s, stop, checks, self.check_prompts))
            tg.create_task(self._watch_health(stop, lies))
            try:
                await asyncio.sleep(o.before_s)
                fault_at, fault_wall_ms = time.monotonic(), int(time.time() * 1000)
                pushes = await self._pushes(scenario, workers)
                victim = await inject(self.cluster, scenario, workers, supervisor_pid,
                                      o.faults)
            except (RuntimeError, ControlError, TimeoutError) as exc:
                error = f"the fault could not be injected: {exc}"
                say(f"{scenario.name}: {error}")
            else:
                say(f"{scenario.name}: hit {victim.label}")
                ejected_s, recovered_s = await self._recover(
                    scenario, victim, expected_ids, fault_at, fault_wall_ms,
                    supervisor_pid, notes)
                if pushes is not None:
                    after = await self._pushes(scenario, workers)
                    done = "?" if after is None else f"{after - pushes:g}"
                    notes.append(f"KV pushes the victim completed, fault to recovery: {done}")
                say(f"{scenario.name}: " + (f"whole again after {recovered_s:.1f} s"
                                            if recovered_s is not None else "NOT recovered")
                    + f"; load for {o.after_s:g} s more")
                await asyncio.sleep(o.after_s)
            finally:
                if victim is not None:
                    await lift(self.cluster, scenario, victim)
                stop.set()
        held = await self._held_after()
        row = self._row(scenario, victim, load.result(), checks, fault_at, ejected_s,
                        recovered_s, held, lies, notes)
        if victim is not None:
            row.others_ejected = others_ejected(victim, await self.cluster.agent_events(),
                                                fault_wall_ms)
        if error is not None:
            row.problems.insert(0, error)
        return row

    def _row(self, scenario: Scenario, victim: Victim | None, records: list[TimedRecord],
             checks: list[CheckRecord], fault_at: float, ejected_s: float | None,
             recovered_s: float | None, held: tuple[int | None, int | None, int | None],
             lies: Counter[str], notes: list[str]) -> DrillRow:
        failed: Counter[str] = Counter()
        in_flight = 0
        # A frozen gateway replica holds what the kernel gave its socket until it is killed.
        gone_at = fault_at + ejected_s if ejected_s is not None and victim is not None \
            and victim.worker_id is None else fault_at
        for timed in records:
            error = timed.record.error
            if error is not None and error != "http_429":
                failed[error] += 1
                in_flight += timed.start_s < gone_at and fault_at <= timed.end_s
        summary = summarize_checks(checks)
        for check in checks:
            if check.outcome == "failed":
                failed["answer_check: " + check.detail.split(":")[0][:40]] += 1
        # The checker asks one prompt at a time: at most one of its answers was in flight.
        in_flight += min(1, summary.failed)
        for wrong in summary.broken_records:
            notes.append(f"broken answer: prompt {wrong.prompt_index}: {wrong.detail}")
        whole_at = None if recovered_s is None else fault_at + recovered_s
        before = [t.record for t in records if t.end_s < fault_at]  # untouched by the fault
        after = [] if whole_at is None else [t.record for t in records if t.start_s >= whole_at]
        row = DrillRow(
            attainment_before=attainment(before, self.slos), sent_before=len(before),
            attainment_after=attainment(after, self.slos), sent_after=len(after),
            scenario=scenario.name, victim=victim.label if victim else "-",
            has_peer=has_peer(scenario, self.layout), sent=len(records),
            ok=sum(t.record.error is None for t in records),
            refused_429=sum(t.record.error == "http_429" for t in records),
            failed_by_kind=dict(failed), failed_in_flight=in_flight,
            answers_checked=summary.checked, answers_broken=summary.broken,
            ejected_after_s=ejected_s, recovered_after_s=recovered_s,
            held_kv_blocks=held[0], held_tables=held[1], held_reservations=held[2],
            health_lies=[f"{w}: {n} samples" for w, n in sorted(lies.items())], notes=notes)
        row.problems = judge(row, self.options.recovery_timeout_s,
                             excuse_in_flight=scenario.target is Target.GATEWAY)
        say(f"{scenario.name}: " + ("pass" if not row.problems else
                                    "FAIL: " + "; ".join(row.problems)))
        return row

    async def run(self, scenarios: list[Scenario],
                  on_row: Callable[[list[DrillRow]], None] | None = None) -> list[DrillRow]:
        """Every scenario in turn; a cluster that is not whole again before the next one
        ends the drill there (its row says so: every later row would be judged on a
        cluster already broken). `on_row` gets the rows so far after each one (a long
        drill's report is written as it goes)."""
        rows: list[DrillRow] = []
        for index, scenario in enumerate(scenarios):
            try:
                rows.append(await self.run_scenario(index, scenario))
            except RuntimeError as exc:
                say(f"{scenario.name}: not run: {exc}; the drill stops here")
                rows.append(DrillRow(
                    scenario=scenario.name, victim="-", has_peer=False, sent=0, ok=0,
                    refused_429=0, failed_by_kind={}, failed_in_flight=0, answers_checked=0,
                    answers_broken=0, ejected_after_s=None, recovered_after_s=None,
                    held_kv_blocks=None, held_tables=None, held_reservations=None,
                    health_lies=[], problems=[f"not run: {exc}"]))
                break
            finally:
                if on_row is not None:
                    on_row(rows)
        return rows
