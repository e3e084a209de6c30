"""The sending side (prefill worker): cached peer links, announcements, per-layer sends.

Runs: no server; one control connection per receiver address (a `PeerLink`, cached and
reused by every transfer to that peer) plus the carrier's per-peer state (a UCX
endpoint built from the receiver's worker address; nothing for TCP, whose data frames share
the control connection).

Lifecycle of a link: connect -> Hello/Welcome (layouts checked: a mismatch raises
LayoutMismatch before any data moves) -> cached -> lost (peer closed or died: every
transfer on it fails with PeerLost, the entry and its endpoint are dropped; the next start()
connects afresh and learns the peer's new epoch and worker address).

Mapped links: when the receiver's Welcome carries a pool export and this sender may map it
(`map_pools`, same host: pool_mapping.py), the link holds the receiver's pool, every
transfer on it is announced as mapped and copied by this process (outbound.py), and no
carrier state is made for the peer. A pool that cannot be mapped is said once in the
log per peer, and the link uses the carrier.

Lifecycle of a transfer: see interface.py and outbound.py. A packed transfer (packing.py; always on CUDA,
on the host for small runs) has one ordered pump task: as layer groups complete it takes
a staging slot (bounded pool, FIFO, waits bounded by the deadline), gathers the group's
blocks into it, synchronizes the CUDA stream (UCX reads the slot on its own streams), sends
it, and releases the slot once the send completed or failed. Messages leave in index
order, the order the receiver posts its receives in. Failure on this side (deadline, cancel(), a
failed send) = stop posting sends, drain those in flight (<= abort_timeout_s), then Abort to
the receiver, which may then release its blocks. An Abort from the receiver is answered the
same way. A sender that cannot drain closes the link instead (the receiver then treats it
as a dead peer).

Invariants (check_invariants): a link in `_links` is not lost; every transfer in a link's
table is IN_FLIGHT; every task is in `_tasks` or in a transfer's task set.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.kernels.block_copy import BlockCopier
from engine.kv_storage import KVStorage
from kv_transfer.errors import (LayoutMismatch, PeerLost, TransferCancelled, TransferRejected,
                                TransferTimeout)
from kv_transfer.framing import FrameConnection
from kv_transfer.interface import TransferSpec, TransferState
from kv_transfer.layout import TransferPlan, check_layouts, pool_bytes, tag_for
from kv_transfer.mapped_copy import CopyContext, MappedCopy
from kv_transfer.messages import (PROTOCOL_VERSION, Abort, Accepted, Announce, ControlMessage,
                                  Hello, Landed, Refused, Rejected, Welcome)
from kv_transfer.outbound import OutboundTransfer, PeerLink, SendCarrier
from kv_transfer.packing import (PackedMessage, PackedPlan, PackingLimits, block_index,
                                 choose_packing, gather, wait_device)
from kv_transfer.pool_mapping import MappingUnavailable, open_pool
from kv_transfer.staging import StagingPool

log = logging.getLogger(__name__)


class TransferSender:
    def __init__(self, storage: KVStorage, carrier: SendCarrier, *, token: str = "",
                 abort_timeout_s: float = 1.0, limits: PackingLimits | None = None,
                 map_pools: bool = True) -> None:
        self.layout = storage.layout
        self.kv = storage.kv
        self.src = pool_bytes(storage.kv)
        self.limits = limits or PackingLimits.for_device(storage.kv.is_cuda)
        self.staging = StagingPool(storage.kv.device, slot_bytes=self.limits.slot_bytes,
                                   num_slots=self.limits.num_slots)
        self.carrier = carrier
        self.epoch = secrets.token_hex(8)
        self.abort_timeout_s = abort_timeout_s
        self._token = token
        self._links: dict[str, PeerLink] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.map_pools = map_pools
        self._copies: CopyContext | None = None  # made with the first mapped link
        self._unmappable: set[str] = set()  # peers whose pool we said we cannot map

    def own(self, coro: Coroutine[object, object, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def num_links(self) -> int:
        return len(self._links)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks) + sum(t.num_tasks for link in self._links.values()
                                      for t in link.transfers.values())

    async def start(self, peer_address: str, spec: TransferSpec,
                    timeout_s: float) -> OutboundTransfer:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        spec.validate(self.layout.num_layers)
        try:
            link = await asyncio.wait_for(self._link(peer_address), timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"transfer {spec.request_id}: no handshake with "
                                  f"{peer_address} within {timeout_s:.3f}s") from None
        packing = None if link.mapped is not None else choose_packing(
            self.layout, spec, slot_bytes=self.limits.slot_bytes,
            min_message_bytes=self.limits.min_message_bytes,
            pack_below_run_bytes=self.limits.pack_below_run_bytes)
        plan = (TransferPlan(self.layout, spec) if packing is None
                else PackedPlan(self.layout, spec, packing))
        rid = spec.request_id
        if rid in link.transfers or rid in link.accepts:
            raise ValueError(f"transfer {rid} to {peer_address} already started")
        reply_future: asyncio.Future[Accepted | Rejected] = loop.create_future()
        link.accepts[rid] = reply_future
        assert link.conn is not None  # a cached link is connected
        link.conn.send_message(Announce(spec=spec, packing=packing,
                                        mapped=link.mapped is not None))
        try:
            reply = await asyncio.wait_for(reply_future, max(deadline - loop.time(), 0))
        except TimeoutError:
            raise TransferTimeout(f"transfer {rid}: not accepted within {timeout_s:.3f}s") \
                from None
        finally:
            link.accepts.pop(rid, None)
        if isinstance(reply, Rejected):
            raise TransferRejected(f"transfer {rid} rejected by {peer_address}: {reply.reason}")
        copy = None
        if link.mapped is not None:
            assert self._copies is not None  # made when the link was mapped
            copy = MappedCopy(spec, self.kv, link.mapped.tensor, self._copies, link.copier)
        transfer = OutboundTransfer(self, link, plan, reply.transfer_seq, deadline, copy)
        link.transfers[rid] = transfer
        return transfer

    async def send_packed(self, transfer: OutboundTransfer, m: PackedMessage) -> None:
        """Gather message m into staging and send it; the staging is released on every path."""
        loop = asyncio.get_running_loop()
        if transfer.src_index is None:
            transfer.src_index = block_index(transfer.spec.src_block_ids, self.kv.device)
        tag = tag_for(transfer.transfer_seq, m.index)
        if not self.carrier.reuses_staging:  # TCP: the transport keeps the buffer until written
            staged = torch.empty(m.num_bytes, dtype=torch.uint8, device=self.kv.device)
            gather(self.kv, m, transfer.src_index, staged)
            wait_device(self.kv)
            await self.carrier.send_staged(transfer.link, tag, staged)
            return
        try:
            slot_id = await asyncio.wait_for(self.staging.acquire(),
                                             max(transfer.deadline - loop.time(), 0))
        except TimeoutError:
            raise TransferTimeout(f"transfer {transfer.spec.request_id}: no staging slot "
                                  "before the deadline") from None
        try:
            if m.num_bytes > self.staging.slot_bytes:
                raise ValueError(f"message of {m.num_bytes} bytes exceeds the staging slot")
            slot = self.staging.slot(slot_id)
            gather(self.kv, m, transfer.src_index, slot)
            wait_device(self.kv)
            await self.carrier.send_staged(transfer.link, tag, slot[:m.num_bytes])
        finally:
            self.staging.release(slot_id)

    async def _link(self, address: str) -> PeerLink:
        link = self._links.get(address)
        if link is not None and not link.lost:
            return link
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            link = self._links.get(address)
            if link is not None and not link.lost:
                return link
            return await self._connect(address)

    async def _connect(self, address: str) -> PeerLink:
        host, _, port = address.rpartition(":")
        link = PeerLink(address)
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: FrameConnection(lambda c, m: self._on_message(link, m),
                                        lambda c, e: self._on_lost(link, e)),
                host, int(port))
        except OSError as exc:
            raise PeerLost(f"cannot connect to KV receiver {address}: {exc}") from exc
        link.conn = conn
        try:
            conn.send_message(Hello(version=PROTOCOL_VERSION, token=self._token,
                                    layout=self.layout, epoch=self.epoch))
            reply = await link.welcome
            if isinstance(reply, Refused):
                error = LayoutMismatch if reply.layout_mismatch else TransferRejected
                raise error(f"KV receiver {address} refused us: {reply.reason}")
            check_layouts(self.layout, reply.layout, address)
            link.epoch = reply.epoch
            self._map(link, reply)
            if link.mapped is None:
                await self.carrier.connect(link, reply)
        except BaseException:
            conn.close()
            link.lost = True
            self._unmap(link)
            raise
        self._links[address] = link
        return link

    def _map(self, link: PeerLink, welcome: Welcome) -> None:
        """Map the receiver's pool into `link` when it was exported and can be mapped here."""
        if not self.map_pools or welcome.export is None:
            return
        try:
            link.mapped = open_pool(welcome.export, welcome.layout, self.kv)
        except MappingUnavailable as exc:
            if link.address not in self._unmappable:
                self._unmappable.add(link.address)
                log.info("KV receiver %s: its pool cannot be mapped here (%s); using the "
                         "carrier", link.address, exc)
            return
        if self.kv.is_cuda:
            link.copier = BlockCopier(self.kv, link.mapped.tensor)
        if self._copies is None:
            executor = (None if self.kv.is_cuda else
                        ThreadPoolExecutor(1, thread_name_prefix="kv-copy"))
            self._copies = CopyContext(self.kv.device, executor)

    def _unmap(self, link: PeerLink) -> None:
        if link.mapped is not None:
            if self._copies is not None:
                self._copies.synchronize()  # no copy may still write into the mapping
            link.copier = None  # its views would keep the mapping open
            link.mapped.close()
            link.mapped = None

    @property
    def num_mapped(self) -> int:
        return sum(1 for link in self._links.values() if link.mapped is not None)

    def _on_message(self, link: PeerLink, message: ControlMessage) -> None:
        if isinstance(message, (Welcome, Refused)):
            if not link.welcome.done():
                link.welcome.set_result(message)
        elif isinstance(message, (Accepted, Rejected)):
            future = link.accepts.get(message.request_id)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, Landed):
            transfer = link.transfers.get(message.request_id)
            if transfer is not None:
                transfer.landed()
        elif isinstance(message, Abort):
            transfer = link.transfers.get(message.request_id)
            if transfer is None and link.conn is not None:  # answer at once: it can release
                link.conn.send_message(Abort(request_id=message.request_id, reason="unknown"))
            elif transfer is not None:
                transfer.fail(TransferCancelled(f"transfer {message.request_id} aborted by "
                                                f"receiver: {message.reason}"))

    def _on_lost(self, link: PeerLink, exc: Exception | None) -> None:
        if link.torn_down:
            return
        link.lost = link.torn_down = True
        if self._links.get(link.address) is link:
            del self._links[link.address]
        if not link.welcome.done():
            link.welcome.set_exception(PeerLost(f"KV receiver {link.address} closed the "
                                                f"connection during the handshake"))
            link.welcome.exception()  # retrieved here; _connect re-raises it
        for future in link.accepts.values():
            if not future.done():
                future.set_exception(PeerLost(f"KV receiver {link.address} lost"))
        for transfer in list(link.transfers.values()):
            transfer.link_lost(PeerLost(f"transfer {transfer.spec.request_id}: receiver "
                                        f"{link.address} lost ({exc})"))
        if link.mapped is not None:
            self._unmap(link)
        else:
            self.carrier.disconnect(link)

    def drop_link(self, link: PeerLink, reason: str) -> None:
        log.warning("dropping KV link to %s: %s", link.address, reason)
        if link.conn is not None:
            link.conn.close()
        self._on_lost(link, None)

    async def close(self) -> None:
        for link in list(self._links.values()):
            self.drop_link(link, "sender closing")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.abort_timeout_s)
        await self.carrier.close()
        if self._copies is not None and self._copies.executor is not None:
            self._copies.executor.shutdown(wait=True)

    def check_invariants(self) -> None:
        for link in self._links.values():
            assert not link.lost
            for transfer in link.transfers.values():
                assert transfer.state is TransferState.IN_FLIGHT
