"""When `pdserve up` restarts a child: exponential backoff, reset by a stable run, and an
essential child that keeps failing stops the cluster."""

from __future__ import annotations

import pytest

from launcher.restart_policy import RestartPolicy, consecutive_failures, restart_delay_s

POLICY = RestartPolicy(initial_delay_s=0.5, max_delay_s=4.0, stable_after_s=60.0,
                       max_essential_failures=3)


def test_backoff_doubles_up_to_the_cap() -> None:
    delays = [restart_delay_s(n, essential=False, policy=POLICY) for n in range(1, 8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_a_stable_run_resets_the_count_and_a_crash_loop_grows_it() -> None:
    assert consecutive_failures(5, ran_for_s=61.0, policy=POLICY) == 1
    assert consecutive_failures(5, ran_for_s=2.0, policy=POLICY) == 6
    assert consecutive_failures(0, ran_for_s=0.1, policy=POLICY) == 1


def test_workers_are_retried_forever_essential_children_give_up() -> None:
    assert restart_delay_s(1000, essential=False, policy=POLICY) == 4.0
    assert restart_delay_s(3, essential=True, policy=POLICY) == 2.0
    assert restart_delay_s(4, essential=True, policy=POLICY) is None
    with pytest.raises(ValueError):
        restart_delay_s(0, essential=False, policy=POLICY)
    with pytest.raises(ValueError):
        RestartPolicy(initial_delay_s=5.0, max_delay_s=1.0)
