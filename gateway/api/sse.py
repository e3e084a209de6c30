"""Server-sent events as OpenAI streams them: `data: <json>\\n\\n` per event, `data: [DONE]` last.

Encoding is byte concatenation: one event per token is the gateway's hot path. The
`SseDecoder` is the other side (tests, benchmarks, a worker client): it takes arbitrary
byte fragments and returns whole events, so no event is merged or split by TCP framing.
"""

from __future__ import annotations

DONE_EVENT = b"data: [DONE]\n\n"
SSE_HEADERS: dict[str, str] = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    # nginx buffers responses unless told otherwise; a buffered stream has no TTFT.
    "X-Accel-Buffering": "no",
}


def encode_event(payload: bytes) -> bytes:
    """One `data:` event. The payload must not contain a newline (compact JSON never does)."""
    if b"\n" in payload or b"\r" in payload:
        raise ValueError("an SSE data payload must be a single line")
    return b"data: " + payload + b"\n\n"


class SseDecoder:
    """Incremental SSE parser: feed() bytes as they arrive, get back complete `data` payloads.

    Lines may end in \\n, \\r\\n or \\r; an event ends at an empty line; several `data:`
    lines of one event are joined with \\n (the SSE spec). Comments and other fields
    (`event:`, `id:`, `retry:`) are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events: list[bytes] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            end, next_start = cut
            line = self._buffer[:end]
            self._buffer = self._buffer[next_start:]
            if not line:
                if self._data_lines:
                    events.append(b"\n".join(self._data_lines))
                    self._data_lines = []
                continue
            if line.startswith(b":"):
                continue
            field, _, value = line.partition(b":")
            if field == b"data":
                self._data_lines.append(value[1:] if value.startswith(b" ") else value)

    @property
    def has_partial_event(self) -> bool:
        return bool(self._buffer or self._data_lines)


def _line_end(buffer: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None when no line is complete.

    A trailing lone \\r is not yet complete: the next byte may be its \\n.
    """
    n = buffer.find(b"\n")
    r = buffer.find(b"\r")
    if r == -1 or (n != -1 and n < r):
        return None if n == -1 else (n, n + 1)
    if r + 1 == len(buffer):
        return None
    return (r, r + 2) if buffer[r + 1:r + 2] == b"\n" else (r, r + 1)
