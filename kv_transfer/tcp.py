"""TCP data plane: KV bytes as data frames on the control connection, straight into the pool.

For hosts where UCX is not installable (macOS, minimal images) or when chosen explicitly;
`make_backend` logs when it is picked. The receiver's `FrameConnection` asks `dest_for(tag)`
for every read, so the kernel copies socket bytes directly into the KV pool (no staging);
the sender writes views of its pool (uvloop copies only what the socket cannot take yet).
Host (CPU) pools only: a CUDA pool needs the UCX plane.

Invariants: `_dests` holds exactly the messages of IN_FLIGHT transfers not yet landed;
after `flush(transfer)` none of its tags has a destination, so no byte can land in its
blocks (frames still in the socket are read into scratch and dropped).
"""

from __future__ import annotations

from typing import Any

from kv_transfer.inbound import InboundTransfer
from kv_transfer.layout import Message, split_tag, tag_for
from kv_transfer.sender import OutboundTransfer, PeerLink


class TcpReceivePlane:
    def __init__(self, dst: Any) -> None:
        self._dst = memoryview(dst).cast("B")
        self._dests: dict[int, memoryview] = {}
        self._transfers: dict[int, tuple[InboundTransfer, Any]] = {}

    def ucx_address(self) -> bytes | None:
        return None

    def post(self, transfer: InboundTransfer, on_landed, on_failed) -> None:
        seq = transfer.transfer_seq
        for m in transfer.plan.all_messages():
            self._dests[tag_for(seq, m.index)] = \
                self._dst[m.dst_offset_bytes:m.dst_offset_bytes + m.num_bytes]
        self._transfers[seq] = (transfer, on_landed)

    def dest_for(self, tag: int) -> memoryview | None:
        return self._dests.get(tag)

    def data_landed(self, tag: int) -> None:
        if self._dests.pop(tag, None) is None:
            return  # a frame of a flushed transfer: dropped
        entry = self._transfers.get(split_tag(tag)[0])
        if entry is not None:
            transfer, on_landed = entry
            if transfer.num_landed + 1 == transfer.num_messages:
                del self._transfers[transfer.transfer_seq]
            on_landed(transfer)

    async def flush(self, transfer: InboundTransfer) -> None:
        self._transfers.pop(transfer.transfer_seq, None)
        for m in transfer.plan.all_messages():
            self._dests.pop(tag_for(transfer.transfer_seq, m.index), None)

    @property
    def num_registered(self) -> int:
        return len(self._dests)

    async def close(self) -> None:
        self._dests.clear()
        self._transfers.clear()


class TcpSendPlane:
    async def connect(self, link: PeerLink, welcome: Any) -> None:
        return None  # data frames share the control connection

    async def send(self, link: PeerLink, transfer_seq: int, messages: list[Message],
                   src: Any, transfer: OutboundTransfer) -> None:
        view = memoryview(src).cast("B")
        for m in messages:
            if transfer.stopped:
                return
            await link.conn.send_data(tag_for(transfer_seq, m.index),
                                      view[m.src_offset_bytes:m.src_offset_bytes + m.num_bytes])

    def disconnect(self, link: PeerLink) -> None:
        return None

    async def close(self) -> None:
        return None
