"""The host-side helpers of the CUDA graphs: a step's block tables
(engine/block_table_rows.py), the capture phase (engine/cuda_graphs.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from engine.block_table_rows import BlockTableRows
from engine.cuda_graphs import capture_phase


def write_block_tables(table, tables) -> int:
    return BlockTableRows().write(table, tables)


def test_block_tables_fill_each_rows_first_columns_and_keep_the_rest():
    table = np.full((4, 6), -9, dtype=np.int32)
    tables = [(5, 6, 7), (1,), (8, 9, 10, 11, 12)]
    assert write_block_tables(table, tables) == 5
    assert table[0].tolist() == [5, 6, 7, -9, -9, -9]
    assert table[1].tolist() == [1, -9, -9, -9, -9, -9]
    assert table[2].tolist() == [8, 9, 10, 11, 12, -9]
    assert table[3].tolist() == [-9] * 6  # rows past the step stay as they were


def test_block_tables_of_no_rows_write_nothing():
    table = np.full((2, 3), -9, dtype=np.int32)
    assert write_block_tables(table, []) == 0
    assert (table == -9).all()


def test_block_tables_wider_than_the_table_are_an_error():
    with pytest.raises((IndexError, ValueError)):
        write_block_tables(np.zeros((2, 2), dtype=np.int32), [(1, 2, 3)])


def test_rows_kept_from_step_to_step_are_the_tables_of_this_step():
    rows, table = BlockTableRows(), np.full((3, 8), -9, dtype=np.int32)
    a, b, c = (1, 2), (3, 4, 5), (6,)
    for step in ([a, b, c], [b, c], [b + (7,), a], [(3, 4, 5), c, a]):  # shifts, growth
        width = rows.write(table, step)
        rows.check_invariants()
        assert width == max(len(ids) for ids in step)
        for r, ids in enumerate(step):
            assert table[r, :len(ids)].tolist() == list(ids)


def test_the_capture_phase_turns_cyclic_collection_off_and_back():
    assert gc.isenabled()
    with capture_phase():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), capture_phase():
        raise RuntimeError("a capture failed")
    assert gc.isenabled()  # back on after a failure too
    gc.disable()
    try:
        with capture_phase():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
