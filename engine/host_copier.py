"""Copies of KV blocks between the device pool and a host buffer, for the host KV tier.

    device pool  kv[layer, K|V, block_id, slot, kv_head, head_dim]   (engine/kv_storage.py)
    host buffer  host[host_slot, layer, K|V, slot, kv_head, head_dim]

so one host slot holds every layer's K and V of one block, contiguous.

Two copiers, one interface (`HostCopier`, engine/host_kv_tier.py):

    SyncHostCopier   (CPU)   plain tensor copies, done when the call returns (`None`).
    StreamHostCopier (CUDA)  the copy is queued on a side stream after what the engine's
                             stream has queued so far (a block may still be written by a step
                             in flight) and an event recorded after it. Where the engine's
                             next step may overwrite the block (a copy at eviction), the
                             engine's stream waits on that event, on the device; a copy ahead
                             of eviction makes nothing wait, and neither does a reload: the
                             request reading the blocks is held back until its event is done
                             (engine/kv_cache.py), while the other requests' steps go on.
                             The host thread never waits: the call returns the event.

Either way a batch of blocks moves in one call, through a staging buffer beside the pool
in the other side's layout (`copy_blocks_to_host`, `StreamHostCopier.to_device`): a gather
and one copy per run of consecutive host slots, not a strided copy per block.

Copies to the host and back run on two side streams, so that a step waiting for a reload
does not wait for copies to the host queued ahead of it. Invariant: a reload from a host
slot runs after the slot's copy in flight, if any (the tier passes it as `after`), so it
reads what that copy wrote; a slot is not written again while a copy reads it (the tier
never reuses a slot in flight).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from engine.device_upload import to_device
from engine.host_kv_tier import CopyDone, HostKVTier


def host_buffer_shape(kv: torch.Tensor, num_host_blocks: int) -> tuple[int, ...]:
    """[host slot, then one block of every layer's K and V as the pool holds it]: a
    model-dtype pool's [layer, K|V, slot, kv_head, head_dim], an FP8 pool's [layer, K|V,
    block bytes] (engine/kv_quant.py)."""
    return (num_host_blocks, *kv[:, :, 0].shape)


class SyncHostCopier:
    """CPU: the device pool is host memory too; a copy is a memcpy done on the spot."""

    asynchronous = False

    def __init__(self, kv: torch.Tensor, num_host_blocks: int) -> None:
        self.kv = kv
        self.host = torch.empty(host_buffer_shape(kv, num_host_blocks), dtype=kv.dtype)

    def to_host(self, copies: Sequence[tuple[int, int]], before_writes: bool
                ) -> CopyDone | None:
        copy_blocks_to_host(self.kv, self.host, copies)
        return None

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[CopyDone]) -> CopyDone | None:
        for host_slot, block_id in copies:
            self.kv[:, :, block_id].copy_(self.host[host_slot])
        return None

    def order_writes_after(self, done: CopyDone) -> None:
        raise AssertionError("a synchronous copy is never in flight")


STAGED_BLOCKS = 16  # blocks per staging buffer, either way (32 MiB for Llama-3-8B)


def copy_blocks_to_host(kv: torch.Tensor, host: torch.Tensor,
                        copies: Sequence[tuple[int, int]]) -> None:
    """Each `(block_id, host_slot)`: pool block into host slot, STAGED_BLOCKS blocks at a
    time: one gather into a staging buffer beside the pool, each block in its host slot's
    layout, then one copy per run of consecutive slots (a batch's slots mostly are: they
    are taken in order). On CUDA, queued on the current stream (the staging memory is
    its), never waited for; a block copied straight from the pool would be strided: a
    temporary and a kernel per block."""
    for first in range(0, len(copies), STAGED_BLOCKS):
        chunk = copies[first:first + STAGED_BLOCKS]
        ids = to_device([block_id for block_id, _ in chunk], torch.long, kv.device)
        staging = kv.movedim(2, 0).index_select(0, ids)  # one kernel; comes out contiguous
        for start, end in slot_runs([slot for _, slot in chunk]):
            slot = chunk[start][1]
            host[slot:slot + end - start].copy_(staging[start:end], non_blocking=kv.is_cuda)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int]]:
    """`[start, end)` ranges of `slots` whose slots are consecutive (each one more than the
    one before), in order, covering all of them."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, i))
            start = i
    return runs


class StreamHostCopier:
    """CUDA: pinned host memory, copies on a side stream, events instead of waits."""

    asynchronous = True

    def __init__(self, kv: torch.Tensor, num_host_blocks: int) -> None:
        self.kv = kv
        self.host = torch.empty(host_buffer_shape(kv, num_host_blocks), dtype=kv.dtype,
                                pin_memory=True)
        self.to_host_stream = torch.cuda.Stream(kv.device)
        self.to_device_stream = torch.cuda.Stream(kv.device)

    def to_host(self, copies: Sequence[tuple[int, int]], before_writes: bool
                ) -> CopyDone | None:
        """One call for a whole batch (`copy_blocks_to_host`), on the side stream."""
        return self._copy(self.to_host_stream,
                          lambda: copy_blocks_to_host(self.kv, self.host, copies),
                          before_writes)

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[CopyDone]) -> CopyDone | None:
        """Up to STAGED_BLOCKS slots at a time: each slot copied whole (contiguous on both
        sides: one DMA, no kernel) into a staging buffer on the device, then one kernel
        scatters the buffer into the pool's blocks. A slot copied straight into its strided
        block costs PyTorch a temporary and a kernel per block, and the reload ran at 65-70%
        of a plain copy's rate."""
        for done in after:
            assert isinstance(done, torch.cuda.Event)
            self.to_device_stream.wait_event(done)

        def staged() -> None:  # on the side stream: the staging memory is that stream's
            for first in range(0, len(copies), STAGED_BLOCKS):
                chunk = copies[first:first + STAGED_BLOCKS]
                staging = torch.empty((len(chunk), *self.host.shape[1:]), dtype=self.kv.dtype,
                                      device=self.kv.device)
                for i, (host_slot, _) in enumerate(chunk):
                    staging[i].copy_(self.host[host_slot], non_blocking=True)
                ids = torch.tensor([block_id for _, block_id in chunk], pin_memory=True)
                self.kv.index_copy_(2, ids.to(self.kv.device, non_blocking=True),
                                    staging.movedim(0, 2))

        return self._copy(self.to_device_stream, staged, False)

    def order_writes_after(self, done: CopyDone) -> None:
        assert isinstance(done, torch.cuda.Event)
        torch.cuda.current_stream(self.kv.device).wait_event(done)

    def _copy(self, stream: torch.cuda.Stream, copy: Callable[[], object],
              engine_waits: bool) -> CopyDone:
        """`copy` queued on `stream` after what the engine's stream queued so far, then an
        event; with `engine_waits`, the engine's next work waits for it on the device."""
        engine_stream = torch.cuda.current_stream(self.kv.device)
        stream.wait_stream(engine_stream)  # after the steps already queued
        with torch.cuda.stream(stream):
            copy()
            done = torch.cuda.Event()
            done.record(stream)
        if engine_waits:
            engine_stream.wait_event(done)  # the next step's kernels run after the copy
        return done


