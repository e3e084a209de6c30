"""freeze_start_up_heap: start-up's objects leave the cyclic collections, later garbage
does not."""

from __future__ import annotations

import gc
import weakref

from telemetry.start_up_heap import freeze_start_up_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_start_up_objects_are_frozen_and_later_cycles_are_still_collected() -> None:
    threshold = gc.get_threshold()
    try:
        start_up = [Node() for _ in range(1000)]
        start_up_cycle = Node()
        start_up_cycle.other = start_up_cycle
        start_up_garbage = Node()
        start_up_garbage.other = start_up_garbage
        garbage_ref = weakref.ref(start_up_garbage)
        del start_up_garbage
        heap = freeze_start_up_heap()
        assert garbage_ref() is None  # start-up's garbage collected first, not frozen
        assert heap.num_objects >= len(start_up) and heap.seconds >= 0
        assert gc.get_threshold()[0] == 10_000  # young collections every 10k allocations
        tracked = {id(o) for o in gc.get_objects()}  # what collections traverse
        assert id(start_up[0]) not in tracked and id(start_up_cycle) not in tracked
        later = Node()
        later.other = later
        later_ref = weakref.ref(later)
        assert id(later) in {id(o) for o in gc.get_objects()}
        del later
        gc.collect()
        assert later_ref() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
