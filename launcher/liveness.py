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

PROBE_PERIOD_S = 1.0  # how often the supervisor looks
FROZEN_AFTER_S = 10.0  # silence longer than this: frozen (beats are 1 s apart; a loop on
# an oversubscribed machine may lag seconds, and a gateway killed wrongly cuts its streams)


def heartbeat_silence_s(now_s: float, beat_at_s: float | None) -> float | None:
    """How long a child has been silent, by its heartbeat file's time `beat_at_s` (None: no
    file yet: it is starting, or was just restarted), both on the wall clock; None when
    there is nothing to judge."""
    if beat_at_s is None:
        return None
    return max(0.0, now_s - beat_at_s)


def is_frozen(silence_s: float | None) -> bool:
    return silence_s is not None and silence_s > FROZEN_AFTER_S


def unanswered_since(since_s: float | None, answered: bool, now_s: float) -> float | None:
    """The time a probed server stopped answering: None once it answers, else the first
    unanswered probe's time, kept across the probes that follow."""
    if answered:
        return None
    return now_s if since_s is None else since_s
