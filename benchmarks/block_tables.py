"""A graph step's block tables on the host: kept bytes (BlockTableRows) against converting
every row's ids again, side by side, at several context lengths.

The CUDA graphs read each decode row's block table from a static int32 table that the
host fills before every step (engine/cuda_graphs.py, engine/mixed_graphs.py). Until
2026-12-04 every step converted every id of every row (`np.fromiter` over the chained
tuples): a cost per step that grows with the context. `BlockTableRows` keeps each
request's table as int32 bytes while the table (a tuple that stays the same object until
it changes) is unchanged. This measures both on the same tables; each step, one request
leaves (the rows after it shift up), one joins, and one row in 16 gains a block, as in a
busy decode loop.

    python -m benchmarks.block_tables [--rows 64,256] [--blocks 8,32,128,512] [--steps 300]

Output: a markdown table on stdout (µs per step, medians of 5 runs).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import numpy as np

from engine.block_table_rows import BlockTableRows


def convert_every_id(table: np.ndarray, block_ids: list[tuple[int, ...]]) -> int:
    """The conversion the graphs ran before BlockTableRows: every id, every step."""
    lengths = [len(ids) for ids in block_ids]
    width = max(lengths, default=0)
    if width == 0:
        return 0
    flat = np.fromiter(itertools.chain.from_iterable(block_ids), dtype=np.int32,
                       count=sum(lengths))
    part = table[:len(lengths), :width]
    part[np.arange(width) < np.asarray(lengths)[:, None]] = flat
    return width


def steps_of(num_rows: int, num_blocks: int, num_steps: int) -> list[list[tuple[int, ...]]]:
    """Each step's tables: the same tuple objects while a request's table is unchanged."""
    next_block = itertools.count()

    def table(n: int) -> tuple[int, ...]:
        return tuple(next(next_block) for _ in range(n))

    rows = [table(num_blocks - i % 4) for i in range(num_rows)]
    steps = []
    for step in range(num_steps):
        rows.pop(step % num_rows)  # a request finished: the rows after it move up
        rows.append(table(num_blocks - step % 4))  # another joined
        grow = step % 16
        rows[grow::16] = [ids + table(1) if len(ids) < num_blocks + 4 else ids
                          for ids in rows[grow::16]]
        steps.append(list(rows))
    return steps


def time_per_step(write, steps: list[list[tuple[int, ...]]], width: int) -> float:
    table = np.zeros((len(steps[0]), width), dtype=np.int32)
    started = time.perf_counter()
    for step in steps:
        write(table, step)
    return (time.perf_counter() - started) / len(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256",
                        help="decode rows per step (default %(default)s)")
    parser.add_argument("--blocks", default="8,32,128,512",
                        help="blocks per row: 16-token blocks, so 512 is 8k tokens of context "
                             "(default %(default)s)")
    parser.add_argument("--steps", type=int, default=300,
                        help="steps per run (default %(default)s)")
    args = parser.parse_args(argv)
    sizes = [(int(r), int(b)) for r in args.rows.split(",") for b in args.blocks.split(",")]
    if args.steps < 1 or min(min(s) for s in sizes) < 1:
        parser.error("rows, blocks and steps must be >= 1")
    print("| rows | blocks per row | every id, µs/step | kept bytes, µs/step | ratio |")
    print("|---:|---:|---:|---:|---:|")
    for num_rows, num_blocks in sizes:
        steps = steps_of(num_rows, num_blocks, args.steps)
        width = num_blocks + 8
        check_a, check_b = (np.zeros((num_rows, width), np.int32) for _ in range(2))
        kept = BlockTableRows()
        for step in steps[:20]:  # the same tables either way
            convert_every_id(check_a, step)
            kept.write(check_b, step)
            assert (check_a == check_b).all()
        runs: dict[str, list[float]] = {"every": [], "kept": []}
        for _ in range(5):
            runs["every"].append(time_per_step(convert_every_id, steps, width))
            runs["kept"].append(time_per_step(BlockTableRows().write, steps, width))
        every, kept_s = (statistics.median(runs[k]) * 1e6 for k in ("every", "kept"))
        print(f"| {num_rows} | {num_blocks} | {every:.0f} | {kept_s:.0f} | {every / kept_s:.1f}x |")
        print(f"   {num_rows} rows x {num_blocks} blocks done", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
