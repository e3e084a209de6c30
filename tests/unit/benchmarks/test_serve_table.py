"""benchmarks/serve_table.py (the vs-vLLM script's helpers) and the script's own --help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.serve_table import table, tree_cpu_s

ROOT = Path(__file__).resolve().parents[3]


def test_the_table_shows_each_run_with_cpu_per_completed_request(tmp_path: Path) -> None:
    (tmp_path / "colocated-rateinf.json").write_text(json.dumps({
        "completed": 40, "failed": 0, "request_throughput": 0.5312, "median_ttft_ms": 22951.2,
        "median_tpot_ms": 666.4, "request_goodput": 0.0, "server_cpu_s": 133.2}))
    (tmp_path / "vllm-rate1.json").write_text(json.dumps({
        "completed": 38, "failed": 2, "request_throughput": 0.35, "median_ttft_ms": 36011,
        "median_tpot_ms": 1008, "request_goodput": None}))
    (tmp_path / "notes.json").write_text("{}")  # not a run: ignored
    assert table(tmp_path).splitlines()[2:] == [
        "| colocated | inf | 40 / 0 | 0.53 | 22,951 | 666 | 0.00 | 3.33 |",
        "| vllm | 1 | 38 / 2 | 0.35 | 36,011 | 1,008 | - | - |"]


def test_tree_cpu_counts_a_busy_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 10
        while (child_s := tree_cpu_s(child.pid)) < 0.3:
            assert time.monotonic() < deadline, "the child's CPU time was never counted"
            time.sleep(0.05)
        # The test process's tree holds the child: at least the child's time, plus its own.
        assert tree_cpu_s(os.getpid()) > child_s
    finally:
        child.kill()
        child.wait()


def test_the_script_parses_and_explains_its_options() -> None:
    script = ROOT / "benchmarks" / "vs_vllm_cpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True,
                         check=True).stdout
    for option in ("--install-vllm", "--out", "--configs", "--rates", "--num-prompts"):
        assert option in out
    bad = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr
