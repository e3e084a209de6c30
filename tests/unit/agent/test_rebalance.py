"""Which worker changes role, and when none does (agent/rebalance.py)."""

from __future__ import annotations

import dataclasses

import pytest

from agent.rebalance import (PoolSignals, RebalanceConfig, RoleView, plan_rebalance, pool_signals,
                             sustained_span)
from protocol.messages import Role
from protocol.worker_load import StepModel, WorkerLoad

CFG = RebalanceConfig()  # prefill 2 s / 0.5 s, decode 85 % / 50 %, sustain 20 s, cooldown 60 s
MODEL = StepModel(base_s=0.02, prefill_token_s=1 / 8000, decode_seq_s=0.0005,
                  context_token_s=0.0, num_samples=100, num_prefill_samples=50,
                  num_decode_samples=50)


def prefill(worker_id: str, queued: int = 0, rate: float = 0.0, **view: bool) -> RoleView:
    load = WorkerLoad(num_queued_prefill_tokens=queued, prefill_tokens_per_s=rate,
                      num_running=1 if queued else 0, step_model=MODEL)
    return RoleView(worker_id, 1, Role.PREFILL, load, **view)


def decode(worker_id: str, used: int = 0, total: int = 1000, running: int = 0,
           waiting: int = 0, **view: bool) -> RoleView:
    load = WorkerLoad(num_kv_blocks_used=used, num_kv_blocks_total=total, num_running=running,
                      num_waiting=waiting, num_decoding=running, step_model=MODEL)
    return RoleView(worker_id, 3, Role.DECODE, load, **view)


def signals(at_s: float, prefill_s: float, decode_kv: float, num_prefill: int = 2,
            num_decode: int = 4, busy: float = 0.5) -> PoolSignals:
    return PoolSignals(at_s, num_prefill, num_decode, prefill_s, decode_kv, busy)


def history(pressures: list[tuple[float, float]], start_s: float = 0.0, num_prefill: int = 2,
            num_decode: int = 4, busy: float = 0.5) -> list[PoolSignals]:
    """One sample a second from `start_s`, of (prefill delay s, decode KV usage)."""
    return [signals(start_s + i, p, d, num_prefill, num_decode, busy)
            for i, (p, d) in enumerate(pressures)]


# Two prefill workers drowning in long prompts, four decode workers nearly idle.
LONG_DOC = [prefill("p-0"), prefill("p-1"), decode("d-0", running=3), decode("d-1", running=1),
            decode("d-2", running=1), decode("d-3", running=2)]
PREFILL_STARVED = history([(5.0, 0.1)] * 31)  # 0 .. 30 s
NOW = 30.0


def test_signals_are_the_prefill_queue_delay_and_the_decode_kv_usage() -> None:
    views = [prefill("p-0", queued=16000, rate=6000), prefill("p-1", queued=8000, rate=2000),
             decode("d-0", used=300), decode("d-1", used=100),
             decode("d-2", used=900, ejected=True),  # out of routing: counts nowhere
             RoleView("b-0", 1, Role.BOTH, WorkerLoad(num_queued_prefill_tokens=10**6))]
    s = pool_signals(views, 7.0)
    assert (s.at_s, s.num_prefill, s.num_decode) == (7.0, 2, 2)
    assert s.prefill_pressure == pytest.approx(24000 / 16000)  # 1.5 s at 8000 tokens/s each
    assert s.prefill_busy == pytest.approx(8000 / 16000)
    assert s.decode_pressure == pytest.approx(400 / 2000)


def test_capacity_is_borrowed_from_peers_and_no_evidence_means_no_pressure() -> None:
    unfitted = RoleView("p-1", 1, Role.PREFILL, WorkerLoad(num_queued_prefill_tokens=8000))
    s = pool_signals([prefill("p-0", queued=8000), unfitted], 0.0)
    assert s.prefill_pressure == pytest.approx(1.0)  # 16000 tokens over 2 x 8000 tokens/s
    nothing_known = pool_signals([unfitted, RoleView("d-0", 1, Role.DECODE, WorkerLoad())], 0.0)
    assert (nothing_known.prefill_pressure, nothing_known.decode_pressure) == (0.0, 0.0)


def test_a_sustained_prefill_imbalance_moves_the_least_loaded_decode_worker() -> None:
    move = plan_rebalance(PREFILL_STARVED, LONG_DOC, None, NOW, CFG)
    assert move is not None
    assert (move.worker_id, move.epoch, move.from_role, move.to_role) == \
        ("d-1", 3, "decode", "prefill")  # d-1 and d-2 run one each: the id breaks the tie
    assert "prefill queue delay 5.0 s over 2 prefill worker(s)" in move.reason
    assert "decode KV usage 10% would be 13% over 3 decode worker(s)" in move.reason


def test_a_sustained_decode_imbalance_moves_a_prefill_worker() -> None:
    views = [prefill("p-0"), prefill("p-1", queued=100), prefill("p-2"), decode("d-0"),
             decode("d-1")]
    full = history([(0.1, 0.95)] * 31, num_prefill=3, num_decode=2, busy=0.3)
    move = plan_rebalance(full, views, None, NOW, CFG)
    assert move is not None and (move.worker_id, move.to_role) == ("p-0", "decode")
    # A prefill pool that would be too busy on one worker fewer spares nothing.
    busy = history([(0.1, 0.95)] * 31, num_prefill=3, num_decode=2, busy=0.5)
    assert plan_rebalance(busy, views, None, NOW, CFG) is None


