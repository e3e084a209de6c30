"""TCP carrier: KV bytes as data frames on the control connection, straight into the pool.

For hosts where UCX is not installable (macOS, minimal images) or when chosen explicitly;
`make_backend` logs when it is picked. The receiver's `FrameConnection` asks `dest_for(tag)`
for every read, so the kernel copies socket bytes directly into the KV pool (no staging);
the sender writes views of its pool (uvloop copies only what the socket cannot take yet).
Host (CPU) pools only: a CUDA pool needs the UCX carrier.

Packed transfers (packing.py; host pools with small runs): a packed frame is read into a
staging slot taken when its first byte arrives (a fresh buffer if the pool is exhausted:
the reader never waits), scattered into the blocks when its last byte arrived, and the
slot released at once. The sender gathers each packed message into a buffer of its own,
since the transport may hold it until the socket takes it.

Lifecycle of a transfer here: post() (every message's destination registered) → each
frame read into its destination (packed: staged, then scattered) → the last one landed:
forgotten; or flush() (a failure): every destination of it dropped at once.

Invariants (`check_invariants`): `_dests` and `_packed` hold only messages of posted
transfers not yet landed or flushed; a frame being staged has both a destination and its
packed message, and the staging slots held are exactly those of frames being staged; after
`flush(transfer)` none of its tags has a destination, so no byte can land in its blocks
(frames still in the socket are read into scratch and dropped).
"""

from __future__ import annotations

import numpy as np
import torch

from kv_transfer.inbound import InboundTransfer, OnFailed, OnLanded
from kv_transfer.interface import TransferState
from kv_transfer.layout import Message, PoolBytes, pool_bytes, split_tag, tag_for
from kv_transfer.messages import Welcome
from kv_transfer.outbound import OutboundTransfer, PeerLink
from kv_transfer.packing import PackedMessage, PackedPlan, block_index, scatter
from kv_transfer.staging import StagingPool


class TcpReceiveCarrier:
    def __init__(self, kv: torch.Tensor, staging: StagingPool) -> None:
        self._kv = kv
        host = pool_bytes(kv)
        if not isinstance(host, np.ndarray):
            raise ValueError("the TCP carrier moves host (CPU) pools only; use UCX for CUDA")
        self._dst = host.data.cast("B")
        self._staging = staging
        self._dests: dict[int, memoryview] = {}
        self._transfers: dict[int, tuple[InboundTransfer, OnLanded]] = {}
        # packed: tag -> message; tag -> (staging tensor, slot id or None) while being read
        self._packed: dict[int, PackedMessage] = {}
        self._staged: dict[int, tuple[torch.Tensor, int | None]] = {}
        self._dst_index: dict[int, torch.Tensor] = {}

    def ucx_address(self) -> bytes | None:
        return None

    def post(self, transfer: InboundTransfer, on_landed: OnLanded, on_failed: OnFailed) -> None:
        seq, plan = transfer.seq, transfer.accepted_plan
        if isinstance(plan, PackedPlan):
            for packed in plan.all_messages():
                self._packed[tag_for(seq, packed.index)] = packed
            self._dst_index[seq] = block_index(plan.spec.dst_block_ids, self._kv.device)
        else:
            for m in plan.all_messages():
                self._dests[tag_for(seq, m.index)] = \
                    self._dst[m.dst_offset_bytes:m.dst_offset_bytes + m.num_bytes]
        self._transfers[seq] = (transfer, on_landed)

    def dest_for(self, tag: int) -> memoryview | None:
        dest = self._dests.get(tag)
        if dest is None and tag in self._packed:
            m = self._packed[tag]
            slot_id = self._staging.try_acquire() \
                if m.num_bytes <= self._staging.slot_bytes else None
            staged = (self._staging.slot(slot_id)[:m.num_bytes] if slot_id is not None
                      else torch.empty(m.num_bytes, dtype=torch.uint8))
            self._staged[tag] = (staged, slot_id)
            dest = self._dests[tag] = staged.numpy().data
        return dest

    def data_landed(self, tag: int) -> None:
        if self._dests.pop(tag, None) is None:
            return  # a frame of a flushed transfer: dropped
        m = self._packed.pop(tag, None)
        if m is not None:
            staged, slot_id = self._staged.pop(tag)
            seq = split_tag(tag)[0]
            entry = self._transfers.get(seq)
            if entry is not None and entry[0].state is TransferState.IN_FLIGHT:
                scatter(self._kv, m, self._dst_index[seq], staged)
            if slot_id is not None:
                self._staging.release(slot_id)
        entry = self._transfers.get(split_tag(tag)[0])
        if entry is not None:
            transfer, on_landed = entry
            if transfer.num_landed + 1 == transfer.num_messages:
                del self._transfers[transfer.seq]
                self._dst_index.pop(transfer.seq, None)
            on_landed(transfer)

    async def flush(self, transfer: InboundTransfer) -> None:
        seq = transfer.seq
        self._transfers.pop(seq, None)
        self._dst_index.pop(seq, None)
        for m in transfer.accepted_plan.all_messages():
            tag = tag_for(seq, m.index)
            self._dests.pop(tag, None)
            self._packed.pop(tag, None)
            staged = self._staged.pop(tag, None)
            if staged is not None and staged[1] is not None:
                self._staging.release(staged[1])  # the reader now drops this frame

    @property
    def num_registered(self) -> int:
        return len(self._dests) + len(self._packed) + self._staging.num_acquired

    def check_invariants(self) -> None:
        for tag in (*self._dests, *self._packed):
            assert split_tag(tag)[0] in self._transfers, f"tag {tag} of no posted transfer"
        assert set(self._staged) <= set(self._packed) & set(self._dests), \
            "a staged frame lost its destination or its packed message"
        held = sum(1 for _, slot_id in self._staged.values() if slot_id is not None)
        assert held == self._staging.num_acquired, \
            f"{self._staging.num_acquired} staging slots held, {held} by frames being read"

    async def close(self) -> None:
        self._dests.clear()
        self._transfers.clear()
        self._packed.clear()
        self._staged.clear()
        self._dst_index.clear()


class TcpSendCarrier:
    reuses_staging = False  # transport.write may keep a reference until the socket drains

    async def send_staged(self, link: PeerLink, tag: int, staged: torch.Tensor) -> None:
        assert link.conn is not None
        await link.conn.send_data(tag, staged.numpy().data)

    async def connect(self, link: PeerLink, welcome: Welcome) -> None:
        return None  # data frames share the control connection

    async def send(self, link: PeerLink, transfer_seq: int, messages: list[Message],
                   src: PoolBytes, transfer: OutboundTransfer) -> None:
        assert link.conn is not None and isinstance(src, np.ndarray)  # host pools only
        view = src.data.cast("B")
        for m in messages:
            if transfer.stopped:
                return
            await link.conn.send_data(tag_for(transfer_seq, m.index),
                                      view[m.src_offset_bytes:m.src_offset_bytes + m.num_bytes])

    def disconnect(self, link: PeerLink) -> None:
        return None

    async def close(self) -> None:
        return None
