"""The step timer on a CUDA device: each step's device time, in launch order, never waited for.

CUDA only (CUDA events); the reports' use of the samples is tested on the CPU in
tests/unit/worker/test_step_reports.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.step_shape import StepShape
from engine.step_timer import StepTimer

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


_CYCLES_PER_MS: list[float] = []


def sleep_cycles(ms: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spends in about `ms` milliseconds (measured
    once: the clock is whatever the card runs at)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(20_000_000 / start.elapsed_time(end))
    return int(_CYCLES_PER_MS[0] * ms)


def test_steps_are_timed_on_the_device_in_launch_order():
    timer = StepTimer()
    torch.cuda.synchronize()
    shapes = [StepShape(512, 0, 0), StepShape(0, 4, 400), StepShape(64, 2, 100)]
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for n, shape in enumerate(shapes):
        timer.start(shape)
        torch.cuda._sleep(sleep_cycles(20 * (n + 1)))  # 20, 40, 60 ms at the measured clock
        timer.stop()
    last.record()
    # Queued far ahead of the device: nothing has finished, and drain does not wait.
    started = time.perf_counter()
    assert timer.drain() == [] and timer.num_pending == 3
    assert time.perf_counter() - started < 0.01
    torch.cuda.synchronize()
    done = timer.drain()
    assert [s.shape for s in done] == shapes and timer.num_pending == 0
    seconds = [s.seconds for s in done]
    span = first.elapsed_time(last) / 1e3
    # Each step's own work, not the wait for the ones before it: the steps tile the span
    # (times from each launch would add up to about twice it). Compared with the span,
    # not with nominal lengths: the clock may still be rising from idle.
    assert all(s > 0.001 for s in seconds), seconds
    assert abs(sum(seconds) - span) < 0.1 * span, (seconds, span)
    assert timer.drain() == []


def test_a_pending_step_holds_back_those_after_it():
    timer = StepTimer()
    timer.start(StepShape(1, 0, 0))
    torch.cuda._sleep(sleep_cycles(50))
    timer.stop()
    timer.start(StepShape(2, 0, 0))
    timer.stop()
    assert timer.drain() == []
    torch.cuda.synchronize()
    assert [s.shape.prefill_tokens for s in timer.drain()] == [1, 2]


def test_undrained_steps_are_bounded():
    timer = StepTimer(max_pending=2)
    for n in range(5):
        timer.start(StepShape(n + 1, 0, 0))
        timer.stop()
    torch.cuda.synchronize()
    timer.check_invariants()
    assert [s.shape.prefill_tokens for s in timer.drain()] == [4, 5]
    assert timer.num_dropped == 3


def test_a_second_start_is_a_clear_error():
    timer = StepTimer()
    timer.start(StepShape())
    with pytest.raises(RuntimeError, match="already being timed"):
        timer.start(StepShape())
