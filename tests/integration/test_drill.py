"""`pdserve drill` end to end: its own `pdserve up` (2 workers of role `both`, the default
layout on a CPU; the default model), a worker whose engine step fails under load (the
stand-in for a device error: its streams migrate, it exits and is started again; a killed
worker is drilled by the reliability tests), a worker's control port cut off from every
caller (its fault proxy, rpc/fault_proxy.py), and the agent killed, and the table's figures
as an operator reads them.

The agent's probation is shortened (PDSERVE_PROBATION_S, inherited by the agent `pdserve up`
starts) so the restarted decode worker is routable again within the test's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_drill_fails_an_engine_cuts_a_worker_off_kills_the_agent_and_the_cluster_recovers(
        tmp_path) -> None:
    output = tmp_path / "drill.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_ADMIN_TOKEN", "PDSERVE_INTERNAL_TOKEN")}
    env.update({"PYTHONUNBUFFERED": "1", "PDSERVE_PROBATION_S": "2", "TMPDIR": str(tmp_path)})
    done = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "drill",
         "--up-args", "--workers 2 --roles both --threads-per-worker 1 --log-level warning",
         "--scenarios", "fail-decode,partition-decode,kill-agent", "--fault-s", "6",
         "--before-s", "2", "--after-s", "1",
         "--rate", "1", "--check-tokens", "8", "--recovery-timeout-s", "60",
         "--output", str(output)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    report = json.loads(output.read_text())
    rows = {row["scenario"]: row for row in report["rows"]}
    assert list(rows) == ["fail-decode", "partition-decode", "kill-agent"]
    for row in rows.values():
        assert row["ok"] > 0 and row["failed_by_kind"] == {}, row
        assert row["answers_checked"] > 0 and row["answers_broken"] == 0, row
        assert (row["held_kv_blocks"], row["held_tables"], row["held_reservations"]) \
            == (0, 0, 0), row
        assert row["recovered_after_s"] is not None and row["recovered_after_s"] < 60, row
        assert row["health_lies"] == [] and row["problems"] == [], row
    assert rows["fail-decode"]["ejected_after_s"] is not None
    # A worker cut off from every caller is found by the agent within 5 s.
    assert rows["partition-decode"]["ejected_after_s"] < 5
    # The table on stdout says the same.
    table = done.stdout.splitlines()
    assert table[0].startswith("| scenario |")
    assert [line.split("|")[1].strip() for line in table[2:]] == ["fail-decode",
                                                                   "partition-decode",
                                                                   "kill-agent"]
    assert all(line.rstrip().endswith("| pass |") for line in table[2:])
