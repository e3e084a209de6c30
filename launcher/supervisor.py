"""Supervision of a local cluster's child processes (used by `pdserve up`).

Each child runs in its own session (process group), so a Ctrl-C at the terminal reaches
only the supervisor, which then stops the children in order; its output goes to a log file
whose tail is shown when it dies. On Linux each child also gets PR_SET_PDEATHSIG(SIGTERM):
if the supervisor itself is killed (SIGKILL, OOM), the kernel stops the children too.

Lifecycle of a child: start() → running → exited on its own (`poll_exited`), or killed
(`kill`: the operations agent's restart, launcher/restart_line.py) → restart() (same argv,
env and log, a new process) → running ...; or stop()/stop_all(): SIGTERM to its process
group → wait up to the deadline → SIGKILL the group. Every signal goes to a process this
supervisor started, through its own handle (Popen): a pid is never taken from anyone else.

Invariant: after stop_all() returns, no child process group started here has a live
member (SIGKILL is the last resort, waited for); a child is restarted only after it exited.
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
    env: dict[str, str] | None = None
    essential: bool = False  # the cluster cannot run without it (see restart_policy.py)
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (every other one is closed)
    heartbeat: Path | None = None  # the file it touches while alive (launcher/liveness.py)
    process: subprocess.Popen[bytes] | None = None
    started_at: float = field(default_factory=time.monotonic)
    num_failures: int = 0  # consecutive exits without a stable run
    num_restarts: int = 0
    restart_at: float | None = None  # monotonic time a restart is due

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


def die_with_parent(parent_pid: int) -> None:
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

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
              essential: bool = False, pass_fds: tuple[int, ...] = (),
              heartbeat: bool = False) -> Child:
        """`heartbeat`: the child takes `--heartbeat-file` (appended to argv) and touches
        it while alive, LOG_DIR/NAME.heartbeat."""
        slug = name.replace(" ", "-")
        beat_path = self.log_dir / f"{slug}.heartbeat" if heartbeat else None
        if beat_path is not None:
            argv = [*argv, "--heartbeat-file", str(beat_path)]
        child = Child(name=name, argv=list(argv), log_path=self.log_dir / f"{slug}.log",
                      env=env, essential=essential, pass_fds=pass_fds, heartbeat=beat_path)
        self._spawn(child)
        self.children.append(child)
        return child

    def restart(self, child: Child) -> None:
        """Start an exited child again (same argv, env and log)."""
        if child.returncode() is None:
            raise RuntimeError(f"{child.name} is still running")
        _signal_group(child.pid, signal.SIGKILL)  # anything it left behind in its group
        child.num_restarts += 1
        child.restart_at = None
        self._spawn(child)

    @staticmethod
    def _spawn(child: Child) -> None:
        parent_pid = os.getpid()
        if child.heartbeat is not None:  # a new process is judged by its own beats only
            child.heartbeat.unlink(missing_ok=True)
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                child.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=child.env, start_new_session=True, pass_fds=child.pass_fds,
                preexec_fn=(lambda: die_with_parent(parent_pid))
                if sys.platform == "linux" else None)
        child.started_at = time.monotonic()

    def kill(self, child: Child) -> bool:
        """SIGKILL a running child's process group (works on a frozen one too); the caller's
        supervision then restarts it as any exit. False when it had exited already. Safe
        from pid reuse: an exited child not yet reaped still holds its pid."""
        if child not in self.children or child.returncode() is not None:
            return False
        _signal_group(child.pid, signal.SIGKILL)
        return True

    def poll_exited(self) -> Child | None:
        """The first child that has exited and has no restart scheduled, if any."""
        return next((c for c in self.children
                     if c.returncode() is not None and c.restart_at is None), None)

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
