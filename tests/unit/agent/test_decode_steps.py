"""The agent's mean decode step between two health reports: the device's time, or the wall
time per step where the host is slower (agent/observer.py `decode_steps`)."""

from __future__ import annotations

import pytest

from agent.observer import decode_steps
from protocol.agent_messages import HealthReport
from protocol.worker_load import WorkerLoad


def health(num_steps: int, sum_s: float, num_walls: int = 0,
           wall_sum_s: float = 0.0) -> HealthReport:
    return HealthReport(epoch=1, load=WorkerLoad(), num_steps=num_steps, step_sum_s=sum_s,
                        num_decode_steps=num_steps, decode_sum_s=sum_s,
                        decode_seqs=8.0 * num_steps, decode_context=800.0 * num_steps,
                        num_requests=0, num_failed=0, num_decode_walls=num_walls,
                        decode_wall_sum_s=wall_sum_s)


def test_no_step_between_two_reports_says_nothing():
    assert decode_steps(health(5, 0.02), health(5, 0.02)) is None


def test_the_device_time_when_the_host_keeps_up():
    steps = decode_steps(health(10, 0.04, 10, 0.045), health(20, 0.08, 20, 0.09))
    assert steps is not None
    assert steps.step_s == pytest.approx(0.0045)  # wall a little above the device: the wall
    assert (steps.seqs, steps.context_tokens) == (8.0, 800.0)


def test_a_host_that_feeds_its_device_late_is_slow():
    # Device 4 ms a step, but every step call waits 500 ms on the host.
    steps = decode_steps(health(10, 0.04, 10, 5.0), health(20, 0.08, 20, 10.0))
    assert steps is not None and steps.step_s == pytest.approx(0.5)


def test_an_older_worker_without_wall_counters_keeps_the_device_time():
    steps = decode_steps(health(10, 0.04), health(20, 0.08))
    assert steps is not None and steps.step_s == pytest.approx(0.004)
