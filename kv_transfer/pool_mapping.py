"""A receiver's KV pool mapped into a sender on the same host: exported once, opened once.

Mapped transfers (outbound.py, mapped_copy.py) copy blocks straight from the sender's
pool into the receiver's, in one pass, with no staging and no data messages. That needs
the receiver's pool in the sender's address space:

    receiver                                        sender (same host)
    export_pool(storage) -> PoolExport  --Welcome-->  open_pool(export, ...) -> MappedPool
      cuda_ipc: torch's CUDA IPC handle of the          CUDA IPC open on the GPU of that
                pool's allocation                        UUID (same GPU, or peer access)
      memfd:    pid, fd and name of the host pool's     /proc/PID/fd/FD opened and checked
                memfd (engine/kv_storage.py)             against the name, then mmap'd

`open_pool` raises `MappingUnavailable` (with the reason) wherever the mapping cannot be
made: another host (boot ids differ), a GPU not visible here, no peer access, a pid
namespace that hides the receiver (the name check catches a different process behind the
same pid), IPC refused by the driver or the container. The sender then falls back to its
carrier (UCX or TCP); nothing else changes.

Trust: the export is sent only after the sender proved the internal token (receiver.py),
and a mapped sender can write anywhere in the receiver's pool, so it is given to
authenticated peers only. Lifecycle: one MappedPool per link; closed when the link is lost
or the sender closes (CUDA: the IPC mapping is released with the last tensor on it).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Literal

import msgspec
import torch

from engine.kv_storage import KVLayout, KVStorage


class MappingUnavailable(Exception):
    """The receiver's pool cannot be mapped here; the message says why."""


class PoolExport(msgspec.Struct, frozen=True, kw_only=True):
    """What a sender on the same host needs to map a receiver's pool; sent in Welcome."""

    kind: Literal["memfd", "cuda_ipc"]
    host_id: str  # the kernel's boot id: a mapping works only on the exporting host
    num_bytes: int
    pid: int = 0  # memfd: /proc/PID/fd/FD, whose link must name NAME
    fd: int = -1
    name: str = ""
    device_uuid: str = ""  # cuda_ipc: torch's storage-sharing fields (StorageSharing.cpp)
    ipc_handle: bytes = b""
    storage_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


def host_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(storage: KVStorage) -> PoolExport | None:
    """The export of `storage`'s pool, or None when it cannot be shared (no memfd)."""
    kv = storage.kv
    num_bytes = kv.numel() * kv.element_size()
    if kv.is_cuda:
        fields = kv.untyped_storage()._share_cuda_()  # a fresh IPC reference per call
        _, handle, size, offset, counter, counter_offset, event, sync = fields
        if kv.storage_offset() != 0:
            raise ValueError("the KV pool must start its storage")
        return PoolExport(kind="cuda_ipc", host_id=host_id(), num_bytes=num_bytes,
                          device_uuid=device_uuid(kv.device), ipc_handle=bytes(handle),
                          storage_bytes=int(size), storage_offset_bytes=int(offset),
                          ref_counter_handle=bytes(counter),
                          ref_counter_offset=int(counter_offset),
                          event_handle=bytes(event or b""), event_sync_required=bool(sync))
    host_file = storage.host_file
    if host_file is None:
        return None
    return PoolExport(kind="memfd", host_id=host_id(), num_bytes=num_bytes, pid=os.getpid(),
                      fd=host_file.fd, name=host_file.name)


class MappedPool:
    """A peer's pool as a tensor of its layout, [layers, 2, blocks, slot, head, dim]."""

    def __init__(self, kv: torch.Tensor, kind: str, mm: mmap.mmap | None = None) -> None:
        self.kv: torch.Tensor | None = kv
        self.kind = kind
        self._map = mm

    @property
    def tensor(self) -> torch.Tensor:
        if self.kv is None:
            raise RuntimeError("the mapped pool is closed")
        return self.kv

    def close(self) -> None:
        """Drop the mapping; a copy still holding a view keeps it until that view dies."""
        self.kv = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is alive: the mapping goes with it
                pass
            self._map = None


def open_pool(export: PoolExport, remote: KVLayout, local_kv: torch.Tensor) -> MappedPool:
    """Map the receiver's pool for copies from `local_kv`; raises MappingUnavailable."""
    if export.host_id == "" or export.host_id != host_id():
        raise MappingUnavailable("the receiver runs on another host")
    dtype, shape = remote.tensor_form
    expected = remote.num_layers * 2 * remote.layer_kv_bytes
    if export.num_bytes != expected:
        raise MappingUnavailable(f"exported {export.num_bytes} bytes, the layout says "
                                 f"{expected}")
    if export.kind == "memfd":
        if local_kv.is_cuda:
            raise MappingUnavailable("a host pool cannot take copies from a GPU pool")
        mm = _open_memfd(export)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        return MappedPool(flat.view(dtype).view(shape), "memfd", mm)
    if not local_kv.is_cuda:
        raise MappingUnavailable("a GPU pool cannot take copies from a host pool")
    return MappedPool(_open_cuda_ipc(export, local_kv.device).view(dtype).view(shape),
                      "cuda_ipc")


def _open_memfd(export: PoolExport) -> mmap.mmap:
    path = f"/proc/{export.pid}/fd/{export.fd}"
    try:
        target = os.readlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MappingUnavailable(f"cannot open the receiver's pool ({exc})") from None
    try:
        if not target.startswith(f"/memfd:{export.name}"):
            raise MappingUnavailable(f"{path} is not the receiver's pool (another pid "
                                     "namespace?)")
        if os.fstat(fd).st_size != export.num_bytes:
            raise MappingUnavailable("the receiver's pool file has another size")
        return mmap.mmap(fd, export.num_bytes)
    finally:
        os.close(fd)


def _open_cuda_ipc(export: PoolExport, local: torch.device) -> torch.Tensor:
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    owner = next((d for d in devices if device_uuid(d) == export.device_uuid), None)
    if owner is None:
        raise MappingUnavailable("the receiver's GPU is not visible here")
    if owner != local and not torch.cuda.can_device_access_peer(local, owner):
        raise MappingUnavailable(f"no peer access from {local} to {owner}")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            owner.index, export.ipc_handle, export.storage_bytes,
            export.storage_offset_bytes, export.ref_counter_handle,
            export.ref_counter_offset, export.event_handle or None,
            export.event_sync_required)
    except RuntimeError as exc:  # the driver refused the handle (container, MIG, ...)
        raise MappingUnavailable(f"CUDA IPC open failed: {exc}") from None
    flat = torch.empty(0, dtype=torch.uint8, device=owner)
    flat.set_(storage, 0, (export.num_bytes,), (1,))
    if owner != local:  # enables peer access (torch does on a cross-device copy)
        torch.empty(1, device=local).copy_(torch.empty(1, device=owner))
    return flat
