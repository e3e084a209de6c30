"""A bounded pool of staging slots for packed messages (packing.py), reused forever.

Why fixed slots rather than an allocation per message: on cuda_ipc the receiver maps
the sender's buffer by IPC handle, and UCX caches that mapping per allocation; slots
carved once from one allocation are mapped once, so a message costs no handle
open/close. The bound is the pool's whole memory: `num_slots * slot_bytes`.

Lifecycle of a slot: free -> acquired (acquire / try_acquire) -> free (release, exactly
once, by whoever acquired it, on success and on every failure path). The memory is
allocated on the first acquire and kept until the process ends (UCX may hold a mapping).

Invariants (check_invariants): num_free + num_acquired == num_slots once allocated;
a waiter exists only while no slot is free.
"""

from __future__ import annotations

import asyncio
import collections

import torch


class StagingPool:
    def __init__(self, device: torch.device | str, *, slot_bytes: int,
                 num_slots: int) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError("a staging pool needs slot_bytes > 0 and num_slots > 0")
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self._memory: torch.Tensor | None = None
        self._free: list[int] = []
        self._acquired: set[int] = set()
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()

    def _allocate(self) -> None:
        self._memory = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8,
                                   device=self.device)
        self._free = list(range(self.num_slots - 1, -1, -1))

    def slot(self, slot_id: int) -> torch.Tensor:
        """The slot's memory: a flat uint8 tensor of slot_bytes."""
        assert self._memory is not None and slot_id in self._acquired
        start = slot_id * self.slot_bytes
        return self._memory[start:start + self.slot_bytes]

    def try_acquire(self) -> int | None:
        if self._memory is None:
            self._allocate()
        if not self._free:
            return None
        slot_id = self._free.pop()
        self._acquired.add(slot_id)
        return slot_id

    async def acquire(self) -> int:
        """A free slot; waits (FIFO) while none is. Callers bound the wait by a deadline."""
        slot_id = self.try_acquire()
        if slot_id is not None:
            return slot_id
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # handed over just as we were cancelled
            raise
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def release(self, slot_id: int) -> None:
        self._acquired.remove(slot_id)  # KeyError: released twice, a bug
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                self._acquired.add(slot_id)
                future.set_result(slot_id)
                return
        self._free.append(slot_id)

    @property
    def num_acquired(self) -> int:
        return len(self._acquired)

    def check_invariants(self) -> None:
        if self._memory is not None:
            assert len(self._free) + len(self._acquired) == self.num_slots
            assert not set(self._free) & self._acquired
        assert not (self._free and any(not w.done() for w in self._waiters))
