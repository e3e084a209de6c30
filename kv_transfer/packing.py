"""Packed transfers: many block runs gathered into one staging buffer, one message each.

Sending one message per (layer, K|V, run) costs a UCX request, a rendezvous and (cuda_ipc)
an IPC-handle lookup per message: ~60 us, so 128 KiB runs top out near 2 GB/s while the
wire does 100s of GB/s. A packed transfer instead cuts the spec into a few large
messages, each covering a layer range x a block range, gathered on the sender with one
`index_select` and scattered on the receiver with one `index_copy_`:

    message m  =  kv[layers l0:l1, K and V, spec blocks b0:b1]    (one contiguous buffer)

    staging buffer of m: [l1-l0][2][b1-b0][block_size][kv_heads][head_dim]
    sender:   staging = index_select(kv[l0:l1], dim=2, src_block_ids[b0:b1])
    receiver: kv[l0:l1].index_copy_(dim=2, dst_block_ids[b0:b1], staging)

Numbering (both sides derive it from the spec and the announced `Packing`):

    index = layer_group * num_block_chunks + block_chunk

so the messages of one layer group are one contiguous index range, sent once its last
layer was handed to `send_layer`. `choose_packing` (pure) picks the shape; the sender
announces it, so the receiver never has to agree on a policy, only on the numbering.
"""

from __future__ import annotations

import msgspec
import torch

from engine.kv_storage import KVLayout
from kv_transfer.interface import TransferSpec
from kv_transfer.layout import MAX_MESSAGES, plan_runs


class Packing(msgspec.Struct, frozen=True, kw_only=True):
    """The message shape of a packed transfer; sent in the Announce."""

    layers_per_message: int
    blocks_per_message: int


class PackingLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Staging budget and message-size targets of one process (sender or receiver)."""

    slot_bytes: int
    num_slots: int
    min_message_bytes: int
    pack_below_run_bytes: int  # pack only when the mean run is smaller; 0: never pack

    @classmethod
    def for_device(cls, on_cuda: bool) -> "PackingLimits":
        # CUDA: 4 x 64 MiB of device memory; a message costs ~60 us of Python + rendezvous,
        # so it must carry >= 32 MiB to be short next to its ~15 us of HBM time. Host: never
        # packed by default: on an idle 16-core host packing was slower than zero-copy runs
        # at every size measured, 1 MiB to 256 MiB (docs/benchmark_journal.md, KV transfer).
        if on_cuda:
            return cls(slot_bytes=64 << 20, num_slots=4, min_message_bytes=32 << 20,
                       pack_below_run_bytes=1 << 62)
        return cls(slot_bytes=8 << 20, num_slots=4, min_message_bytes=4 << 20,
                   pack_below_run_bytes=0)


class PackedMessage(msgspec.Struct, frozen=True):
    index: int
    layer_begin: int
    layer_end: int  # exclusive
    block_begin: int  # positions in the spec's block lists
    block_end: int
    num_bytes: int


def choose_packing(layout: KVLayout, spec: TransferSpec, *, slot_bytes: int, min_message_bytes: int,
                   pack_below_run_bytes: int) -> Packing | None:
    """Packing to use, or None to send the pool's runs as they are (zero copy).

    Pack when the mean run is below `pack_below_run_bytes`: on CUDA always by default (a
    device gather costs ~1 us per MiB, a message ~60 us), on the host for small runs
    (memcpy at ~10 GB/s is cheaper than a message per small run). A message is at most `slot_bytes` (the
    staging slot) and, where the transfer allows, at least `min_message_bytes`.
    """
    num_blocks = len(spec.src_block_ids)
    run_bytes = num_blocks * layout.block_bytes / len(plan_runs(spec.src_block_ids,
                                                                spec.dst_block_ids))
    if run_bytes >= pack_below_run_bytes:
        return None
    layer_bytes = 2 * num_blocks * layout.block_bytes
    if layer_bytes > slot_bytes:  # one layer does not fit: split its blocks
        return Packing(layers_per_message=1,
                       blocks_per_message=max(1, slot_bytes // (2 * layout.block_bytes)))
    num_layers = spec.layer_end - spec.layer_begin
    # Just enough layers to reach min_message_bytes: smaller groups leave the first
    # message sooner (layer-wise overlap with prefill), larger ones cost fewer messages.
    wanted = -(-min_message_bytes // layer_bytes)
    per_message = max(1, min(num_layers, wanted, slot_bytes // layer_bytes))
    return Packing(layers_per_message=per_message, blocks_per_message=num_blocks)


class PackedPlan:
    """Every message of one packed transfer; side-effect free after construction."""

    def __init__(self, layout: KVLayout, spec: TransferSpec, packing: Packing) -> None:
        spec.validate(layout.num_layers)
        if packing.layers_per_message < 1 or packing.blocks_per_message < 1:
            raise ValueError(f"transfer {spec.request_id}: bad packing {packing}")
        self.layout, self.spec, self.packing = layout, spec, packing
        num_blocks = len(spec.src_block_ids)
        self.chunks = [(b, min(b + packing.blocks_per_message, num_blocks))
                       for b in range(0, num_blocks, packing.blocks_per_message)]
        self.groups = [(l, min(l + packing.layers_per_message, spec.layer_end))
                       for l in range(spec.layer_begin, spec.layer_end,
                                      packing.layers_per_message)]
        self.num_messages = len(self.groups) * len(self.chunks)
        if self.num_messages > MAX_MESSAGES:
            raise ValueError(f"transfer {spec.request_id}: {self.num_messages} messages "
                             f"exceed {MAX_MESSAGES}")
        self.max_message_bytes = max(m.num_bytes for m in self.group_messages(0))
        self.num_bytes = (spec.layer_end - spec.layer_begin) * 2 * num_blocks \
            * layout.block_bytes

    def group_of(self, layer: int) -> int:
        if layer not in self.spec.layers:
            raise ValueError(f"transfer {self.spec.request_id}: layer {layer} not in "
                             f"{self.spec.layers}")
        return (layer - self.spec.layer_begin) // self.packing.layers_per_message

    def group_layers(self, group: int) -> range:
        return range(*self.groups[group])

    def group_messages(self, group: int) -> list[PackedMessage]:
        l0, l1 = self.groups[group]
        return [PackedMessage(group * len(self.chunks) + c, l0, l1, b0, b1,
                              (l1 - l0) * 2 * (b1 - b0) * self.layout.block_bytes)
                for c, (b0, b1) in enumerate(self.chunks)]

    def all_messages(self) -> list[PackedMessage]:
        return [m for g in range(len(self.groups)) for m in self.group_messages(g)]


def block_index(block_ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(block_ids, dtype=torch.int64, device=device)


def staging_view(slot: torch.Tensor, kv: torch.Tensor, m: PackedMessage) -> torch.Tensor:
    """The first m.num_bytes of a uint8 slot, shaped as message m's blocks (no copy)."""
    shape = (m.layer_end - m.layer_begin, 2, m.block_end - m.block_begin, *kv.shape[3:])
    return slot[:m.num_bytes].view(kv.dtype).view(shape)


def gather(kv: torch.Tensor, m: PackedMessage, src_index: torch.Tensor,
           slot: torch.Tensor) -> None:
    """Copy message m's source blocks into `slot` (queued on the current stream)."""
    torch.index_select(kv[m.layer_begin:m.layer_end], 2,
                       src_index[m.block_begin:m.block_end],
                       out=staging_view(slot, kv, m))


def scatter(kv: torch.Tensor, m: PackedMessage, dst_index: torch.Tensor,
            slot: torch.Tensor) -> None:
    """Copy message m from `slot` into its destination blocks (queued on the stream)."""
    kv[m.layer_begin:m.layer_end].index_copy_(2, dst_index[m.block_begin:m.block_end],
                                              staging_view(slot, kv, m))


def wait_device(kv: torch.Tensor) -> None:
    """Block until the queued gather/scatter finished (CUDA; host copies are synchronous).

    Why here: UCX reads (sender) or writes (receiver) staging memory on its own streams,
    unordered with ours, so a gather must be complete before its buffer is sent, and a
    scatter before its slot is reused or the transfer is reported landed."""
    if kv.is_cuda:
        torch.cuda.current_stream(kv.device).synchronize()
