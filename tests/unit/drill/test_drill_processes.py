"""The drill finds a cluster's processes by their parent and their command lines, and
signals only those (drill/processes.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from drill import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def spawn(argv0: str, *args: str, executable: str = "/bin/sleep") -> subprocess.Popen:
    return subprocess.Popen([argv0, *args], executable=executable)


def test_children_are_told_apart_by_what_they_run() -> None:
    redis = spawn("redis-server 127.0.0.1:6379", "30")  # a server that retitled itself
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                               "--worker-id", "decode-1-abc"])
    try:
        deadline = time.monotonic() + 5
        while not processes.runs_worker(worker.pid, "decode-1-abc"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # This test process may run other children (a Redis server of another test): only
        # ours are judged.
        ours = {redis.pid, worker.pid}
        assert ours & set(processes.redis_pids(os.getpid())) == {redis.pid}
        assert not ours & set(processes.agent_pids(os.getpid()))
        assert not processes.runs_worker(worker.pid, "decode-0-abc")
        assert not processes.runs_worker(redis.pid, "decode-1-abc")
    finally:
        for child in (redis, worker):
            child.kill()
            child.wait()
    assert not processes.alive(redis.pid)


def test_a_stopped_process_reads_stopped_until_cont() -> None:
    child = spawn("sleep", "30")
    try:
        processes.stop(child.pid)
        deadline = time.monotonic() + 5
        while processes.state(child.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        processes.cont(child.pid)
        while processes.state(child.pid) == "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert processes.alive(child.pid) and processes.parent(child.pid) == os.getpid()
    finally:
        child.kill()
        child.wait()
