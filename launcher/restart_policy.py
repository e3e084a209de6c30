"""When `pdserve up` restarts a child that exited: a pure function of its recent history.

    delay before restart n (n = consecutive failures) = min(initial * 2**(n-1), max)
    a run that lasted `stable_after_s` or more resets the count (it was not a crash loop)
    a child marked `essential` (the gateway, Redis) that fails `max_essential_failures`
    times in a row cannot be kept up: the cluster stops; workers are retried forever

Workers restart with a new process (and so a new epoch in the registry); the gateway and
Redis restart on the same port, so every URL the others were given stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    max_essential_failures: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < initial_delay_s <= max_delay_s")
        if self.max_essential_failures < 1:
            raise ValueError("max_essential_failures must be at least 1")


def consecutive_failures(previous: int, ran_for_s: float, policy: RestartPolicy) -> int:
    """The failure count after a child that ran `ran_for_s` seconds exited."""
    return 1 if ran_for_s >= policy.stable_after_s else previous + 1


def restart_delay_s(num_failures: int, essential: bool, policy: RestartPolicy) -> float | None:
    """Seconds to wait before restarting, or None: give up (and stop the cluster)."""
    if num_failures < 1:
        raise ValueError("a restart follows at least one failure")
    if essential and num_failures > policy.max_essential_failures:
        return None
    return min(policy.initial_delay_s * 2 ** (num_failures - 1), policy.max_delay_s)
