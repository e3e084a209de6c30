"""Every process that takes --redis-url refuses, at start-up, a Redis anyone may use, unless
--redis-insecure (then it warns and goes on): real processes, real servers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis
from up_process import REPO, terminate

from launcher.redis_server import RedisServer
from state.redis_access import with_password

pytestmark = pytest.mark.timeout(120)
REFUSAL = "answers without a password"
NO_PASSWORD = "carries no password"


@pytest.fixture(scope="module")
def open_redis():
    with RedisServer(auth=False) as server:
        yield server


def pdserve(*args: str, env: dict[str, str] | None = None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_REDIS")}
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**clean, **(env or {})})


@pytest.mark.parametrize("command", [
    ("gateway", "--port", "0"),
    ("agent", "--once", "--port", "0"),
    # A model that does not exist: had the check not refused first, the load would fail.
    ("decode-worker", "--model", "/nonexistent/model.gguf"),
    ("up", "--port", "0", "--model", "/nonexistent/model.gguf"),
], ids=lambda c: c[0])
def test_a_redis_without_a_password_is_refused_at_start(open_redis, command, tmp_path) -> None:
    result = pdserve(*command, env={"PDSERVE_REDIS_URL": open_redis.address})
    assert result.returncode in (1, 2), result.stdout + result.stderr
    assert NO_PASSWORD in result.stderr and "--redis-insecure" in result.stderr
    assert "nonexistent" not in result.stderr  # refused before anything else
    # A password the server never asks for is refused too (from the environment here).
    result = pdserve(*command, env={"PDSERVE_REDIS_URL": open_redis.address,
                                    "PDSERVE_REDIS_PASSWORD": "ignored-by-the-server"})
    assert REFUSAL in result.stderr and "ignored-by-the-server" not in result.stderr
    with redis.Redis.from_url(open_redis.address) as client:
        assert client.dbsize() == 0  # nothing was written


def test_with_redis_insecure_a_worker_warns_and_goes_on(open_redis) -> None:
    result = pdserve("decode-worker", "--model", "/nonexistent/model.gguf", "--redis-url",
                     open_redis.address, "--redis-insecure")
    assert "--redis-insecure" in result.stderr and NO_PASSWORD in result.stderr  # the warning
    assert "nonexistent" in result.stderr  # it went on to load the model


def test_with_redis_insecure_the_agent_warns_and_runs(open_redis) -> None:
    result = pdserve("agent", "--once", "--port", "0", "--period-s", "0.2",
                     env={"PDSERVE_REDIS_URL": open_redis.address,
                          "PDSERVE_REDIS_INSECURE": "1"})
    assert result.returncode == 0, result.stderr
    assert "WARNING" in result.stderr and NO_PASSWORD in result.stderr


def test_with_redis_insecure_the_gateway_warns_and_serves(open_redis) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "gateway", "--port", "0", "--redis-url",
         open_redis.address, "--redis-insecure"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stderr is not None
        line = process.stdout.readline()
        assert line.startswith("pdserve gateway listening on"), process.stderr.read()
    finally:
        terminate(process)
    assert NO_PASSWORD in process.stderr.read()


def test_the_right_password_is_accepted_and_a_wrong_one_refused() -> None:
    with RedisServer() as protected:
        right = pdserve("agent", "--once", "--port", "0", "--period-s", "0.2",
                        env={"PDSERVE_REDIS_URL": protected.address,
                             "PDSERVE_REDIS_PASSWORD": protected.password or ""})
        assert right.returncode == 0 and "WARNING" not in right.stderr, right.stderr
        wrong = pdserve("agent", "--once", "--port", "0",
                        env={"PDSERVE_REDIS_URL": with_password(protected.address, "nope")})
        assert wrong.returncode == 2 and "refused this process's credentials" in wrong.stderr


def test_up_passes_redis_insecure_on_to_its_children(open_redis, tmp_path) -> None:
    """They start (and fail later, on the missing model), warned rather than refused."""
    result = pdserve("up", "--port", "0", "--model", "/nonexistent/model.gguf",
                     "--redis-insecure", "--log-dir", str(tmp_path), "--no-agent",
                     env={"PDSERVE_REDIS_URL": open_redis.address}, timeout_s=100)
    assert result.returncode == 1
    assert "warning:" in result.stdout and NO_PASSWORD in result.stdout  # up's own
    assert "nonexistent" in result.stderr and "pass --redis-insecure" not in result.stderr
    # The child that failed first warned in its log, whose tail `up` prints.
    assert "accepted with --redis-insecure" in result.stderr
