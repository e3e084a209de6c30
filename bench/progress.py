"""A one-line progress bar on stderr (no dependency; redrawn at most a few times a second)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_INTERVAL_S = 0.25
BAR_WIDTH = 30


class ProgressBar:
    """Lifecycle: created before a run, `update()` on every send and completion, `close()`
    once. Progress is the larger of the request share and the time share of the run bound.
    On a non-terminal stream it draws nothing until `close()`, which prints one summary line.
    """

    def __init__(self, label: str, num_requests: int | None, duration_s: float,
                 enabled: bool = True, stream: TextIO | None = None):
        self._label = label
        self._num_requests = num_requests
        self._duration_s = duration_s
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._live = enabled and self._stream.isatty()
        self._start_t = time.monotonic()
        self._last_draw_t = 0.0
        self._line = ""

    def _render(self, num_sent: int, num_done: int, num_errors: int) -> str:
        elapsed_s = time.monotonic() - self._start_t
        share = min(1.0, elapsed_s / self._duration_s) if self._duration_s > 0 else 0.0
        if self._num_requests:
            share = max(share, num_sent / self._num_requests)
        filled = int(share * BAR_WIDTH)
        return (f"{self._label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                f"{elapsed_s:6.1f}s sent {num_sent} done {num_done} errors {num_errors}")

    def update(self, num_sent: int, num_done: int, num_errors: int) -> None:
        self._line = self._render(num_sent, num_done, num_errors)
        now = time.monotonic()
        if self._live and now - self._last_draw_t >= REDRAW_INTERVAL_S:
            self._last_draw_t = now
            self._stream.write("\r" + self._line)
            self._stream.flush()

    def close(self) -> None:
        if self._enabled:
            self._stream.write(("\r" if self._live else "") + self._line + "\n")
            self._stream.flush()
