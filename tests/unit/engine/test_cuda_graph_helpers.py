"""The host-side helpers of the CUDA graphs: a step's block tables
(engine/block_table_rows.py), the capture phase (engine/cuda_graphs.py)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_table_rows import BlockTableRows
from engine.cuda_graphs import capture_phase
from engine.schedule_output import BLOCK_IDS, ScheduledChunk


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


def test_a_row_wider_than_the_table_writes_nothing():
    rows, table = BlockTableRows(), np.full((3, 2), -9, dtype=np.int32)
    with pytest.raises(ValueError, match="3 blocks in a table 2 wide"):
        rows.write(table, [(1, 2), (3, 4, 5)])
    assert (table == -9).all()
    assert rows.write(table, [(1, 2)]) == 2  # and the next step still writes its rows
    assert table[0].tolist() == [1, 2]


def test_a_chunk_s_table_is_read_from_its_field():
    rows, table = BlockTableRows(), np.zeros((2, 4), dtype=np.int32)
    chunks = (ScheduledChunk.decode("a", 5, 17, (4, 9)), ScheduledChunk.decode("b", 6, 0, (2,)))
    assert rows.write(table, chunks, field=BLOCK_IDS) == 2
    assert table.tolist() == [[4, 9, 0, 0], [2, 0, 0, 0]]


def test_rows_kept_from_step_to_step_are_the_tables_of_this_step():
    rows, table = BlockTableRows(), np.full((3, 8), -9, dtype=np.int32)
    a, b, c = (1, 2), (3, 4, 5), (6,)
    for step in ([a, b, c], [b, c], [b + (7,), a], [(3, 4, 5), c, a]):  # shifts, growth
        width = rows.write(table, step)
        rows.check_table(table)
        assert width == max(len(ids) for ids in step)
        for r, ids in enumerate(step):
            assert table[r, :len(ids)].tolist() == list(ids)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 40), max_size=40), min_size=1, max_size=12),
       grow=st.lists(st.booleans(), max_size=40))
def test_every_step_leaves_each_row_starting_with_its_table(steps, grow):
    """Random batches from a pool of tuples (kept, dropped, shifted, grown): after every
    write each live row starts with its table and the rows past the step are untouched."""
    pool = [tuple(range(10 * i, 10 * i + 1 + i % 7)) for i in range(41)]
    rows, table = BlockTableRows(), np.full((40, 16), -9, dtype=np.int32)
    for step_index, picks in enumerate(steps):
        step = []
        for k, i in enumerate(dict.fromkeys(picks)):  # a request appears once a step
            if k < len(grow) and grow[k] and len(pool[i]) < 16:
                pool[i] = pool[i] + (step_index,)  # a new block: a new tuple
            step.append(pool[i])
        before = table[len(step):].copy()
        width = rows.write(table, step)
        rows.check_table(table)
        assert width == max((len(ids) for ids in step), default=0)
        for r, ids in enumerate(step):
            assert table[r, :len(ids)].tolist() == list(ids)
        assert (table[len(step):] == before).all()


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


def test_a_table_written_behind_its_back_is_caught():
    rows, table = BlockTableRows(), np.zeros((2, 4), dtype=np.int32)
    rows.write(table, [(1, 2), (3,)])
    rows.check_table(table)
    table[1, 0] = 7  # not through `write`: the next step would keep it as it is
    with pytest.raises(AssertionError, match="row 1"):
        rows.check_table(table)
