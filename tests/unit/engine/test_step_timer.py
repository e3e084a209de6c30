"""StepTimer's misuse errors (its timing needs CUDA: tests/gpu/test_step_timer.py)."""

from __future__ import annotations

import pytest

from engine.step_timer import StepTimer


def test_stop_without_start_is_a_clear_error():
    with pytest.raises(RuntimeError, match="without start"):
        StepTimer().stop()


def test_a_bound_below_one_is_refused():
    with pytest.raises(ValueError, match="max_pending"):
        StepTimer(max_pending=0)


def test_an_idle_timer_drains_nothing():
    timer = StepTimer()
    assert timer.drain() == [] and timer.num_pending == 0
    timer.check_invariants()
