"""The start-up check of every process that takes --redis-url, against real servers: a Redis
anyone may use is refused unless --redis-insecure, wrong credentials are refused, and URLs
are shown without their password."""

from __future__ import annotations

import time

import pytest

from launcher.redis_server import RedisServer, free_port
from state.redis_access import (RedisAccessError, check_access, has_password, redact, resolve_url,
                                with_password, without_credentials)
from telemetry.options import REDIS_PASSWORD_ENV

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def open_server():
    with RedisServer(auth=False) as server:
        yield server


@pytest.fixture(scope="module")
def protected_server():
    with RedisServer() as server:
        yield server


def test_a_url_without_a_password_is_refused_before_anything_is_sent() -> None:
    # Nothing listens on this port: the refusal needs no answer.
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(RedisAccessError, match="carries no password.*--redis-insecure"):
        check_access(url, insecure=False)
    assert time.monotonic() - started < 0.5
    (warning,) = check_access(url, insecure=True)
    assert "carries no password" in warning and "--redis-insecure" in warning


def test_a_server_that_lets_anyone_in_is_refused(open_server: RedisServer) -> None:
    with pytest.raises(RedisAccessError, match="carries no password"):
        check_access(open_server.address, insecure=False)
    # A password in the URL does not help when the server never asks for one.
    with pytest.raises(RedisAccessError, match="answers without a password"):
        check_access(with_password(open_server.address, "pw", "default"), insecure=False)
    (warning,) = check_access(with_password(open_server.address, "pw", "default"),
                              insecure=True)
    assert "answers without a password" in warning and "pw" not in warning


def test_a_server_that_asks_for_the_password_is_accepted(protected_server: RedisServer
                                                         ) -> None:
    assert check_access(protected_server.url, insecure=False) == []
    assert check_access(protected_server.url, insecure=True) == []


def test_wrong_credentials_are_refused_at_once(protected_server: RedisServer) -> None:
    wrong = with_password(protected_server.address, "not-the-password")
    with pytest.raises(RedisAccessError, match="refused this process's credentials") as info:
        check_access(wrong, insecure=True)
    assert "not-the-password" not in str(info.value)


def test_an_unreachable_server_is_waited_for_then_left_unchecked() -> None:
    url = with_password(f"redis://127.0.0.1:{free_port()}/0", "pw")
    started = time.monotonic()
    (warning,) = check_access(url, insecure=False, wait_s=0.6)
    assert 0.5 <= time.monotonic() - started < 3.0
    assert "could not check" in warning and "pw" not in warning


def test_the_password_may_come_from_the_environment(protected_server: RedisServer) -> None:
    assert protected_server.password is not None
    env = {REDIS_PASSWORD_ENV: protected_server.password}
    url = resolve_url(protected_server.address, env)
    assert has_password(url) and check_access(url, insecure=False) == []
    # A password in the URL wins over the environment's.
    assert resolve_url(protected_server.url, {REDIS_PASSWORD_ENV: "other"}) == \
        protected_server.url
    assert resolve_url(protected_server.address, {}) == protected_server.address


@pytest.mark.parametrize("url, shown", [
    ("redis://:s3cret@h:1/0", "redis://:***@h:1/0"),
    ("redis://user:s3cret@h:1/0", "redis://user:***@h:1/0"),
    ("rediss://user@h:1/0", "rediss://user@h:1/0"),
    ("redis://h:1/0", "redis://h:1/0"),
    ("unix:///run/redis.sock?db=1&password=s3cret", "unix:///run/redis.sock?db=1&password=***"),
])
def test_redact_hides_every_password(url: str, shown: str) -> None:
    assert redact(url) == shown


def test_credentials_go_in_and_out_of_every_form_of_url() -> None:
    assert with_password("redis://h:1/0", "p@ss:/w", "u") == "redis://u:p%40ss%3A%2Fw@h:1/0"
    assert has_password(with_password("redis://h:1/0", "p@ss:/w", "u"))
    assert with_password("redis://user:old@h:1/0", "new") == "redis://user:new@h:1/0"
    assert resolve_url("redis://user@h:1/0", {REDIS_PASSWORD_ENV: "pw"}) == \
        "redis://user:pw@h:1/0"  # an ACL user named in the URL, its password from outside
    assert with_password("unix:///s.sock?db=2", "p") == "unix:///s.sock?db=2&password=p"
    assert without_credentials("redis://u:p@h:1/0") == "redis://h:1/0"
    assert without_credentials("unix:///s.sock?password=p&username=u&db=2") == \
        "unix:///s.sock?db=2"
    assert not has_password("redis://u@h:1/0") and has_password("redis://h:1/0?password=p")
    with pytest.raises(RedisAccessError, match="not a Redis URL"):
        has_password("http://h:1/")
