"""Runs `pdserve up` as a real subprocess for the tests and reads its URL from its output."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A prompt long enough (over 512 tokens) to be handed off P -> D.
LONG_PROMPT = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 80)
# A tier that hands every prompt off P -> D, so a handoff test does not depend on which
# plan the router predicts to be cheaper on this machine.
HANDOFF_TIER = """
[tiers.handoff]
priority = 1
ttft_ms = 60000
tpot_ms = 5000
max_queued = 16
max_running = 16
local_prefill_max_tokens = 0
"""


class UpProcess:
    def __init__(self, *args: str, log_dir: Path, start_timeout_s: float = 240.0,
                 env: dict[str, str] | None = None) -> None:
        self.token = secrets.token_hex(8)  # the cluster's internal token (workers need it)
        self.log_dir = log_dir
        # `pdserve up` generates the admin token and writes it to LOG_DIR/admin-token.
        inherited = {k: v for k, v in os.environ.items() if k != "PDSERVE_ADMIN_TOKEN"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--threads-per-worker", "1",
             "--log-dir", str(log_dir), "--log-level", "warning", *args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**inherited, "PYTHONUNBUFFERED": "1", "PDSERVE_INTERNAL_TOKEN": self.token,
                 **(env or {})})
        self.lines: list[str] = []
        self.url: str | None = None
        self._found = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._found.wait(start_timeout_s) or self.url is None:
            self.stop()
            raise RuntimeError("pdserve up did not come up:\n" + self.output)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("pdserve is up: "):
                self.url = line.split()[3]
                self._found.set()
        self._found.set()  # the process ended

    def get_json(self, url: str) -> dict:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())

    def internal_get(self, url: str) -> dict:
        """GET a worker's control API with the cluster's token."""
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    @property
    def admin_token(self) -> str:
        """The gateway's admin token, from the file `pdserve up` wrote."""
        return (self.log_dir / "admin-token").read_text().strip()

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def admin_get(self, path: str) -> dict:
        """GET one of the gateway's /admin views with the admin token."""
        request = urllib.request.Request(self.url + path, headers=self.admin_headers)
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    def control_call(self, worker: dict, message, answer_type, timeout_s: float = 10.0):
        """One call over the worker's channel with the cluster's token, as the gateway and
        the agent make it."""
        from rpc.channel_client import ChannelPool
        from rpc.control_client import ControlClient

        async def call():
            pool = ChannelPool(self.token)
            try:
                return await ControlClient(worker["control_url"], pool).call(
                    message, answer_type, timeout_s)
            finally:
                await pool.aclose()

        return asyncio.run(call())

    def workers(self) -> list[dict]:
        return self.admin_get("/admin/workers")["workers"]

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(10)
        self._reader.join(5)
        return code


def terminate(process: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    return alive


def child_pids(parent_pid: int) -> list[int]:
    """Direct children of `parent_pid`, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(") ", 1)[1].split()[1]) == parent_pid:
            pids.append(int(entry.name))
    return pids
