"""The host-side helpers of engine/cuda_graphs.py: a step's block tables, the capture phase."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from engine.cuda_graphs import capture_phase, write_block_tables


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
