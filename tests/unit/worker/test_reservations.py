"""The reservation state machine: released at most once, never after joining."""

from __future__ import annotations

import pytest

from worker.reservations import (EndReason, Reservation, ReservationState, ReservationTable,
                                 blocks_to_receive)


def make(rid: str = "r", num_receive: int = 2) -> Reservation:
    return Reservation(rid, list(range(40)), [4, 5, 6], 0, num_receive, deadline=10.0)


def test_blocks_to_receive_counts_prompt_blocks_after_the_cached_prefix() -> None:
    assert blocks_to_receive(40, 16, 0) == (0, 3)
    assert blocks_to_receive(40, 16, 32) == (2, 1)
    assert blocks_to_receive(32, 16, 32) == (2, 0)


def test_release_is_true_exactly_once_and_leaves_a_tombstone() -> None:
    table = ReservationTable()
    table.add(make())
    assert table.release("r", EndReason.TRANSFER_FAILED, "peer lost")
    assert not table.release("r", EndReason.EXPIRED)
    assert "r" not in table and table.num_released == 1
    assert table.tombstone("r") == (EndReason.TRANSFER_FAILED, "peer lost")
    table.check_invariants()


def test_joined_reservation_cannot_be_released() -> None:
    table = ReservationTable()
    table.add(make())
    with pytest.raises(ValueError, match="receiving"):
        table.join("r")  # the KV has not landed
    table.mark_landed("r")
    reservation = table.join("r")
    assert reservation.state is ReservationState.JOINED
    assert not table.release("r", EndReason.ABORTED)
    assert table.num_released == 0 and table.num_joined == 1


def test_fully_cached_prompt_starts_landed() -> None:
    table = ReservationTable()
    table.add(make(num_receive=0))
    assert table.get("r").state is ReservationState.LANDED


def test_duplicate_ids_are_refused_and_tombstones_are_bounded() -> None:
    table = ReservationTable(max_tombstones=2)
    table.add(make("a"))
    with pytest.raises(ValueError):
        table.add(make("a"))
    for rid in ("a", "b", "c"):
        if rid != "a":
            table.add(make(rid))
        table.release(rid, EndReason.EXPIRED, f"{rid} expired")
    # Only the last two ended ids are remembered, each with how and why it ended.
    assert table.tombstone("a") is None
    assert table.tombstone("b") == (EndReason.EXPIRED, "b expired")
    assert table.tombstone("c") == (EndReason.EXPIRED, "c expired")
