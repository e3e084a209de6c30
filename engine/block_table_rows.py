"""A step's block tables written into a static host table: only the rows that changed
since the last step, each request's row converted to int32 once per table.

A graph step (engine/cuda_graphs.py, engine/mixed_graphs.py) reads row r of a static
int32 [rows, W] table as the block table of its r-th decode row:

    row r   [ block_ids[r] ........ | whatever the row held before ]
             0                len(block_ids[r])                   W

A request's table (`Request.block_ids`) is a tuple that stays the same object until the
KV cache manager changes it (a new block every block_size tokens), so:
  * a row whose tuple is the very object written there by the last step still holds it:
    it is not written again (most rows of most steps);
  * the rows that changed (those given a new block: one in block_size a step; and the
    rows after a request that left, which shift up) are written from int32 bytes kept
    per tuple (keyed by the tuple's identity): a few one by one, more in one scatter.
So a step's cost follows the rows that changed, not the batch or the context length.

Lifecycle: one per static table -> `write` once per step. Invariants: the table is written
only through this object; row r holds `_rows[r]` (for r < len(_rows)); every row's tuple
has its bytes in `_bytes`, each entry its own tuple (which it keeps alive, so the identity
key cannot be reused while cached) and that tuple's bytes; `_bytes` holds at most twice
the rows of the widest recent step (pruned to the current rows beyond that).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np

# Changed rows written one by one up to this many; more go through one scatter.
FEW_ROWS = 8


class BlockTableRows:
    def __init__(self) -> None:
        assert array.array("i").itemsize == 4, "the table is int32"
        self._rows: list[tuple[int, ...]] = []  # the tuple written at each row, in order
        self._bytes: dict[int, tuple[tuple[int, ...], bytes]] = {}  # id(tuple) -> entry

    def write(self, table: np.ndarray, block_ids: Sequence[tuple[int, ...]]) -> int:
        """Row r of `table` (int32 [rows, W]) starts with block_ids[r]; the columns after
        it keep whatever they held. Returns the widest row's length (0 for no rows)."""
        last, n = self._rows, len(block_ids)
        common = min(n, len(last))
        changed = [r for r in range(common) if block_ids[r] is not last[r]]
        changed += range(common, n)
        width = max(map(len, block_ids), default=0)
        if width > table.shape[1]:
            raise ValueError(f"a block table of {width} blocks in a table {table.shape[1]} wide")
        if changed:
            if len(changed) <= FEW_ROWS:
                for r in changed:
                    ids = block_ids[r]
                    table[r, :len(ids)] = np.frombuffer(self._bytes_of(ids), dtype=np.int32)
            else:  # one scatter: row r's ids to (r, 0..len-1), in the order of `flat`
                rows = [block_ids[r] for r in changed]
                flat = np.frombuffer(b"".join([self._bytes_of(ids) for ids in rows]),
                                     dtype=np.int32)
                lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
                starts = np.cumsum(lengths) - lengths
                columns = np.arange(len(flat)) - np.repeat(starts, lengths)
                table[np.repeat(np.asarray(changed), lengths), columns] = flat
        self._rows = list(block_ids)
        if len(self._bytes) > 2 * max(n, FEW_ROWS):
            self._bytes = {id(ids): self._bytes[id(ids)] for ids in self._rows}
        return width

    def _bytes_of(self, ids: tuple[int, ...]) -> bytes:
        entry = self._bytes.get(id(ids))
        if entry is None or entry[0] is not ids:
            entry = self._bytes[id(ids)] = (ids, array.array("i", ids).tobytes())
        return entry[1]

    def check_table(self, table: np.ndarray) -> None:
        """The table (the one `write` fills) holds each row's table: nothing else wrote it."""
        for r, ids in enumerate(self._rows):
            assert table[r, :len(ids)].tolist() == list(ids), f"row {r} was overwritten"

    def check_invariants(self) -> None:
        for key, (ids, data) in self._bytes.items():
            assert key == id(ids) and data == array.array("i", ids).tobytes()
        for ids in self._rows:
            assert self._bytes.get(id(ids), (None,))[0] is ids, "a row's bytes are not kept"
