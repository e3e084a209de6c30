"""A `pdserve up` cluster run as a child process: the drill's own cluster, and the
benchmarks' that need a whole one.

Lifecycle: start() (free port, own internal token, its log folder) → wait_ready() (until
`pdserve up` prints that it is up, with a deadline) → workers() / kill_worker() → stop()
(SIGTERM, then SIGKILL of its process group after a grace period; always called via `with`).
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
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from telemetry.options import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE, INTERNAL_TOKEN_ENV

HTTP_TIMEOUT_S = 5.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class UpCluster:
    def __init__(self, up_args: str, log_path: Path, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, cwd: Path | None = None,
                 log_dir: Path | None = None) -> None:
        """`cwd`: run `pdserve up` from another checkout (its code first on the path);
        `log_dir`: the children's logs and the secrets `pdserve up` writes (default: a new
        folder beside `log_path`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.up_args = shlex.split(up_args)
        self.log_path = log_path
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-",
                                                        dir=log_path.parent
                                                        if log_path.parent.exists() else None))
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                    INTERNAL_TOKEN_ENV: self.token}
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

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def admin_token(self) -> str:
        """The operator's admin token from the environment, else the one `pdserve up`
        generated and wrote to LOG_DIR/admin-token (readable once it is up)."""
        return self.env.get(ADMIN_TOKEN_ENV) or \
            (self.log_dir / ADMIN_TOKEN_FILE).read_text().strip()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "launcher.cli", "up", "--port", str(self.port),
                   "--log-dir", str(self.log_dir), *self.up_args]
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
