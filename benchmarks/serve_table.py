"""Helpers of benchmarks/vs_vllm_cpu.sh: process-tree CPU time, idle waits and the table.

    python -m benchmarks.serve_table cpu PID          CPU seconds used so far by PID and
                                                      every process below it
    python -m benchmarks.serve_table wait-idle        return once the machine is idle
                                                      (>= 85% idle over 2 s, at most 120 s)
    python -m benchmarks.serve_table table DIR        the markdown table of every
                                                      DIR/<config>-rate<R>.json that
                                                      `vllm bench serve --save-result` wrote

Each result JSON may carry "server_cpu_s" (added by the script: the server tree's CPU
seconds during that run), shown per completed request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields after "pid (comm) "


def tree_cpu_s(root: int) -> float:
    """utime + stime of `root` and all its live descendants, in seconds."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is None:
            continue
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def wait_idle(min_idle: float = 0.85, sample_s: float = 2.0, limit_s: float = 120.0) -> float:
    """Block until the machine is idle; returns the last idle fraction seen."""
    deadline = time.monotonic() + limit_s
    while True:
        total0, idle0 = _cpu_times()
        time.sleep(sample_s)
        total1, idle1 = _cpu_times()
        idle = (idle1 - idle0) / max(1, total1 - total0)
        if idle >= min_idle or time.monotonic() > deadline:
            return idle


def table(folder: Path) -> str:
    rows = ["| config | rate | ok / failed | req/s | TTFT p50 ms | TPOT p50 ms | goodput "
            "req/s | server CPU s / request |", "|---|---|---|---|---|---|---|---|"]
    for path in sorted(folder.glob("*-rate*.json")):
        config, _, rate = path.stem.rpartition("-rate")
        d = json.loads(path.read_text())
        completed, failed = d.get("completed", 0), d.get("failed", 0)
        cpu = d.get("server_cpu_s")
        cpu_text = f"{cpu / completed:.2f}" if cpu is not None and completed else "-"
        goodput = d.get("request_goodput")
        rows.append(f"| {config} | {rate} | {completed} / {failed} | "
                    f"{d.get('request_throughput', 0):.2f} | {d.get('median_ttft_ms', 0):,.0f} | "
                    f"{d.get('median_tpot_ms', 0):,.0f} | "
                    f"{'-' if goodput is None else f'{goodput:.2f}'} | {cpu_text} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "cpu":
        print(f"{tree_cpu_s(int(argv[1])):.2f}")
    elif argv == ["wait-idle"]:
        print(f"idle {wait_idle():.0%}", file=sys.stderr)
    elif len(argv) == 2 and argv[0] == "table":
        print(table(Path(argv[1])))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
