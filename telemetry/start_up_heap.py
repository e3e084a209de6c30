"""What a process builds at start-up, kept out of Python's cyclic garbage collections.

Both long-lived processes call it once start-up is done: a worker after its warm-up, the
gateway before it listens. For a worker:

A worker builds its model, KV pool, CUDA graphs and compiled kernels once and keeps them
for its whole life: many thousands of objects. The engine loop allocates thousands of small
objects per step (chunks, outputs, their lists), and those allocations trigger the cyclic
collector, whose full collections traverse every tracked object, start-up's included: on
the host of a busy loop that is time the device waits.

    start-up (model, graphs, warm-up) -> freeze_start_up_heap() -> traffic
                                         collect once, then gc.freeze(): later collections
                                         traverse only what was made after it; the young
                                         generation collected every 10,000 allocations
                                         (CPython's default: 700, several times a step)

Reference counting still frees a frozen object that is dropped; only a reference cycle among
frozen objects would now stay, which is why start-up's garbage is collected first.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FrozenHeap:
    num_objects: int  # objects in the collector's permanent generation
    seconds: float


YOUNG_THRESHOLD = 10_000  # allocations between young collections


def freeze_start_up_heap(young_threshold: int = YOUNG_THRESHOLD) -> FrozenHeap:
    """Call once start-up is done (after the warm-up, before traffic); process-wide."""
    if young_threshold < 1:
        raise ValueError(f"young_threshold must be positive, got {young_threshold}")
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(young_threshold, *gc.get_threshold()[1:])
    return FrozenHeap(gc.get_freeze_count(), time.perf_counter() - started)
