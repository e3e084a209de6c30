"""The sender's record of one transfer and of one peer link; the carriers' interface.

Three ways a transfer's bytes leave (chosen by the sender at start(), announced to the
receiver, so both sides number the same messages):

  * per run (layout.TransferPlan): one zero-copy message per (layer, K|V, run), each
    `send_layer` posts its layer's messages on the carrier;
  * packed (packing.PackedPlan): one ordered pump gathers each completed layer group into
    a staging slot and sends it (sender.send_packed);
  * mapped (the link holds the receiver's pool, pool_mapping.py): one ordered pump copies
    the layers handed over so far straight into the receiver's pool (mapped_copy.py),
    waits until the copy completed, and when every layer is copied sends Written; the
    receiver then answers Landed as for the other two.

Lifecycle: see interface.py. Failure on this side (deadline, cancel(), a failed send or
copy) = stop, drain what is in flight (sends posted, the copy running: <= abort_timeout_s),
then Abort to the receiver, which may then release its blocks; a sender that cannot drain
closes the link instead (the receiver then treats it as a dead peer).

Layer-wise (mapped CUDA links only): `send_layers_after(events)` hands every layer over at
once, each copy queued on the GPU behind its layer's event (mapped_copy.copy_after), while
the prompt is still computing. Its drain waits for those copies however long the prompt's
step takes (the GPU bounds it): a copy still queued must not outlive the receiver's blocks.

Invariants: each layer of the spec is handed over once; every task of a transfer is in its
`_tasks` until it ends; a terminal transfer posts nothing new (`stopped`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol

import torch

from engine.kernels.block_copy import BlockCopier
from kv_transfer.errors import KVTransferError, PeerLost, TransferCancelled, TransferTimeout
from kv_transfer.framing import FrameConnection
from kv_transfer.interface import TransferState
from kv_transfer.layout import Message, PoolBytes, TransferPlan
from kv_transfer.mapped_copy import MappedCopy
from kv_transfer.messages import Abort, Accepted, Rejected, Welcome, Written
from kv_transfer.packing import PackedMessage, PackedPlan
from kv_transfer.pool_mapping import MappedPool

log = logging.getLogger(__name__)


class PeerLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self.conn: FrameConnection | None = None
        self.welcome: asyncio.Future[Welcome | Any] = \
            asyncio.get_running_loop().create_future()
        self.epoch: str | None = None
        self.data: Any = None  # the carrier's per-peer state (a UCX endpoint)
        self.mapped: MappedPool | None = None  # the receiver's pool, when mapped here
        self.copier: BlockCopier | None = None  # CUDA: the copies into `mapped`, set up once
        self.transfers: dict[str, OutboundTransfer] = {}
        self.accepts: dict[str, asyncio.Future[Accepted | Rejected]] = {}
        self.lost = False
        self.torn_down = False  # _on_lost ran (it runs once per link)


class SendCarrier(Protocol):
    async def connect(self, link: PeerLink, welcome: Welcome) -> None: ...
    async def send(self, link: PeerLink, transfer_seq: int, messages: list[Message],
                   src: PoolBytes, transfer: "OutboundTransfer") -> None: ...
    async def send_staged(self, link: PeerLink, tag: int, staged: torch.Tensor) -> None:
        """Send one packed message; returns once `staged` may be reused."""
    reuses_staging: bool  # False: each packed message needs its own buffer (TCP)
    def disconnect(self, link: PeerLink) -> None: ...
    async def close(self) -> None: ...


class SenderSide(Protocol):
    """What a transfer needs of its TransferSender."""

    carrier: SendCarrier
    src: PoolBytes
    abort_timeout_s: float
    def own(self, coro: Coroutine[object, object, None]) -> None: ...
    async def send_packed(self, transfer: "OutboundTransfer", m: PackedMessage) -> None: ...
    def drop_link(self, link: PeerLink, reason: str) -> None: ...


class OutboundTransfer:
    def __init__(self, sender: SenderSide, link: PeerLink, plan: TransferPlan | PackedPlan,
                 transfer_seq: int, deadline: float, copy: MappedCopy | None = None) -> None:
        self.spec = plan.spec
        self.plan = plan
        self.transfer_seq = transfer_seq
        self.deadline = deadline
        self.state = TransferState.IN_FLIGHT
        self.stopped = False  # checked by the carrier before posting each message
        self._sender, self._link = sender, link
        self.link = link
        self.src_index: Any = None  # packed: the source block ids as a device tensor
        self._copy = copy  # mapped: the copies into the receiver's pool
        self._sent_layers: set[int] = set()
        self._copied_layers: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._outcome: KVTransferError | None = None
        self._terminal = asyncio.Event()
        self._next_group = 0  # packed: the next layer group the pump sends
        self._pump: asyncio.Task[None] | None = None
        self._gated = False  # copies queued behind layer events (send_layers_after)
        self._timer = asyncio.get_running_loop().call_at(
            deadline, self.fail, TransferTimeout(
                f"transfer {self.spec.request_id}: not confirmed by the deadline"))

    @property
    def mapped(self) -> bool:
        return self._copy is not None

    @property
    def sends_after_events(self) -> bool:
        """True when `send_layers_after` can queue this transfer behind layer events."""
        return self._copy is not None and self._copy.on_cuda

    def send_layers_after(self, layer_events: Sequence[torch.cuda.Event]) -> None:
        """Hand over every layer at once, each copied once its event completed."""
        if not self.sends_after_events:
            raise ValueError(f"transfer {self.spec.request_id}: not a mapped CUDA transfer")
        if self._sent_layers:
            raise ValueError(f"transfer {self.spec.request_id}: layers already sent")
        self._sent_layers.update(self.spec.layers)
        if self.state is not TransferState.IN_FLIGHT:
            return  # the failure is reported by finish()
        self._gated = True
        self._pump = asyncio.get_running_loop().create_task(self._run_gated(layer_events))
        self._tasks.add(self._pump)
        self._pump.add_done_callback(self._send_done)

    async def _run_gated(self, layer_events: Sequence[torch.cuda.Event]) -> None:
        assert self._copy is not None
        try:
            await self._copy.copy_after(self.spec.layers, layer_events)
            log.debug("transfer %s: gated copies done at %.6f", self.spec.request_id,
                      time.perf_counter())
            self._copied_layers.update(self.spec.layers)
            if not self.stopped:
                self._written()
        finally:
            self._pump = None

    def send_layer(self, layer: int) -> None:
        if layer in self._sent_layers:
            raise ValueError(f"transfer {self.spec.request_id}: layer {layer} sent twice")
        if layer not in self.spec.layers:
            raise ValueError(f"transfer {self.spec.request_id}: layer {layer} not in "
                             f"{self.spec.layers}")
        if isinstance(self.plan, PackedPlan) or self._copy is not None:
            self._sent_layers.add(layer)
            if self.state is TransferState.IN_FLIGHT and self._pump is None and (
                    self._copy is not None or self._group_ready(self._next_group)):
                pump = self._run_copies() if self._copy is not None else self._run_pump()
                self._pump = asyncio.get_running_loop().create_task(pump)
                self._tasks.add(self._pump)
                self._pump.add_done_callback(self._send_done)
            return
        messages = self.plan.layer_messages(layer)
        self._sent_layers.add(layer)
        if self.state is not TransferState.IN_FLIGHT:
            return  # the failure is reported by finish()
        task = asyncio.get_running_loop().create_task(self._sender.carrier.send(
            self._link, self.transfer_seq, messages, self._sender.src, self))
        self._tasks.add(task)
        task.add_done_callback(self._send_done)

    def _group_ready(self, group: int) -> bool:
        plan = self.plan
        assert isinstance(plan, PackedPlan)  # only packed transfers have groups
        return group < len(plan.groups) and all(
            layer in self._sent_layers for layer in plan.group_layers(group))

    async def _run_pump(self) -> None:
        """Send ready layer groups in order; exits when the next group is not ready yet."""
        try:
            plan = self.plan
            assert isinstance(plan, PackedPlan)
            while not self.stopped and self._group_ready(self._next_group):
                for m in plan.group_messages(self._next_group):
                    if self.stopped:
                        return
                    await self._sender.send_packed(self, m)
                self._next_group += 1
        finally:
            self._pump = None

    async def _run_copies(self) -> None:
        """Copy the layers handed over (as contiguous ranges), wait for each copy to finish;
        once every layer is copied, tell the receiver (Written). Exits when none is left."""
        assert self._copy is not None
        try:
            while not self.stopped and (todo := sorted(self._sent_layers -
                                                        self._copied_layers)):
                for layers in _ranges(todo):
                    await self._copy.copy(layers)
                    self._copied_layers.update(layers)
                    if self.stopped:
                        return
            if len(self._copied_layers) == len(self.spec.layers) and not self.stopped:
                self._written()
        finally:
            self._pump = None

    def _written(self) -> None:
        conn = self._link.conn
        if conn is None or self._link.lost:
            raise PeerLost("the receiver's link is gone")
        conn.send_message(Written(request_id=self.spec.request_id))

    def _send_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(PeerLost(f"transfer {self.spec.request_id}: send failed: "
                               f"{task.exception()!r}"))

    async def finish(self) -> None:
        if len(self._sent_layers) != len(self.spec.layers) and not self.state.is_terminal:
            await self.cancel("finish() before every layer was sent")
            raise ValueError(f"transfer {self.spec.request_id}: layers "
                             f"{sorted(set(self.spec.layers) - self._sent_layers)} not sent")
        await self._terminal.wait()  # the deadline timer bounds this wait
        if self._outcome is not None:
            raise self._outcome

    async def cancel(self, reason: str) -> None:
        self.fail(TransferCancelled(f"transfer {self.spec.request_id} cancelled by sender: "
                                    f"{reason}"))
        await self._terminal.wait()

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    # -- driven by the sender ----------------------------------------------------------------
    def landed(self) -> None:
        if self.state is TransferState.IN_FLIGHT:
            self.state = TransferState.DONE
            self._timer.cancel()  # else the loop holds this transfer until the deadline
            self._settle(None)

    def fail(self, error: KVTransferError, peer_aborted: bool = False) -> None:
        """Stop, drain, tell the receiver (unless its link is gone), then wake finish()."""
        if self.state.is_terminal:
            return
        self.state = (TransferState.CANCELLED if isinstance(error, TransferCancelled)
                      else TransferState.FAILED)
        self.stopped = True
        self._outcome = error
        self._timer.cancel()
        self._sender.own(self._drain_and_abort(str(error)))

    def link_lost(self, error: PeerLost) -> None:
        for task in self._tasks:
            task.cancel()  # sends to a dead peer may never complete
        if not self.state.is_terminal:
            self.state, self.stopped, self._outcome = TransferState.FAILED, True, error
            self._timer.cancel()
        self._settle(self._outcome)

    async def _drain_and_abort(self, reason: str) -> None:
        if self._tasks:
            # Gated copies end when the prompt's step does (the GPU bounds the wait).
            timeout = None if self._gated else self._sender.abort_timeout_s
            _, pending = await asyncio.wait(self._tasks, timeout=timeout)
            if pending:
                log.warning("transfer %s: sends did not drain; closing the link",
                            self.spec.request_id)
                self._sender.drop_link(self._link, "sends did not drain")
        if self._link.conn is not None and not self._link.lost:
            self._link.conn.send_message(Abort(request_id=self.spec.request_id, reason=reason))
        self._settle(self._outcome)

    def _settle(self, outcome: KVTransferError | None) -> None:
        self._outcome = outcome
        self._link.transfers.pop(self.spec.request_id, None)
        self._terminal.set()


def _ranges(layers: list[int]) -> list[range]:
    """Sorted layers as maximal ranges of consecutive ones: [0, 1, 2, 5] -> [0:3, 5:6]."""
    out: list[range] = []
    for layer in layers:
        if out and out[-1].stop == layer:
            out[-1] = range(out[-1].start, layer + 1)
        else:
            out.append(range(layer, layer + 1))
    return out
