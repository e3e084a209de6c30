"""Per-tier latency targets (SLOs) and the pure check of one request against them.

A request *attains* its SLO when it finished without error, its TTFT is at or below
`ttft_ms` and its TPOT is at or below `tpot_ms`. TPOT is undefined for a request with a
single output token; such a request is judged on TTFT alone.

Default targets (used for any tier that neither the workload file nor `--slo` sets):

    tier         TTFT      TPOT     why
    interactive  250 ms    50 ms    a chat reply should start within a blink; 50 ms/token
                                    (20 tokens/s) is faster than people read
    standard     1000 ms   100 ms   API traffic without a person waiting on each token
    batch        10000 ms  250 ms   offline summarization: throughput matters, not latency
"""

from __future__ import annotations

import msgspec


class SLOTarget(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.tpot_ms <= 0:
            raise ValueError(f"SLO targets must be positive, got {self}")


def default_slos() -> dict[str, SLOTarget]:
    """A fresh dict each call, so a caller's edits never leak into another run."""
    return {
        "interactive": SLOTarget(ttft_ms=250.0, tpot_ms=50.0),
        "standard": SLOTarget(ttft_ms=1000.0, tpot_ms=100.0),
        "batch": SLOTarget(ttft_ms=10000.0, tpot_ms=250.0),
    }


def parse_slo_arg(text: str) -> tuple[str, SLOTarget]:
    """Parse a `--slo` value `TIER:TTFT_MS:TPOT_MS` (e.g. `interactive:250:50`)."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise ValueError(f"--slo takes TIER:TTFT_MS:TPOT_MS, got {text!r}")
    try:
        return parts[0], SLOTarget(ttft_ms=float(parts[1]), tpot_ms=float(parts[2]))
    except ValueError as exc:
        raise ValueError(f"--slo {text!r}: {exc}") from None


def meets_slo(error: str | None, ttft_ms: float | None, tpot_ms: float | None,
              target: SLOTarget) -> bool:
    """Side-effect free: does one request attain `target`? Errors never do."""
    if error is not None or ttft_ms is None:
        return False
    if ttft_ms > target.ttft_ms:
        return False
    return tpot_ms is None or tpot_ms <= target.tpot_ms
