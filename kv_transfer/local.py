"""In-process backend: plain copies between two pools of one process (colocated mode, tests).

Same protocols and error types as the wire backends. `LocalSender` is given the receivers
it may address (a dict, not a global registry). A layer is copied synchronously inside
`send_layer`, so there is never a byte in flight: a failure releases at once.

Lifecycle and invariants: those of interface.py and inbound.py; `check_invariants()`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

import torch

from engine.kv_storage import KVStorage
from kv_transfer.errors import (KVTransferError, PeerLost, TransferCancelled, TransferRejected,
                                TransferTimeout)
from kv_transfer.inbound import InboundHandle, InboundTransfer
from kv_transfer.interface import ReleaseBlocks, TransferSpec, TransferState
from kv_transfer.layout import TransferPlan, check_layouts


class LocalReceiver:
    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.layout = storage.layout
        self.address = f"local:{secrets.token_hex(6)}"
        self.closed = False
        self._dst = storage.kv.view(-1).view(torch.uint8)
        self._expected: dict[str, InboundTransfer] = {}

    def expect(self, request_id: str, dst_block_ids: list[int], layers: range,
               release: ReleaseBlocks, timeout_s: float) -> InboundHandle:
        if request_id in self._expected:
            raise ValueError(f"transfer {request_id} is already expected")
        loop = asyncio.get_running_loop()
        transfer = InboundTransfer(request_id, dst_block_ids, layers, release,
                                   loop.time() + timeout_s)
        transfer.timer = loop.call_at(transfer.deadline, self.fail, transfer, TransferTimeout(
            f"transfer {request_id}: not complete within {timeout_s:.3f}s"))
        self._expected[request_id] = transfer
        return InboundHandle(transfer, self.cancel_transfer)

    async def cancel_transfer(self, transfer: InboundTransfer, reason: str) -> None:
        self.fail(transfer, TransferCancelled(
            f"transfer {transfer.request_id} cancelled by receiver: {reason}"))

    def fail(self, transfer: InboundTransfer, error: KVTransferError) -> None:
        if transfer.begin_failure(error):
            self._expected.pop(transfer.request_id, None)
            transfer.finish_failure()  # copies are synchronous: nothing can still land

    def accept(self, spec: TransferSpec) -> InboundTransfer:
        transfer = self._expected.get(spec.request_id)
        if transfer is None or transfer.state is not TransferState.PENDING:
            raise TransferRejected(f"transfer {spec.request_id}: not expected")
        if spec.dst_block_ids != transfer.dst_block_ids or spec.layers != transfer.layers:
            raise TransferRejected(f"transfer {spec.request_id}: blocks or layers differ")
        transfer.accept(TransferPlan(self.layout, spec), 1, self)
        return transfer

    def landed(self, transfer: InboundTransfer, num_messages: int) -> None:
        for _ in range(num_messages):
            if transfer.message_landed():
                self._expected.pop(transfer.request_id, None)

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    async def close(self) -> None:
        self.closed = True
        for transfer in list(self._expected.values()):
            self.fail(transfer, PeerLost(f"transfer {transfer.request_id}: receiver closed"))

    def check_invariants(self) -> None:
        for transfer in self._expected.values():
            transfer.check_invariants()


class LocalSendHandle:
    def __init__(self, sender: "LocalSender", receiver: LocalReceiver,
                 inbound: InboundTransfer) -> None:
        self._sender, self._receiver, self._inbound = sender, receiver, inbound
        self._sent_layers: set[int] = set()
        self._cancelled: TransferCancelled | None = None

    @property
    def mapped(self) -> bool:
        return False  # copies between pools of one process, not through a mapping

    @property
    def state(self) -> TransferState:
        return TransferState.CANCELLED if self._cancelled else self._inbound.state

    @property
    def sends_after_events(self) -> bool:
        return False

    def send_layers_after(self, layer_events: Sequence[torch.cuda.Event]) -> None:
        raise ValueError("the in-process backend copies each layer with send_layer")

    def send_layer(self, layer: int) -> None:
        if layer in self._sent_layers:
            raise ValueError(f"transfer {self._inbound.request_id}: layer {layer} sent twice")
        plan = self._inbound.accepted_plan
        if not isinstance(plan, TransferPlan):
            raise TypeError("the in-process carrier moves per-run plans only")
        messages = plan.layer_messages(layer)
        self._sent_layers.add(layer)
        if self._inbound.state is not TransferState.IN_FLIGHT or self._cancelled:
            return
        src, dst = self._sender.src, self._receiver._dst
        for m in messages:
            dst[m.dst_offset_bytes:m.dst_offset_bytes + m.num_bytes].copy_(
                src[m.src_offset_bytes:m.src_offset_bytes + m.num_bytes])
        self._receiver.landed(self._inbound, len(messages))

    async def finish(self) -> None:
        if self._cancelled is not None:
            raise self._cancelled
        if (len(self._sent_layers) != len(self._inbound.layers)
                and not self._inbound.state.is_terminal):
            await self.cancel("finish() before every layer was sent")
            raise ValueError(f"transfer {self._inbound.request_id}: not every layer sent")
        await self._inbound.wait()

    async def cancel(self, reason: str) -> None:
        if not self._inbound.state.is_terminal:
            self._cancelled = TransferCancelled(
                f"transfer {self._inbound.request_id} cancelled by sender: {reason}")
            self._receiver.fail(self._inbound, self._cancelled)


class LocalSender:
    def __init__(self, storage: KVStorage, receivers: dict[str, LocalReceiver]) -> None:
        self.layout = storage.layout
        self.src = storage.kv.view(-1).view(torch.uint8)
        self._receivers = receivers

    async def start(self, peer_address: str, spec: TransferSpec,
                    timeout_s: float) -> LocalSendHandle:
        receiver = self._receivers.get(peer_address)
        if receiver is None or receiver.closed:
            raise PeerLost(f"no local KV receiver at {peer_address}")
        check_layouts(self.layout, receiver.layout, peer_address)
        TransferPlan(self.layout, spec)  # validates the spec against our pool
        return LocalSendHandle(self, receiver, receiver.accept(spec))

    async def close(self) -> None:
        return None

    def check_invariants(self) -> None:
        for address, receiver in self._receivers.items():
            assert receiver.layout.compatible_with(self.layout) is None, \
                f"local receiver {address} has a layout this sender cannot write"
