"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hf_reference import HFReference

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


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    """transformers' model, tokenizer and chat template for the default model: the
    independent reference greedy output is compared with (loaded once, about 10 s)."""
    return HFReference()
