"""`--log-format json`: one JSON object per line, with the request id of the request being
served (set by the gateway's handler and by a worker's control server)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys

import pytest

from protocol.messages import AbortRequest, AbortResponse
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.control_server import ControlServer, add_call, make_app
from telemetry.log_format import REQUEST_ID, JsonLineFormatter, configure_logging


def _line(formatter: logging.Formatter, message: str, exc: bool = False) -> dict:
    logger = logging.getLogger("t")
    if not exc:
        return json.loads(formatter.format(
            logger.makeRecord("t", logging.INFO, __file__, 1, message, (), None)))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logger.makeRecord("t", logging.WARNING, __file__, 1, message, (),
                                   sys.exc_info())
    return json.loads(formatter.format(record))


def test_a_line_is_one_object_with_the_request_id_when_there_is_one() -> None:
    formatter = JsonLineFormatter("decode-0")
    plain = _line(formatter, 'said "hi"\nand left')
    assert set(plain) == {"time", "level", "process", "logger", "message"}
    assert (plain["level"], plain["process"], plain["message"]) == (
        "info", "decode-0", 'said "hi"\nand left')
    token = REQUEST_ID.set("cmpl-42")
    try:
        failed = _line(formatter, "failed", exc=True)
    finally:
        REQUEST_ID.reset(token)
    assert failed["request_id"] == "cmpl-42" and failed["level"] == "warning"
    assert "RuntimeError: boom" in failed["exception"]


def test_configure_logging_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("info", "yaml", "p", "%(message)s")


def test_a_worker_handler_logs_with_the_request_id_of_its_message() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLineFormatter("worker-1"))
    log = logging.getLogger("test.worker")
    log.addHandler(handler)
    log.setLevel(logging.INFO)

    async def abort(message: AbortRequest) -> AbortResponse:
        log.info("aborting")
        return AbortResponse(request_id=message.request_id, found=False)

    async def main() -> None:
        app = make_app(None)
        add_call(app, AbortRequest, abort)
        server = ControlServer(app)
        channels = ChannelPool(None, connect_timeout_s=5)
        client = ControlClient(await server.start(), channels)
        try:
            for rid in ("req-a", "req-b"):  # one channel, one task per call
                answer = await client.call(AbortRequest(request_id=rid), AbortResponse, 5)
                assert answer == AbortResponse(request_id=rid, found=False)
            assert REQUEST_ID.get() is None  # set in the handler's task, not the caller's
        finally:
            await channels.aclose()
            await server.stop()

    try:
        asyncio.run(main())
    finally:
        log.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["message"], e["request_id"]) for e in lines] == [("aborting", "req-a"),
                                                                ("aborting", "req-b")]
    assert REQUEST_ID.get() is None  # nothing leaked into this thread's context


def test_the_gateway_cli_takes_json_and_refuses_other_formats() -> None:
    bad = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway", "--log-format", "xml"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--log-format" in bad.stderr
    # With json, even the refusal of a missing Redis URL comes after JSON logging is set up.
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "gateway", "--log-format",
                          "json", "--port", "0"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "--redis-url" in out.stderr
