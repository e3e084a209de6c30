"""When a drilled cluster counts as hit and as whole again (pure, over snapshots).

    fault ──▶ victim out (ejected, expired, gone from the listing, or already replaced
              by a new epoch) ──▶ whole: every worker listed before the fault is listed
              ready again (a killed or stopped one at a newer epoch), a killed agent,
              Redis or gateway replica has its successor, the fault is lifted, and a
              probe request is answered

The watch loop (drill/runner.py) takes a snapshot every half second and asks these.
"""

from __future__ import annotations

import msgspec

from drill.scenario import FaultKind, Scenario
from drill.target_cluster import AgentEventRow, WorkerRow


class Victim(msgspec.Struct, frozen=True):
    label: str  # for the table
    pid: int | None
    worker_id: str | None = None  # a worker victim's id and epoch when hit
    epoch: int = 0


def victim_out(victim: Victim, workers: list[WorkerRow]) -> bool:
    """Whether the gateway no longer routes to the process that was hit."""
    if victim.worker_id is None:
        return False
    mine = [w for w in workers if w.id == victim.worker_id]
    return not mine or any(w.state != "ready" or w.epoch > victim.epoch for w in mine)


def ejected_at_ms(victim: Victim, events: list[AgentEventRow], since_unix_ms: int
                  ) -> int | None:
    """When the agent first took the victim out after the fault, by its audit trail."""
    times = [e.at_unix_ms for e in events
             if e.worker_id == victim.worker_id and e.at_unix_ms >= since_unix_ms
             and "eject" in e.action and e.outcome.startswith("done")]
    return min(times) if times else None


def others_ejected(victim: Victim, events: list[AgentEventRow], since_unix_ms: int
                   ) -> list[str]:
    """Workers other than the victim the agent took out after the fault (a peer found
    slow while it carried the victim's share, say): reported, not judged."""
    return sorted({f"{e.worker_id} ({e.rule})" for e in events
                   if e.worker_id != victim.worker_id and e.at_unix_ms >= since_unix_ms
                   and "eject" in e.action and e.outcome.startswith("done")})


def workers_whole(scenario: Scenario, victim: Victim, expected_ids: set[str],
                  workers: list[WorkerRow]) -> bool:
    """Every worker listed before the fault is routable again; a killed, stopped or failed
    victim as a new process (a newer epoch)."""
    ready = {w.id: w.epoch for w in workers if w.state == "ready"}
    if not expected_ids <= set(ready):
        return False
    if victim.worker_id is not None and scenario.fault in (FaultKind.KILL, FaultKind.STOP,
                                                            FaultKind.FAIL):
        return ready[victim.worker_id] > victim.epoch
    return True


def replaced(victim: Victim, pids_now: list[int], num_expected: int) -> bool:
    """A killed agent, Redis or gateway replica: as many live as before, none of them the
    victim."""
    return len(pids_now) >= num_expected and victim.pid not in pids_now
