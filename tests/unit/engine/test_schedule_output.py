"""The step's message: its chunks' checks and the counts runners read from it every step."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.schedule_output import ScheduledChunk, ScheduleOutput


def test_a_chunk_checks_its_fields_and_is_immutable() -> None:
    with pytest.raises(ValueError, match="no tokens"):
        ScheduledChunk("a", (), 0, (0,), True)
    with pytest.raises(ValueError, match="negative"):
        ScheduledChunk("a", (1,), -1, (0,), True)
    chunk = ScheduledChunk("a", (5, 6), 3, (0, 1), sample=False)
    assert chunk.end_pos == 5
    with pytest.raises(AttributeError):
        chunk.start_pos = 4  # type: ignore[misc]


def test_a_decode_chunk_is_the_checked_chunk_of_one_sampled_token() -> None:
    assert ScheduledChunk.decode("d", 7, 40, (2, 3, 4)) == \
        ScheduledChunk("d", (7,), 40, (2, 3, 4), True)


def test_a_schedule_crosses_a_process_boundary_unchanged() -> None:
    """Tensor parallelism sends each schedule to its followers as msgpack."""
    schedule = ScheduleOutput((ScheduledChunk.decode("d", 7, 40, (2, 3, 4)),
                               ScheduledChunk("p", (1, 2, 3), 0, (5,), False)), ("x",))
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(schedule), type=ScheduleOutput)
    assert decoded == schedule
    assert all(type(c) is ScheduledChunk for c in decoded.chunks)


chunk_shapes = st.lists(st.tuples(st.integers(1, 5), st.integers(0, 9)), max_size=12)


@given(chunk_shapes)
def test_the_counts_are_those_of_the_chunks(shapes: list[tuple[int, int]]) -> None:
    chunks = tuple(ScheduledChunk(f"r{i}", tuple(range(n)), 0, tuple(range(b)), True)
                   for i, (n, b) in enumerate(shapes))
    schedule = ScheduleOutput(chunks)
    assert schedule.num_tokens == sum(n for n, _ in shapes)
    leading = 0
    while leading < len(shapes) and shapes[leading][0] == 1:
        leading += 1
    assert schedule.num_leading_decodes == leading
    assert schedule.max_table_len == max((b for _, b in shapes), default=0)
    assert schedule.is_empty == (not shapes)
