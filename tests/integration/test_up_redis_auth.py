"""`pdserve up`'s Redis: a client without a password can touch no key, each child holds the
credentials of its own role only (state/redis_users.py), none is on a command line, and a
restarted Redis takes every child's password again."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import redis.exceptions
from redis.connection import parse_url
from up_process import UpProcess, child_pids

from launcher.local_cluster import REDIS_URL_FILE
from state.redis_access import has_password

pytestmark = pytest.mark.timeout(300)
NS = "pdserve"
PERMISSION = r"(?i)no permissions"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up-redis")
    up = UpProcess(log_dir=log_dir)
    try:
        yield up, log_dir
    finally:
        up.stop()


def redis_address(up: UpProcess) -> str:
    (line,) = [l for l in up.lines if l.startswith("redis: ")]
    return line.split()[1]


def admin_url(log_dir: Path) -> str:
    return (log_dir / REDIS_URL_FILE).read_text().strip()


def children(up: UpProcess) -> dict[int, tuple[str, dict[str, str]]]:
    """pid -> (command line, environment) of each child of `pdserve up`."""
    found = {}
    for pid in child_pids(up.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)
        found[pid] = (cmdline, env)
    return found


def child_urls(up: UpProcess) -> dict[str, str]:
    """Redis user -> the URL a child holds (its PDSERVE_REDIS_URL)."""
    urls = {}
    for _, env in children(up).values():
        if "PDSERVE_REDIS_URL" in env:
            url = env["PDSERVE_REDIS_URL"]
            urls[str(parse_url(url)["username"])] = url
    return urls


def worker_ids(up: UpProcess) -> list[str]:
    return sorted(w["id"] for w in up.workers())


def complete(up: UpProcess, prompt: str) -> str:
    model = up.get_json(f"{up.url}/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{up.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["text"]


def test_a_client_without_the_password_can_touch_no_key(cluster) -> None:
    up, log_dir = cluster
    address = redis_address(up)
    assert not has_password(address)
    workers_key = f"{NS}:workers"
    with redis.Redis.from_url(address) as anonymous:
        for command in (("SMEMBERS", workers_key), ("GET", f"{NS}:agent_leader"),
                        ("SET", f"{NS}:worker:fake:info", "x"), ("SADD", workers_key, "fake"),
                        ("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "SET", "requirepass", "")):
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.execute_command(*command)
    host, port = urlsplit(address).hostname, urlsplit(address).port
    with socket.create_connection((host, port), timeout=2) as sock:  # the raw protocol
        sock.sendall(b"*3\r\n$4\r\nSADD\r\n$15\r\npdserve:workers\r\n$4\r\nfake\r\n")
        assert sock.recv(100).startswith(b"-NOAUTH")
    # With the password (the operator's file, readable by its owner only) it reads them.
    assert stat.S_IMODE(os.stat(log_dir / REDIS_URL_FILE).st_mode) == 0o600
    with redis.Redis.from_url(admin_url(log_dir)) as admin:
        assert sorted(m.decode() for m in admin.smembers(workers_key)) == worker_ids(up)


def test_no_password_is_on_a_command_line_and_each_child_has_its_own(cluster) -> None:
    up, log_dir = cluster
    urls = child_urls(up)
    ids = worker_ids(up)
    assert set(urls) == {"gateway", "agent", *(f"worker-{w}" for w in ids)}
    passwords = {str(parse_url(u)["password"]) for u in urls.values()}
    passwords.add(str(parse_url(admin_url(log_dir))["password"]))
    assert len(passwords) == len(urls) + 1  # one per user, none shared
    command_lines = [cmdline for cmdline, _ in children(up).values()]
    command_lines.append(Path(f"/proc/{up.process.pid}/cmdline").read_bytes().decode())
    assert len(command_lines) >= len(urls) + 2  # the children, Redis and `pdserve up`
    for cmdline in command_lines:
        assert "--redis-url" not in cmdline, cmdline
        assert not [p for p in passwords if p in cmdline], cmdline
    assert not [p for p in passwords if p in up.output]


def test_a_childs_password_reaches_only_its_roles_keys(cluster) -> None:
    up, log_dir = cluster
    urls = child_urls(up)
    first, second = worker_ids(up)
    assert complete(up, "The capital of France is")  # every role did its part meanwhile
    with redis.Redis.from_url(urls[f"worker-{first}"]) as worker:
        for forged in (("SET", f"{NS}:worker:{second}:info", "x"),
                       ("INCR", f"{NS}:worker:{second}:epoch"),
                       ("HSET", f"{NS}:ejected", second, "{}"),
                       ("FLUSHALL",), ("CONFIG", "GET", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError, match=PERMISSION):
                worker.execute_command(*forged)
    with redis.Redis.from_url(urls["agent"]) as agent:
        assert agent.get(f"{NS}:worker:{first}:info")  # it reads the registry
        with pytest.raises(redis.exceptions.NoPermissionError, match=PERMISSION):
            agent.set(f"{NS}:worker:{first}:info", "x")
    with redis.Redis.from_url(admin_url(log_dir)) as admin:
        assert admin.get(f"{NS}:agent_leader")  # the agent writes its own keys
        assert admin.zcard(f"{NS}:gateways") == 1  # the gateway its shared limits
    logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("*.log"))
    assert "NOPERM" not in logs and "no permissions" not in logs


def test_a_restarted_redis_takes_every_childs_password_again(cluster) -> None:
    up, log_dir = cluster
    port = urlsplit(redis_address(up)).port
    (redis_pid,) = [pid for pid, (cmdline, _) in children(up).items()
                    if "redis" in cmdline.split()[0] or "valkey" in cmdline]
    os.kill(redis_pid, signal.SIGKILL)
    ids = worker_ids(up)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with redis.Redis.from_url(admin_url(log_dir), socket_timeout=1) as admin:
                live = [w for w in ids if admin.exists(f"{NS}:worker:{w}:info")]
                if len(live) == len(ids) and admin.get(f"{NS}:agent_leader"):
                    break
        except redis.exceptions.ConnectionError:
            pass  # not back yet
        time.sleep(0.2)
    else:
        pytest.fail("the workers and the agent did not come back:\n" + up.output)
    assert "redis restarted" in up.output and urlsplit(redis_address(up)).port == port
    assert complete(up, "The capital of France is")
    with redis.Redis.from_url(redis_address(up)) as anonymous:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.smembers(f"{NS}:workers")