def test_a_spike_shorter_than_sustain_s_moves_nothing() -> None:
    spike = history([(0.2, 0.1)] * 15 + [(9.0, 0.1)] * 16)  # high for the last 15 s only
    assert plan_rebalance(spike, LONG_DOC, None, NOW, CFG) is None
    dip = history([(5.0, 0.1)] * 20 + [(1.0, 0.1)] + [(5.0, 0.1)] * 10)  # one sample low
    assert plan_rebalance(dip, LONG_DOC, None, NOW, CFG) is None


def test_a_history_that_does_not_reach_back_sustain_s_moves_nothing() -> None:
    short = history([(5.0, 0.1)] * 15, start_s=15.0)  # 15 .. 29 s
    assert plan_rebalance(short, LONG_DOC, None, NOW, CFG) is None
    assert sustained_span(short, None, NOW, CFG.sustain_s) is None
    # The span starts at the newest sample at or before now - sustain_s.
    span = sustained_span(PREFILL_STARVED, None, NOW, CFG.sustain_s)
    assert span is not None and (span[0].at_s, span[-1].at_s, len(span)) == (10.0, 30.0, 21)


def test_cooldown_holds_and_evidence_from_before_the_last_move_is_ignored() -> None:
    assert plan_rebalance(PREFILL_STARVED, LONG_DOC, NOW - 59.0, NOW, CFG) is None
    long_history = history([(5.0, 0.1)] * 101)  # 0 .. 100 s, starved all along
    assert plan_rebalance(long_history, LONG_DOC, 40.0, 100.0, CFG) is not None
    # Past the cooldown, but the last move was only 15 s ago: not enough new evidence.
    quick = dataclasses.replace(CFG, cooldown_s=10.0)
    assert plan_rebalance(long_history, LONG_DOC, 85.0, 100.0, quick) is None


def test_min_per_role_holds() -> None:
    views = [prefill("p-0"), prefill("p-1"), decode("d-0"), decode("d-1", ejected=True)]
    one_decoder = history([(5.0, 0.0)] * 31, num_decode=1)
    assert plan_rebalance(one_decoder, views, None, NOW, CFG) is None
    two_left = dataclasses.replace(CFG, min_per_role=2)
    three = [*views[:2], decode("d-0"), decode("d-1"), decode("d-2")]
    starved = history([(5.0, 0.0)] * 31, num_decode=3)
    assert plan_rebalance(starved, three, None, NOW, two_left) is not None
    assert plan_rebalance(starved, three[:4], None, NOW, two_left) is None


def test_ejected_workers_are_never_chosen() -> None:
    views = [prefill("p-0"), prefill("p-1"), decode("d-0", running=9),
             decode("d-1", ejected=True), decode("d-2", ejected=True),
             decode("d-3", running=5)]
    move = plan_rebalance(PREFILL_STARVED, views, None, NOW, CFG)
    assert move is not None and move.worker_id == "d-3"
    nobody = [v if v.role is Role.PREFILL or v.worker_id == "d-0"
              else dataclasses.replace(v, ejected=True) for v in views]
    assert plan_rebalance(PREFILL_STARVED, nobody, None, NOW, CFG) is None  # d-0 is the last


def test_both_and_colocated_workers_are_never_donors() -> None:
    views = [prefill("p-0"), decode("d-0"), RoleView("b-0", 1, Role.BOTH, WorkerLoad()),
             RoleView("c-0", 1, Role.COLOCATED, WorkerLoad())]
    starved = history([(5.0, 0.0)] * 31, num_prefill=1, num_decode=1)
    assert plan_rebalance(starved, views, None, NOW, CFG) is None


def test_hysteresis_the_same_load_after_a_move_does_not_move_it_back() -> None:
    # Decode -> prefill at 45 % KV usage over 2 decoders would be refused (90 % over 1)...
    tight = history([(5.0, 0.45)] * 31, num_decode=2)
    assert plan_rebalance(tight, LONG_DOC[:4], None, NOW, CFG) is None
    # ... and at 30 % over 3 it is taken: afterwards the same load reads 45 % over 2, below
    # the 85 % the reverse move needs, with the prefill pool as idle as it may be.
    before = history([(5.0, 0.30)] * 31, num_decode=3)
    assert plan_rebalance(before, LONG_DOC[:5], None, NOW, CFG) is not None
    after = history([(0.0, 0.45)] * 100, start_s=NOW + 1, num_prefill=3, num_decode=2,
                    busy=0.0)
    views = [prefill("p-0"), prefill("p-1"), prefill("d-0"), decode("d-1"), decode("d-2")]
    for now in range(int(NOW) + 61, int(NOW) + 100, 10):
        assert plan_rebalance(after, views, NOW, float(now), CFG) is None


def test_a_pool_under_pressure_on_both_sides_moves_nothing() -> None:
    both = history([(5.0, 0.9)] * 31)
    assert plan_rebalance(both, LONG_DOC, None, NOW, CFG) is None


@pytest.mark.parametrize("bad", [
    dict(prefill_low_s=2.0, prefill_high_s=2.0), dict(prefill_low_s=-0.1),
    dict(decode_low=0.9, decode_high=0.85), dict(decode_high=1.5),
    dict(prefill_spare_busy=1.0), dict(prefill_spare_busy=0.0), dict(sustain_s=0.0),
    dict(cooldown_s=-1.0), dict(min_per_role=0), dict(min_per_role=1.5),
    dict(prefill_high_s=float("inf")), dict(decode_low=float("nan"))])
def test_config_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RebalanceConfig(**bad)  # type: ignore[arg-type]
