"""Credentials of the cluster's Redis, and the check every process makes before using it.

Whoever can write the registry can register a "worker" that the gateway and the operations
agent then call with the cluster's internal token and users' prompts, and can eject real
workers; a Redis that answers without a password lets every process that reaches its port
do that. So each process that takes `--redis-url` (workers, gateway, agent, `pdserve up`)
refuses at start-up a Redis it could use without credentials, unless `--redis-insecure`
says the risk is accepted (then it logs a warning and goes on).

Where the password comes from: the URL (`redis://[USER]:PASSWORD@HOST:PORT/DB`, or
`?password=`), else PDSERVE_REDIS_PASSWORD. Never a command line: `/proc/PID/cmdline` is
readable by every local process. `redact` is how a URL is shown.

The check (`check_access`), each step one round trip with a deadline:

    no password in the URL nor in PDSERVE_REDIS_PASSWORD  → refused (nothing is sent)
    PING without credentials ─ +PONG                       → refused: anyone gets in
                             ─ NOAUTH / NOPERM             → PING with the credentials:
                                   PONG → accepted; refused (WRONGPASS, ...) → refused
                             ─ unreachable                 → asked again until `wait_s`,
                                   then a warning: not checked (the process's own retries
                                   take over; it reaches nothing it did not check)
With `insecure`, the two "anyone gets in" refusals become warnings.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from urllib.parse import SplitResult, parse_qsl, quote, urlencode, urlsplit

import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from telemetry.options import REDIS_PASSWORD_ENV

# What an unreachable, restarting or hung server looks like to the synchronous client.
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_CREDENTIAL_PARAMS = ("password", "username")


class RedisAccessError(RuntimeError):
    """This process must not use that Redis; the message says why and what to do."""


def has_password(url: str) -> bool:
    """Does the URL carry a password (in its user info or its query)?"""
    return bool(_parsed(url).get("password"))


def resolve_url(url: str, env: Mapping[str, str]) -> str:
    """The URL with PDSERVE_REDIS_PASSWORD put in, when it carries no password itself (a URL
    that is none is left for `check_access` to refuse)."""
    password = env.get(REDIS_PASSWORD_ENV)
    try:
        if not password or has_password(url):
            return url
        return with_password(url, password)
    except RedisAccessError:
        return url


def with_password(url: str, password: str, username: str | None = None) -> str:
    """`url` with this password (and user name: by default the one it names, if any) in
    place of any it had (the user info of redis:// and rediss://, the query of unix://)."""
    if username is None:
        named = _parsed(url).get("username")
        username = str(named) if named else None
    parts = urlsplit(without_credentials(url))
    if parts.scheme == "unix":
        query = parse_qsl(parts.query, keep_blank_values=True)
        query += [("username", username)] if username else []
        query += [("password", password)]
        return _join(parts._replace(query=urlencode(query)))
    user = quote(username, safe="") if username else ""
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc}"
    return _join(parts._replace(netloc=netloc))


def without_credentials(url: str) -> str:
    """`url` with no user name and no password: what anyone on the network could try."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k not in _CREDENTIAL_PARAMS]
    return _join(parts._replace(netloc=netloc, query=urlencode(query)))


def redact(url: str) -> str:
    """`url` as it may be printed or logged: a password shows as `***`."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if at:
        name, colon, _ = userinfo.partition(":")
        host = f"{name}{':***' if colon else ''}@{host}"
    query = [(k, "***" if k == "password" else v)
             for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return _join(parts._replace(netloc=host, query=urlencode(query, safe="*")))


def check_access(url: str, insecure: bool, wait_s: float = 10.0,
                 timeout_s: float = 1.0) -> list[str]:
    """Refuse (RedisAccessError) a Redis that lets anyone in, unless `insecure`; refuse
    credentials it rejects. Returns the warnings to log. Called once, before the process
    uses `url`; waits up to `wait_s` for an unreachable server (side effects: PINGs)."""
    shown = redact(url)
    if not has_password(url):
        return _open(f"the Redis URL {shown} carries no password", insecure)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            _ping(without_credentials(url), timeout_s)
        except redis.exceptions.AuthenticationError:
            break  # NOAUTH: it asks for credentials
        except redis.exceptions.NoPermissionError:
            break  # a default user that may do nothing
        except _UNREACHABLE as exc:
            if time.monotonic() + 0.25 >= deadline:
                return [f"could not check that the Redis at {shown} asks for a password "
                        f"({exc}); going on with the credentials of the URL"]
            time.sleep(0.25)
            continue
        else:
            return _open(f"the Redis at {shown} answers without a password (it ignores "
                         "the one given)", insecure)
    try:
        _ping(url, timeout_s)
    except redis.exceptions.RedisError as exc:
        # Unreachable right after it answered counts as refused too: a clear line now
        # beats a process that retries a wrong password for ever.
        raise RedisAccessError(f"the Redis at {shown} refused this process's credentials: "
                               f"{exc}") from exc
    return []


def _open(why: str, insecure: bool) -> list[str]:
    consequence = ("anyone who can reach it can register workers that receive the "
                   "cluster's internal token and users' prompts, and eject real ones")
    if insecure:
        return [f"{why}: {consequence} (accepted with --redis-insecure)"]
    raise RedisAccessError(
        f"{why}: {consequence}. Give the server a password (requirepass, or an ACL user) "
        f"and put it in the URL (redis://:PASSWORD@HOST:PORT/0) or in {REDIS_PASSWORD_ENV}; "
        "or pass --redis-insecure to accept the risk")


def _ping(url: str, timeout_s: float) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s,
                                  socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    finally:
        client.close()


def _join(parts: SplitResult) -> str:
    """urlunsplit, but keeping `//` before an empty host (unix:///path)."""
    query = f"?{parts.query}" if parts.query else ""
    fragment = f"#{parts.fragment}" if parts.fragment else ""
    return f"{parts.scheme}://{parts.netloc}{parts.path}{query}{fragment}"


def _parsed(url: str) -> dict[str, object]:
    try:
        return dict(parse_url(url))
    except ValueError as exc:
        raise RedisAccessError(f"not a Redis URL: {redact(url)} ({exc})") from exc
