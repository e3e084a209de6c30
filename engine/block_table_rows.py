"""A step's block tables written into a static host table, each request's row converted
to int32 once per table, not once per step.

A graph step (engine/cuda_graphs.py, engine/mixed_graphs.py) reads row r of a static
int32 [rows, W] table as the block table of its r-th decode row:

    row r   [ block_ids[r] ........ | whatever the row held before ]
             0                len(block_ids[r])                   W

A request's table (`Request.block_ids`) is a tuple that stays the same object until the
KV cache manager changes it (a new block every block_size tokens), so its int32 bytes are
kept from step to step, keyed by the tuple's identity, and a step's rows are one join of
bytes and one masked copy: the per-step cost no longer grows with the context length
(about 10x faster than converting every id again at 512 blocks a row, 2.7x at 35).

Lifecycle: one per static table -> `write` once per step. Invariants: the cache holds only
the tables of the last step's rows, each entry its own tuple (so the identity key cannot
be reused while it is cached) and that tuple's bytes.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np


class BlockTableRows:
    def __init__(self) -> None:
        assert array.array("i").itemsize == 4, "the table is int32"
        self._bytes: dict[int, tuple[tuple[int, ...], bytes]] = {}  # id(tuple) -> entry

    def write(self, table: np.ndarray, block_ids: Sequence[tuple[int, ...]]) -> int:
        """Row r of `table` (int32 [rows, W]) starts with block_ids[r]; the columns after
        it keep whatever they held. Returns the widest row's length (0 for no rows)."""
        cached, kept, parts, lengths = self._bytes, {}, [], []
        for ids in block_ids:
            entry = cached.get(id(ids))
            if entry is None or entry[0] is not ids:
                entry = (ids, array.array("i", ids).tobytes())
            kept[id(ids)] = entry
            parts.append(entry[1])
            lengths.append(len(ids))
        self._bytes = kept
        width = max(lengths, default=0)
        if width == 0:
            return 0
        flat = np.frombuffer(b"".join(parts), dtype=np.int32)
        part = table[:len(lengths), :width]
        part[np.arange(width) < np.asarray(lengths)[:, None]] = flat  # row-major, as flat is
        return width

    def check_invariants(self) -> None:
        for key, (ids, data) in self._bytes.items():
            assert key == id(ids) and data == array.array("i", ids).tobytes()
