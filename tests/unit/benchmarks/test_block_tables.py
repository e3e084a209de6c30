"""benchmarks/block_tables.py runs, and its two ways fill the same tables (it checks)."""

from __future__ import annotations

from benchmarks.block_tables import main


def test_the_benchmark_runs_and_both_ways_agree(capsys) -> None:
    assert main(["--rows", "5", "--blocks", "3,20", "--steps", "40"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 5 | 3 |")
