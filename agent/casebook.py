"""What the agent remembers of each worker from one tick to the next: its window of samples,
its last registry entry and its case.

    observe ─▶ remember() ─▶ windows  worker id -> its samples of the last `window_s`
                             infos    worker id -> the last registry entry seen of it
                             cases    worker id -> its WorkerCase (agent/worker_case.py)
    the control loop reads them (`sighting`, `pool_state`) and files each case it moves
    (`file`).

A lapsed worker (its lease gone, not purged yet) is remembered as a sample of the epoch of
its last scrape, or, never scraped, of its newest sample's epoch and role; one the agent
never saw with an epoch is not remembered (there is nothing to act on).

`remember` forgets the windows, the registry entries and the HEALTHY cases of workers no
longer registered; a case that holds an ejection stays until it is released, and so does
the registry entry of a worker RESTARTING (it is how a lapsed worker is restarted).

Invariants (`check_invariants`): each case is filed under its own worker id, and keeps its
own invariants (agent/worker_case.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from agent.guard_rails import ActionKind, Ledger, PoolState
from agent.health_rules import Detection, Rule, Thresholds, WorkerSample, latest_tick, still_slow
from agent.observer import Lapsed
from agent.worker_case import CaseState, Sighting, WorkerCase
from protocol.messages import Role, WorkerInfo
from state.redis_state import Registry


class Casebook:
    def __init__(self, window_s: float, thresholds: Thresholds) -> None:
        self.window_s = window_s
        self.thresholds = thresholds  # still_slow's, for the sightings of slow workers
        self.windows: dict[str, deque[WorkerSample]] = {}
        self.infos: dict[str, WorkerInfo] = {}
        self.cases: dict[str, WorkerCase] = {}

    def remember(self, observed: Sequence[WorkerSample | Lapsed], registry: Registry,
                 now_s: float) -> None:
        """One tick's observation into the windows; forget what is no longer registered."""
        self.infos.update(registry.workers)
        for seen in observed:
            window = self.windows.get(seen.worker_id)
            sample = seen.sample(window[-1] if window else None) \
                if isinstance(seen, Lapsed) else seen
            if sample is None:
                continue  # lapsed before the agent learnt its epoch: nothing to act on
            window = self.windows.setdefault(sample.worker_id, deque())
            window.append(sample)
            while window and window[0].at_s < now_s - self.window_s:
                window.popleft()
        registered = set(registry.registered_ids)
        for worker_id in set(self.windows) - registered:
            del self.windows[worker_id]
        for worker_id in set(self.infos) - registered:
            case = self.cases.get(worker_id)
            if case is None or case.state is not CaseState.RESTARTING:
                del self.infos[worker_id]
        for worker_id in set(self.cases) - registered:
            if not self.cases[worker_id].out:
                del self.cases[worker_id]  # nothing held, and its ledger's epoch is gone

    # ---------------------------------------------------------------- cases

    @property
    def out_ids(self) -> frozenset[str]:
        """The workers the agent holds out of routing now."""
        return frozenset(w for w, case in self.cases.items() if case.out)

    @property
    def held_rules(self) -> dict[str, str]:
        """Each worker held out of routing, and the rule it is held for."""
        return {w: str(case.hold.rule) for w, case in self.cases.items() if case.hold}

    def case(self, worker_id: str, epoch: int) -> WorkerCase:
        """The worker's case; a new HEALTHY one (its ledger of `epoch`) if it has none."""
        return self.cases.get(worker_id) or WorkerCase(worker_id, Ledger(epoch))

    def file(self, case: WorkerCase) -> None:
        self.cases[case.worker_id] = case

    def stamp(self, worker_id: str, epoch: int, kind: ActionKind, now_s: float) -> None:
        """An action of `kind` on (worker, epoch) was decided now: its cooldown starts."""
        self.file(self.case(worker_id, epoch).stamped(epoch, kind, now_s))

    def in_state(self, state: CaseState) -> list[WorkerCase]:
        """The cases in `state` (not HEALTHY), in the order they entered it."""
        return sorted((c for c in self.cases.values() if c.state is state),
                      key=lambda c: c.held().since_s)

    def unhandled(self, detections: Sequence[Detection]) -> list[Detection]:
        """The detections no case is handling already."""
        return [found for found in detections if found.worker_id not in self.cases
                or not self.cases[found.worker_id].handling(found)]

    # ---------------------------------------------------------------- views for the policies

    def sighting(self, case: WorkerCase, registry: Registry) -> Sighting:
        """What its case needs of the worker now (a slow one's own step model's verdict
        included, while it is ejected for slow)."""
        window = self.windows.get(case.worker_id)
        info, live = self.infos.get(case.worker_id), registry.workers.get(case.worker_id)
        judged = case.state is CaseState.EJECTED and case.held().rule is Rule.SLOW
        return Sighting(last=window[-1] if window else None,
                        known_epoch=None if info is None else info.epoch,
                        live_epoch=None if live is None else live.epoch,
                        still_slow=still_slow(window or (), latest_tick(self.windows),
                                              self.thresholds) if judged else None)

    def pool_state(self, registry: Registry) -> PoolState:
        """The guard rails' snapshot: the registry's epochs and roles (a lapsed worker's from
        its newest sample), who is out, and every case's ledger."""
        epochs = {w: i.epoch for w, i in registry.workers.items()}
        roles: dict[str, Role | None] = {w: i.role for w, i in registry.workers.items()}
        for worker_id, window in self.windows.items():
            if worker_id not in roles and window:
                epochs[worker_id], roles[worker_id] = window[-1].epoch, window[-1].role
        return PoolState(epochs=epochs, roles=roles, ejected=self.out_ids,
                         ledgers={w: case.ledger for w, case in self.cases.items()})

    def check_invariants(self) -> None:
        for worker_id, case in self.cases.items():
            if case.worker_id != worker_id:
                raise AssertionError(f"the case of {case.worker_id} is filed under {worker_id}")
            case.check_invariants()
