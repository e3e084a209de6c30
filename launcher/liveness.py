"""Is a child of `pdserve up` frozen? Pure judgements over what the supervisor observed.

A process that exited is restarted by the supervisor as it is (launcher/restart_policy.py).
One that is alive but does nothing (SIGSTOP, a blocked event loop, a deadlock) never exits;
for the workers the operations agent finds it (its `hung` and `dead` rules), but nothing
watches the gateway replicas, the agent itself or Redis. So `pdserve up` does:

    gateway replicas, agent   each touches its heartbeat file every second
                              (telemetry/heartbeat.py); a file untouched for FROZEN_AFTER_S
                              means the event loop stopped turning
    Redis                     a PING with a deadline every PROBE_PERIOD_S; unanswered for
                              FROZEN_AFTER_S means it stopped serving

and kills a frozen child with SIGKILL (a stopped process cannot handle anything gentler),
whereupon its ordinary restart follows. A child is judged only once it has beaten (or
answered) since it was started: a process still starting is never frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_PERIOD_S = 1.0  # how often the supervisor looks
FROZEN_AFTER_S = 10.0  # silence longer than this: frozen (beats are 1 s apart; a loop on
# an oversubscribed machine may lag seconds, and a gateway killed wrongly cuts its streams)


@dataclass(slots=True)
class BeatWatch:
    """One child's heartbeat as the supervisor saw it: the file's last time, and when (on
    the supervisor's monotonic clock) it was first seen. Silence is counted on that clock,
    from the last change of the file's time, never by comparing the file's wall-clock time
    with now: a wall clock stepped forward, or a laptop waking from sleep, is no silence."""

    beat_at: float | None = None  # the file's modification time (None: no file yet)
    seen_at: float = 0.0  # monotonic time that `beat_at` was first seen

    def observe(self, beat_at: float | None, now: float) -> float | None:
        """The silence so far, given the file's time now (None: no file: the child is
        starting, or was just restarted, and there is nothing to judge)."""
        if beat_at is None or beat_at != self.beat_at:
            self.beat_at, self.seen_at = beat_at, now
            return None if beat_at is None else 0.0
        return now - self.seen_at


def is_frozen(silence_s: float | None) -> bool:
    return silence_s is not None and silence_s > FROZEN_AFTER_S


def unanswered_since(since_s: float | None, answered: bool, now_s: float) -> float | None:
    """The time a probed server stopped answering: None once it answers, else the first
    unanswered probe's time, kept across the probes that follow."""
    if answered:
        return None
    return now_s if since_s is None else since_s
