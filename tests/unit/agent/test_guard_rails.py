"""From detections to actions within the guard rails (agent/guard_rails.py)."""

from __future__ import annotations

import pytest

from agent.guard_rails import ActionKind, Ledger, PoolState, max_ejected, plan_actions
from agent.health_rules import Detection, Rule
from protocol.messages import Role


def state(roles: dict[str, Role], epochs: dict[str, int] | None = None,
          ejected: frozenset[str] = frozenset(), ledgers: dict | None = None) -> PoolState:
    return PoolState(epochs=epochs or {w: 1 for w in roles}, roles=roles, ejected=ejected,
                     ledgers=ledgers or {})


def found(worker_id: str, rule: Rule, epoch: int = 1) -> Detection:
    return Detection(worker_id, epoch, rule, "seen")


FOUR_DECODERS = {f"d-{i}": Role.DECODE for i in range(4)} | {"p-0": Role.PREFILL}


def test_rules_map_to_actions() -> None:
    detections = [found("d-0", Rule.HUNG), found("d-1", Rule.SLOW), found("p-0", Rule.LEAKED_KV)]
    actions, held = plan_actions(detections, state(FOUR_DECODERS), 100.0)
    assert [(a.worker_id, a.kind) for a in actions] == [
        ("d-0", ActionKind.EJECT_AND_RESTART), ("d-1", ActionKind.EJECT),
        ("p-0", ActionKind.RECLAIM_KV)]
    assert held == []


def test_never_more_than_the_fraction_of_a_pool_the_gravest_first() -> None:
    detections = [found("d-0", Rule.SLOW), found("d-1", Rule.ERROR_SPIKE),
                  found("d-2", Rule.HUNG)]
    actions, held = plan_actions(detections, state(FOUR_DECODERS), 100.0, max_eject_fraction=0.5)
    assert [a.worker_id for a in actions] == ["d-2", "d-1"]  # hung, then the error spike
    assert [h.detection.worker_id for h in held] == ["d-0"]
    assert held[0].reason == "2 of the 4 decode worker(s) are out already (at most 2)"


def test_workers_already_out_count_and_are_not_ejected_twice() -> None:
    s = state(FOUR_DECODERS, ejected=frozenset({"d-3", "d-2"}))
    actions, held = plan_actions([found("d-0", Rule.SLOW)], s, 100.0)
    assert actions == [] and "2 of the 4" in held[0].reason
    # An ejected worker that turns out dead is still restarted.
    actions, _ = plan_actions([found("d-3", Rule.DEAD)], s, 100.0)
    assert [(a.worker_id, a.kind) for a in actions] == [("d-3", ActionKind.EJECT_AND_RESTART)]


def test_a_dead_worker_is_restarted_past_the_limit() -> None:
    pair = {"d-0": Role.DECODE, "d-1": Role.DECODE}
    actions, held = plan_actions([found("d-0", Rule.DEAD), found("d-1", Rule.DEAD)],
                                 state(pair), 100.0)
    assert [a.worker_id for a in actions] == ["d-0", "d-1"] and held == []


def test_a_stale_epoch_or_a_recent_action_is_held() -> None:
    s = state(FOUR_DECODERS, epochs={**{w: 1 for w in FOUR_DECODERS}, "d-0": 2},
              ledgers={"d-1": Ledger(1, last_action_s={ActionKind.EJECT_AND_RESTART: 95.0}),
                       "d-2": Ledger(1, last_action_s={ActionKind.RECLAIM_KV: 99.0})})
    actions, held = plan_actions([found("d-0", Rule.HUNG, epoch=1), found("d-1", Rule.HUNG)],
                                 s, 100.0, cooldown_s=10.0)
    assert actions == []
    assert [h.reason for h in held] == ["epoch 1 was replaced by epoch 2",
                                        "acted on 5.0 s ago (cooldown 10 s)"]
    actions, _ = plan_actions([found("d-1", Rule.HUNG)], s, 106.0, cooldown_s=10.0)
    assert [a.worker_id for a in actions] == ["d-1"]
    # The cooldown is per kind of action: a reclaim just done does not hold an ejection.
    actions, held = plan_actions([found("d-2", Rule.SLOW)], s, 100.0, cooldown_s=10.0)
    assert [a.kind for a in actions] == [ActionKind.EJECT] and held == []


@pytest.mark.parametrize("size, fraction, expected", [
    (0, 0.5, 0), (1, 0.5, 1), (2, 0.5, 1), (3, 0.5, 1), (4, 0.5, 2), (10, 0.25, 2), (3, 0.1, 1)])
def test_max_ejected(size: int, fraction: float, expected: int) -> None:
    assert max_ejected(size, fraction) == expected


def test_a_fraction_outside_its_range_is_refused() -> None:
    with pytest.raises(ValueError):
        plan_actions([], state({}), 0.0, max_eject_fraction=0.0)


def test_a_second_strike_in_one_epoch_restarts() -> None:
    s = state(FOUR_DECODERS)
    again = PoolState(epochs=s.epochs, roles=s.roles, ejected=s.ejected,
                      ledgers={"d-0": Ledger(1, num_strikes=1)})
    actions, _ = plan_actions([found("d-0", Rule.SLOW), found("d-1", Rule.ERROR_SPIKE)],
                              again, 0.0)
    assert {a.worker_id: a.kind for a in actions} == {
        "d-0": ActionKind.EJECT_AND_RESTART, "d-1": ActionKind.EJECT}
