"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from launcher.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real Redis-protocol server on a free loopback port for the whole session.

    Tests that share it must use their own key namespace (or worker ids) rather than flush
    it; a test that needs to stop and restart a server starts its own RedisServer.
    """
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests (`@pytest.mark.anyio`) run on asyncio, the loop pdserve runs on."""
    return "asyncio"
