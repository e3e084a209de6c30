"""benchmarks/engine_gpu.py --kernels-only runs end to end and reports every kernel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.engine_gpu_kernels import Tolerance

REPO_ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("rms_norm", "add_rms_norm_", "silu_mul", "apply_rope_", "rope_write_kv_",
           "write_kv_cache_", "paged_decode_attention", "prefill_attention")


@pytest.mark.timeout(300)
def test_kernels_only_run_checks_every_kernel(tmp_path):
    markdown = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "benchmarks/engine_gpu.py", "--kernels-only", "--seed", "7",
         "--markdown", str(markdown)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [line for line in proc.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert all(line.startswith("PASS") for line in results), proc.stdout
    assert {line.split()[1] for line in results} == set(KERNELS)
    table = markdown.read_text()
    assert "--seed 7" in table  # the command that reproduces the run
    assert all(f"| {name} |" in table for name in KERNELS)


def test_an_unwritten_output_fails_the_check():
    expected = torch.ones(4)
    poisoned = torch.ones(4)
    poisoned[2] = float("nan")
    assert not Tolerance(atol=1.0, rtol=1.0).check("k", "c", [(poisoned, expected)]).ok
    assert Tolerance(atol=1e-3, rtol=0).check("k", "c", [(expected, expected)]).ok
    assert not Tolerance(atol=1e-3, rtol=1e-3).check("k", "c", [(expected * 1.01, expected)]).ok
