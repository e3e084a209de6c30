"""Copies of one KV block between the device pool and a host buffer, for the host KV tier.

    device pool  kv[layer, K|V, block_id, slot, kv_head, head_dim]   (engine/kv_storage.py)
    host buffer  host[host_slot, layer, K|V, slot, kv_head, head_dim]

so one host slot holds every layer's K and V of one block, contiguous.

Two copiers, one interface (`BlockCopier`):

    SyncBlockCopier   (CPU)   a plain tensor copy, done when the call returns (`None`).
    StreamBlockCopier (CUDA)  the copy is queued on a side stream after what the engine's
                              stream has queued so far (a block may still be written by a step
                              in flight), and the engine's stream waits on an event recorded
                              after the copy, so the next step's kernels (which may overwrite
                              the block just offloaded, or read the block just reloaded) run
                              after it. The host thread never waits: the call returns the event.

Invariant: copies happen in the order they were asked for (one side stream), so a reload
from a host slot asked for after its offload reads what the offload wrote.
"""

from __future__ import annotations

import torch

from engine.host_kv_tier import BlockCopier, CopyDone, HostKVTier


def host_buffer_shape(kv: torch.Tensor, num_host_blocks: int) -> tuple[int, ...]:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv.shape
    return (num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)


class SyncBlockCopier:
    """CPU: the device pool is host memory too; a copy is a memcpy done on the spot."""

    def __init__(self, kv: torch.Tensor, num_host_blocks: int) -> None:
        self.kv = kv
        self.host = torch.empty(host_buffer_shape(kv, num_host_blocks), dtype=kv.dtype)

    def to_host(self, block_id: int, host_slot: int) -> CopyDone | None:
        self.host[host_slot].copy_(self.kv[:, :, block_id])
        return None

    def to_device(self, host_slot: int, block_id: int) -> CopyDone | None:
        self.kv[:, :, block_id].copy_(self.host[host_slot])
        return None


class StreamBlockCopier:
    """CUDA: pinned host memory, copies on a side stream, events instead of waits."""

    def __init__(self, kv: torch.Tensor, num_host_blocks: int) -> None:
        self.kv = kv
        self.host = torch.empty(host_buffer_shape(kv, num_host_blocks), dtype=kv.dtype,
                                pin_memory=True)
        self.stream = torch.cuda.Stream(kv.device)

    def to_host(self, block_id: int, host_slot: int) -> CopyDone | None:
        return self._copy(self.host[host_slot], self.kv[:, :, block_id])

    def to_device(self, host_slot: int, block_id: int) -> CopyDone | None:
        return self._copy(self.kv[:, :, block_id], self.host[host_slot])

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyDone:
        engine_stream = torch.cuda.current_stream(self.kv.device)
        self.stream.wait_stream(engine_stream)  # after the steps already queued
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        engine_stream.wait_event(done)  # the next step's kernels run after the copy
        return done


def host_kv_tier(kv: torch.Tensor, num_bytes: int) -> HostKVTier | None:
    """A host tier of `num_bytes` beside the device pool `kv`, with the copier for its device
    (streams and events on CUDA, plain copies elsewhere); None when that is less than one
    block (the tier is off)."""
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    num_host_blocks = num_bytes // block_bytes
    if num_host_blocks < 1:
        return None
    copier: BlockCopier = (StreamBlockCopier if kv.is_cuda else SyncBlockCopier)(
        kv, num_host_blocks)
    return HostKVTier(num_host_blocks, copier, block_bytes)
