"""Supervision of a local cluster's child processes (used by `pdserve up`).

Each child runs in its own session (process group), so a Ctrl-C at the terminal reaches
only the supervisor, which then stops the children in order; its output goes to a log file
whose tail is shown when it dies. On Linux each child also gets PR_SET_PDEATHSIG(SIGTERM):
if the supervisor itself is killed (SIGKILL, OOM), the kernel stops the children too.

Lifecycle of a child: start() → running → (exited on its own: `poll_exited`) or
stop_all(): SIGTERM to its process group → wait up to the deadline → SIGKILL the group.

Invariant: after stop_all() returns, no child process group started here has a live
member (SIGKILL is the last resort, waited for).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    name: str  # e.g. "decode worker 0", shown in messages
    argv: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, num_lines: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])


def _die_with_parent(parent_pid: int) -> None:
    """Runs in the child between fork and exec: SIGTERM when the parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return  # not Linux: the supervisor's own shutdown is the only guard
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        slug = name.replace(" ", "-")
        child = Child(name=name, argv=list(argv), log_path=self.log_dir / f"{slug}.log")
        parent_pid = os.getpid()
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
                preexec_fn=(lambda: _die_with_parent(parent_pid))
                if sys.platform == "linux" else None)
        self.children.append(child)
        return child

    def poll_exited(self) -> Child | None:
        """The first child that has exited, if any."""
        return next((c for c in self.children if c.returncode() is not None), None)

    def stop(self, children: Sequence[Child], timeout_s: float) -> None:
        """SIGTERM each child's group, wait up to timeout_s for all, then SIGKILL the rest."""
        for child in children:
            if child.returncode() is None:
                _signal_group(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in children:
            assert child.process is not None
            try:
                child.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in children:
            # Also reaps grandchildren left in the group by a child that exited first.
            _signal_group(child.pid, signal.SIGKILL)
            assert child.process is not None
            if child.process.poll() is None:
                child.process.wait(5.0)

    def stop_all(self, timeout_s: float) -> None:
        self.stop(list(reversed(self.children)), timeout_s)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
