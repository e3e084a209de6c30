"""A `pdserve up` cluster run as a child process, for benchmarks that need a whole cluster.

Lifecycle: start() (free port, own internal token, log file) → wait_ready() (polls /ready
and checks that every worker it was asked for registered) → workers() / kill_worker() →
stop() (SIGTERM, then SIGKILL after a grace period; always called via `with`).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

HTTP_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class UpCluster:
    def __init__(self, up_args: str, log_path: Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, cwd: Path | None = None) -> None:
        """`cwd`: run `pdserve up` from another checkout (its code first on the path)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.up_args = shlex.split(up_args)
        self.log_path = log_path
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                    "PDSERVE_INTERNAL_TOKEN": self.token}
        if cwd is not None:
            self.env["PYTHONPATH"] = str(cwd)
        self.cwd = cwd
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> UpCluster:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "launcher.cli", "up", "--port", str(self.port),
                   *self.up_args]
        print(f">> {shlex.join(command[1:])}  (log {self.log_path})", file=sys.stderr)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env, cwd=self.cwd,
                                          start_new_session=True)

    def wait_ready(self) -> None:
        """Until `pdserve up` says it is up (every worker it started is ready)."""
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited; see {self.log_path}")
            if b"pdserve is up" in self.log_path.read_bytes():
                return
            time.sleep(1.0)
        raise RuntimeError(f"pdserve up not ready after {self.ready_timeout_s:.0f} s; "
                           f"see {self.log_path}")

    def get_json(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path,
                                         headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return json.loads(response.read())

    def workers(self) -> list[dict]:
        return list(self.get_json("/admin/workers")["workers"])

    def kill_worker(self, worker: dict) -> None:
        try:
            os.kill(int(worker["pid"]), signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 60.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
