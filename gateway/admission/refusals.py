"""Refused requests (429, 503) by reason: one log line per burst, not one per request.

A burst of refusals of one reason logs its first at once, then stays quiet for
`quiet_s`; the next refusal after that logs how many came in between:

    observe(code, now) -> a line to log, or None (counted in the current burst)

`RefusalLog` holds only counts and times (a pure state machine over the injected `now`);
the caller logs the line and counts every refusal in `/metrics`
(`pdserve_gateway_refusals_total{status,code}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class _Burst:
    logged_at: float
    suppressed: int = 0


@dataclass(slots=True)
class RefusalLog:
    quiet_s: float = 10.0
    _bursts: dict[str, _Burst] = field(default_factory=dict)

    def observe(self, status: int, code: str, message: str, now: float) -> str | None:
        burst = self._bursts.get(code)
        if burst is not None and now - burst.logged_at < self.quiet_s:
            burst.suppressed += 1
            return None
        since = ""
        if burst is not None and burst.suppressed:
            since = f" ({burst.suppressed} more with this reason since the last line)"
        self._bursts[code] = _Burst(logged_at=now)
        return f"refused with {status} {code}: {message}{since}"
