"""A step's block tables written into a static host table: only the rows that changed
since the last step.

A graph step (engine/cuda_graphs.py, engine/mixed_graphs.py) reads row r of a static
int32 [rows, W] table as the block table of its r-th decode row:

    row r   [ block_ids[r] ........ | whatever the row held before ]
             0                len(block_ids[r])                   W

A request's table (`Request.block_ids`) is a tuple that stays the same object until the
KV cache manager changes it (a new block every block_size tokens), so:
  * a row whose tuple is the very object written there by the last step still holds it:
    it is not written again (most rows of most steps);
  * the rows that changed (those given a new block: one in block_size a step; and the
    rows after a request that left, which shift up) are written id by id, in compiled
    code (engine/native).
So a step's cost follows the rows that changed, not the context length.

Lifecycle: one per static table -> `write` once per step. Invariants: the table is written
only through this object; row r holds `_rows[r]` (for r < len(_rows)), which keeps each
tuple alive, so an identity seen again is the same table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.native import write_table_rows


class BlockTableRows:
    def __init__(self) -> None:
        self._rows: list[tuple[int, ...]] = []  # the tuple written at each row, in order

    def write(self, table: np.ndarray, rows: Sequence, field: int | None = None) -> int:
        """Row r of `table` (int32 [rows, W], C-contiguous) starts with the block ids of
        rows[r] (a tuple; with `field`, rows[r][field]: a chunk's block_ids); the columns
        after it keep whatever they held. Returns the widest row's length (0 for no rows).
        ValueError, nothing written, where a row is wider than the table. One compiled pass
        (engine/native): a row whose tuple is the very object written there by the last
        step is skipped, the others are written id by id."""
        if table.dtype != np.int32 or table.ndim != 2 or not table.flags.c_contiguous:
            raise ValueError("the block table must be a C-contiguous int32 [rows, W] array")
        return write_table_rows(table, table.shape[1], self._rows, rows,
                                -1 if field is None else field)

    def check_table(self, table: np.ndarray) -> None:
        """The table (the one `write` fills) holds each row's table: nothing else wrote it."""
        for r, ids in enumerate(self._rows):
            assert table[r, :len(ids)].tolist() == list(ids), f"row {r} was overwritten"
