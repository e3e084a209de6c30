"""`pdserve up` fails clearly, and leaves nothing running, when a child dies at start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from up_process import REPO

pytestmark = pytest.mark.timeout(120)


def marked_processes(marker: str) -> dict[int, str]:
    """The live processes whose environment carries `marker` (pid: command line): the
    process tree of one `pdserve up`, not the clusters other tests run at the same time."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                found[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
    return found


def test_child_dying_at_start_fails_with_its_log(tmp_path) -> None:
    # Every process of this cluster inherits the marker; other tests' clusters (the suite
    # runs on several processes) do not.
    marker = f"PDSERVE_TEST_MARK={uuid.uuid4().hex}"
    name, value = marker.split("=")
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--model",
         str(tmp_path / "missing.gguf"), "--log-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=100, env={**os.environ, name: value})
    assert result.returncode == 1
    assert "exited with code" in result.stderr and "during start-up" in result.stderr
    assert "missing.gguf" in result.stderr  # the child's own error, from its log tail
    assert "stopped." in result.stdout
    # ...and leaves nothing running: no process of the cluster.
    deadline = time.monotonic() + 5
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    # (A socket outlives its process only in a child that inherited it, which this finds.)
    assert not left, f"still running after pdserve up exited: {left}"