CALIBRATION_BYTES = 16 << 20  # what the start-up measure of the reload rate copies


def measure_to_device_bytes_per_s(host: torch.Tensor, device: torch.device) -> float:
    """The rate of one copy of (up to) CALIBRATION_BYTES of `host` to `device`: the median of
    three after a warm-up, each synced (start-up only)."""
    flat = host.view(-1)[:max(1, CALIBRATION_BYTES // host.element_size())]
    dst = torch.empty_like(flat, device=device)
    seconds = []
    for i in range(4):
        start = time.perf_counter()
        dst.copy_(flat, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            seconds.append(time.perf_counter() - start)
    return flat.numel() * flat.element_size() / max(statistics.median(seconds), 1e-9)


def host_kv_tier(kv: torch.Tensor, num_bytes: int) -> HostKVTier | None:
    """A host tier of `num_bytes` beside the device pool `kv`, with the copier for its device
    (streams and events on CUDA, plain copies elsewhere); None when that is less than one
    block (the tier is off)."""
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    num_host_blocks = num_bytes // block_bytes
    if num_host_blocks < 1:
        return None
    copier: SyncHostCopier | StreamHostCopier = (
        StreamHostCopier if kv.is_cuda else SyncHostCopier)(kv, num_host_blocks)
    return HostKVTier(num_host_blocks, copier, block_bytes,
                      reload_bytes_per_s=measure_to_device_bytes_per_s(copier.host, kv.device))
