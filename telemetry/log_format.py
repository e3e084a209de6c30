"""How every pdserve process logs: text lines (the default) or one JSON object per line.

`--log-format json` (gateway, workers, `pdserve up`, which passes it to its children)
writes each record as

    {"time": "2026-12-01T19:30:00.123+00:00", "level": "info", "process": "decode-0-ab12",
     "logger": "worker.decode_half", "message": "...", "request_id": "cmpl-...",
     "trace_id": "..."}

`request_id` and `trace_id` appear when the record was logged while serving a request:
the gateway sets `REQUEST_ID` when it names a request, a worker's control server when it
decodes a message that carries one; each aiohttp request runs in its own task, so the
value stays with that request (contextvars). `trace_id` is set by tracing when it is on.
`exception` carries a formatted traceback when the record has one.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
REQUEST_ID: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)
TRACE_ID: ContextVar[str | None] = ContextVar("pdserve_trace_id", default=None)


class JsonLineFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname.lower(),
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id, trace_id = REQUEST_ID.get(), TRACE_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if trace_id is not None:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str, process: str, text_format: str) -> None:
    """One stderr handler on the root logger, in `log_format` ("text": `text_format`)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter(process) if log_format == "json"
                         else logging.Formatter(text_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
