"""The paged KV pool's memory: one preallocated tensor for every layer's K and V.

Layout (row-major), the contract `kv_transfer/` relies on:

    kv[layer, kv_index, block_id, slot, kv_head, head_dim]     kv_index 0 = K, 1 = V

so one block of one layer's K (or V) is one contiguous run of `block_bytes` bytes, and
blocks with adjacent ids are adjacent in memory. An FP8 pool (`fp8_e4m3`) is bytes
[layer, kv_index, block_id, block_bytes], each block its values then their per-token scales
(engine/kv_quant.py); `layer()` gives its values and scales as views. Lifecycle: allocated once at start-up,
never resized or moved while the process lives (peers may hold its address).

Host pools live in an anonymous shared-memory file (a Linux memfd, `HostPoolFile`), so a
KV peer on the same host can map the very same pages and copy blocks straight into them
(kv_transfer/pool_mapping.py); CUDA pools are shared through CUDA IPC instead. Where memfd
is missing (not Linux) the host pool is ordinary memory and cannot be mapped.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from typing import TYPE_CHECKING

import msgspec
import torch

from engine.config import ModelConfig
from engine.kv_quant import (FP8_DTYPE, CacheView, QuantizedCache, check_device, fp8_block_bytes,
                             fp8_views)

if TYPE_CHECKING:
    from engine.host_kv_tier import HostKVTier

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    FP8_DTYPE: "fp8_e4m3",
}
FP8 = "fp8_e4m3"


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """What a peer must agree on before any KV byte moves."""

    dtype: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def element_size(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2, FP8: 1}[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V); an FP8 block's scales included."""
        if self.dtype == FP8:
            return fp8_block_bytes(self.block_size, self.num_kv_heads, self.head_dim)
        return self.block_size * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def layer_kv_bytes(self) -> int:
        """Bytes of one layer's K (or V) for all blocks."""
        return self.num_blocks * self.block_bytes

    @property
    def tensor_form(self) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of the pool's tensor: [layer, kv_index, block, slot, head, dim] of
        its dtype, or for FP8 bytes [layer, kv_index, block, block_bytes]."""
        if self.dtype == FP8:
            return torch.uint8, (self.num_layers, 2, self.num_blocks, self.block_bytes)
        dtype = {v: k for k, v in DTYPE_NAMES.items()}[self.dtype]
        return dtype, (self.num_layers, 2, self.num_blocks, self.block_size,
                       self.num_kv_heads, self.head_dim)

    def offset_bytes(self, layer: int, kv_index: int, block_id: int) -> int:
        """Byte offset of (layer, K|V, block) from the start of the pool."""
        return ((layer * 2 + kv_index) * self.num_blocks + block_id) * self.block_bytes

    def compatible_with(self, other: "KVLayout", mine: str = "here",
                        theirs: str = "at the peer") -> str | None:
        """None when blocks can move between the two pools, else what differs, each field
        named with this pool's value (`mine`) and the other's (`theirs`)."""
        fields = ("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim")
        diffs = [f"{f} {getattr(self, f)} {mine}, {getattr(other, f)} {theirs}"
                 for f in fields if getattr(self, f) != getattr(other, f)]
        return "; ".join(diffs) or None


class HostPoolFile:
    """Zeroed host memory in a memfd named `name`, mapped once; `fd` stays open (a peer
    opens it as /proc/PID/fd/FD) until this object is collected."""

    def __init__(self, num_bytes: int) -> None:
        self.name = f"pdserve-kv-{secrets.token_hex(8)}"
        self.num_bytes = num_bytes
        self.fd = os.memfd_create(self.name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, num_bytes)
            self._map = mmap.mmap(self.fd, num_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        weakref.finalize(self, os.close, self.fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)


def _host_pool_file(num_bytes: int) -> HostPoolFile | None:
    if num_bytes == 0 or not hasattr(os, "memfd_create"):
        return None
    try:
        return HostPoolFile(num_bytes)
    except OSError:  # e.g. a seccomp profile without memfd_create: ordinary memory
        return None


class KVStorage:
    """Owns the KV tensor; says nothing about which blocks are in use (see block_pool)."""

    def __init__(self, layout: KVLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        dtype, shape = layout.tensor_form  # FP8: bytes; values and scales are views of them
        if layout.dtype == FP8:
            check_device(device)
        self.host_file: HostPoolFile | None = None
        if torch.device(device).type == "cpu":
            num_bytes = layout.num_layers * 2 * layout.layer_kv_bytes
            self.host_file = _host_pool_file(num_bytes)
        if self.host_file is not None:
            self.kv = self.host_file.tensor.view(dtype).view(shape)
        else:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self._fp8: tuple[torch.Tensor, torch.Tensor] | None = None
        if layout.dtype == FP8:
            self._fp8 = fp8_views(self.kv, layout.block_size, layout.num_kv_heads,
                                  layout.head_dim)

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype, device: torch.device | str = "cpu") -> "KVStorage":
        layout = KVLayout(dtype=DTYPE_NAMES[dtype], num_layers=config.num_layers,
                          num_blocks=num_blocks, block_size=block_size,
                          num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
        return cls(layout, device)

    @property
    def quantized(self) -> bool:
        """An FP8 pool: `layer()` gives QuantizedCache views."""
        return self._fp8 is not None

    def layer(self, layer: int) -> tuple[CacheView, CacheView]:
        """(K, V) views of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]
        (for an FP8 pool, those values with their scales [num_blocks, block_size,
        num_kv_heads])."""
        if self._fp8 is not None:
            values, scales = self._fp8
            return (QuantizedCache(values[layer, 0], scales[layer, 0]),
                    QuantizedCache(values[layer, 1], scales[layer, 1]))
        return self.kv[layer, 0], self.kv[layer, 1]

    def host_tier(self, num_bytes: int) -> "HostKVTier | None":
        """A host KV tier of `num_bytes` for this pool (engine/host_kv_tier.py); None: off."""
        from engine.host_copier import host_kv_tier

        return host_kv_tier(self.kv, num_bytes)

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
