"""`pdserve up` fails clearly, and leaves nothing running, when a child dies at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from up_process import REPO

pytestmark = pytest.mark.timeout(120)


CLUSTER_PROGRAMS = ("launcher.cli", "redis-server", "valkey-server")


def cluster_processes(ignore: set[int]) -> list[str]:
    """Processes of a pdserve cluster (launcher, workers, gateway, Redis) not in `ignore`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in ignore or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if any(program in cmdline for program in CLUSTER_PROGRAMS):
            found.append(f"{entry}: {cmdline.strip()}")
    return found


def listening_sockets() -> set[str]:
    """Inodes of the host's listening TCP sockets (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    inodes.add(fields[9])
    return inodes


def test_child_dying_at_start_fails_with_its_log(tmp_path) -> None:
    before = {int(e) for e in os.listdir("/proc") if e.isdigit()}
    sockets_before = listening_sockets()
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--model",
         str(tmp_path / "missing.gguf"), "--log-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=100)
    assert result.returncode == 1
    assert "exited with code" in result.stderr and "during start-up" in result.stderr
    assert "missing.gguf" in result.stderr  # the child's own error, from its log tail
    assert "stopped." in result.stdout
    # ...and leaves nothing running: no process of the cluster, no socket it listened on.
    deadline = time.monotonic() + 5
    while (left := cluster_processes(before)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running after pdserve up exited: {left}"
    assert listening_sockets() <= sockets_before
