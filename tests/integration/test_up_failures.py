"""`pdserve up` fails clearly, and leaves nothing running, when a child dies at start."""

from __future__ import annotations

import subprocess
import sys

import pytest
from up_process import REPO

pytestmark = pytest.mark.timeout(120)


def test_child_dying_at_start_fails_with_its_log(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "up", "--port", "0", "--model",
         str(tmp_path / "missing.gguf"), "--log-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=100)
    assert result.returncode == 1
    assert "exited with code" in result.stderr and "during start-up" in result.stderr
    assert "missing.gguf" in result.stderr  # the child's own error, from its log tail
    assert "stopped." in result.stdout
