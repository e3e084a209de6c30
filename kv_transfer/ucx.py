"""UCX carrier on ucxx: tagged zero-copy sends between the two KV pools.

Choices (measured on a 2-core host; see docs/kv_transfer.md):
  * Endpoints are built from the receiver's published *worker address* (sent in Welcome),
    not through a UCX listener: listener endpoints always enable error handling, which
    the shared-memory transports (cma, posix, sysv) and cuda_ipc do not support, so they
    would run over TCP. `error_handling=True` trades that speed for UCX-reported peer
    failures (UCX over TCP).
  * Transports come from `transports` (UCX_TLS syntax, e.g. "cma,posix,sysv,self,tcp" or
    "cuda_ipc,cuda_copy,cma,posix,sysv,self,tcp"), default: UCX's own choice.
  * Progress on the event loop, asleep on the worker's epoll fd when idle
    (ucx_progress.py, which also says why not ucxx's own "blocking" mode): about twice the
    throughput of ucxx's default progress thread on 2 cores, and no CPU while idle.
  * Packed transfers (packing.py) go through staging slots: the receiver keeps
    PACKED_WINDOW receives posted in message order and scatters each one as it lands.
  * Per-run transfers never copy the pool: every message is a view of the flat pool (numpy on CPU, a
    uint8 tensor exposing __cuda_array_interface__ on CUDA). ucxx has no explicit memory
    registration API; UCX's registration cache maps the pool's pages on first use and
    keeps them, since the pool never moves (so no per-transfer registration).
  * Tags: transfer_seq (assigned by the receiver, unique in its worker) << 20 | message
    index: concurrent transfers, from any number of senders, cannot collide.

Receiver side: all receives of a transfer are posted in the callback that sends Accepted
(right after it: a send that arrives first waits in UCX's unexpected queue). ucxx cannot
cancel one receive, so `flush()` completes the not-yet-matched ones with zero-byte sends
to our own worker (a zero-byte message writes nothing) and drains any such message left
unmatched; after flush no receive of the transfer is posted, so no byte can land.

Peer death: without endpoint error handling UCX does not report a dead peer, and a peer
killed *during* a cma copy makes UCX abort the copying process (the receiver with the
default get-based rendezvous). The control connection (framing.py) reports a dead peer
at once; deadlines cover the rest.

Lifecycle of a transfer on the receive carrier: post() (receives posted, a watcher task
started) → each receive completes (packed: scattered, its slot released) → the last one:
forgotten; or flush() (a failure): the watcher cancelled, unmatched receives completed
with zero-byte self-sends within `flush_timeout_s`, slots released.

Invariants (`UcxReceiveCarrier.check_invariants`): `_requests` holds exactly the posted,
unflushed receives (and, packed, their staging slots, released exactly once: by the
watcher after a scatter or by flush, so the slots held are exactly those of posted
receives); every watcher task is in `_watchers` until it ends, and belongs to a transfer
with posted receives. Send carrier: one endpoint per connected link (`num_endpoints`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import numpy as np
import torch
import ucxx
from ucxx._lib.arr import Array
from ucxx._lib.libucxx import UCXAddress
from ucxx._lib_async import application_context
from ucxx._lib_async.endpoint import Endpoint
from ucxx.types import Tag

from kv_transfer.inbound import InboundTransfer, OnFailed, OnLanded
from kv_transfer.interface import TransferState
from kv_transfer.layout import Message, PoolBytes, pool_bytes, tag_for
from kv_transfer.messages import Welcome
from kv_transfer.outbound import OutboundTransfer, PeerLink
from kv_transfer.packing import PackedPlan, block_index, scatter, wait_device
from kv_transfer.staging import StagingPool
from kv_transfer.ucx_progress import BlockingProgress

log = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)
# Receives a packed transfer keeps posted: one lands while the next is on the wire.
PACKED_WINDOW = 2
# A posted receive: (tag, the ucxx request, staging slot id or None). ucxx is untyped.
PostedReceive = tuple[int, Any, int | None]


class UcxWorker:
    """This process's UCX context and worker (one per event loop; ucxx allows no more)."""

    def __init__(self, *, transports: str | None = None, error_handling: bool = False,
                 flush_timeout_s: float = 2.0, net_devices: str | None = None) -> None:
        """`net_devices` (UCX_NET_DEVICES syntax, e.g. "lo" or "eth0"): the only network
        interfaces UCX may open sockets on; default: UCX's choice (every interface)."""
        loop = asyncio.get_running_loop()
        if loop in application_context.ProgressTasks:
            raise RuntimeError("a UCX worker already runs on this event loop; share it")
        options = {"TLS": transports} if transports else {}
        if net_devices:
            options["NET_DEVICES"] = net_devices
        # ucxx's import sets UCX_MEMTYPE_CACHE after libucx has loaded and read its global
        # options: too late to take effect, so each new context warns that the variable is
        # unused. A value set before the process started was read at load; dropping it here
        # changes nothing for this process either way.
        os.environ.pop("UCX_MEMTYPE_CACHE", None)
        # Claim the loop first, so the context starts no progress of its own; ours follows.
        application_context.ProgressTasks[loop] = None
        try:
            # "blocking": the context itself progresses after creating an endpoint.
            self.ctx = application_context.ApplicationContext(options, progress_mode="blocking")
        except BaseException:
            application_context.ProgressTasks.pop(loop, None)
            raise
        self.progress = BlockingProgress(self.ctx.worker, loop)
        application_context.ProgressTasks[loop] = self.progress
        self.error_handling = error_handling
        self.flush_timeout_s = flush_timeout_s
        self.address_bytes: bytes = self.ctx.worker_address.tobytes()
        self._loopback: Endpoint | None = None
        self._num_carriers = 0
        log.info("UCX worker up (ucx %s, transports %s)", ucxx.__ucx_version__,
                 transports or "UCX default")

    async def loopback(self) -> Endpoint:
        """An endpoint to our own worker, for the zero-byte sends of flush()."""
        if self._loopback is None:
            self._loopback = await self.ctx.create_endpoint_from_worker_address(
                self.ctx.worker_address, endpoint_error_handling=False)
        return self._loopback

    async def endpoint_to(self, address: bytes) -> Endpoint:
        return await self.ctx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(address),
            endpoint_error_handling=self.error_handling)

    def attach(self) -> None:
        """A carrier starts using this worker (a process that sends and receives shares one)."""
        self._num_carriers += 1

    def detach(self) -> None:
        """A carrier is done with this worker; the last one to leave closes it."""
        self._num_carriers -= 1
        if self._num_carriers <= 0:
            self.close()

    def close(self) -> None:
        """Stops progress and drops the loopback endpoint (idempotent)."""
        if self._loopback is not None:
            self._loopback.abort(period=10**8)
            self._loopback = None
        self.progress.stop()


class UcxReceiveCarrier:
    def __init__(self, worker: UcxWorker, kv: torch.Tensor, staging: StagingPool) -> None:
        self._worker = worker
        worker.attach()
        self._kv = kv
        self._dst = pool_bytes(kv)
        self._staging = staging
        # seq -> posted, unflushed receives: (tag, request, staging slot id or None)
        self._requests: dict[int, list[PostedReceive]] = {}
        self._watchers: dict[int, asyncio.Task[None]] = {}

    def ucx_address(self) -> bytes | None:
        return self._worker.address_bytes

    def post(self, transfer: InboundTransfer, on_landed: OnLanded, on_failed: OnFailed) -> None:
        seq, worker = transfer.seq, self._worker.ctx.worker
        # Listed before the first post: should a post raise, those before it are flushed.
        requests: list[PostedReceive] = []
        self._requests[seq] = requests
        if not isinstance(transfer.accepted_plan, PackedPlan):
            first_tag = tag_for(seq, 0)  # a plan's indices are < MAX_MESSAGES: tag = first | i
            for m in transfer.accepted_plan.all_messages():
                tag = first_tag | m.index
                view = self._dst[m.dst_offset_bytes:m.dst_offset_bytes + m.num_bytes]
                requests.append((tag, worker.tag_recv(Array(view), Tag(tag)), None))
        self._worker.progress.kick()
        packed = isinstance(transfer.accepted_plan, PackedPlan)
        watch = self._watch_packed if packed else self._watch
        self._watchers[seq] = asyncio.get_running_loop().create_task(
            watch(transfer, requests, on_landed, on_failed))

    async def _watch(self, transfer: InboundTransfer, requests: list[PostedReceive],
                     on_landed: OnLanded, on_failed: OnFailed) -> None:
        try:
            for _, request, _ in requests:
                if not request.completed:  # most have landed by the time one is awaited
                    await request.wait()
                request.check_error()
                on_landed(transfer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a UCX error on a receive (peer failure with EH)
            on_failed(transfer, exc)
        else:
            self._requests.pop(transfer.seq, None)
        finally:
            if self._watchers.get(transfer.seq) is asyncio.current_task():
                del self._watchers[transfer.seq]

    async def _watch_packed(self, transfer: InboundTransfer, posted: list[PostedReceive],
                            on_landed: OnLanded, on_failed: OnFailed) -> None:
        """Keep PACKED_WINDOW receives posted, in message order; scatter each as it lands.

        After a failure began it keeps receiving (and discards): the sender drains its
        in-flight sends before answering the Abort, and a rendezvous send completes only
        once we match it. flush() ends this task.
        """
        plan, seq = transfer.accepted_plan, transfer.seq
        messages = plan.all_messages()
        dst_index = block_index(plan.spec.dst_block_ids, self._kv.device)
        buffers: dict[int, tuple[Any, Any]] = {}  # tag -> (staging tensor, message)
        next_post = 0
        try:
            while posted or next_post < len(messages):
                while next_post < len(messages) and len(posted) < PACKED_WINDOW:
                    m = messages[next_post]
                    slot_id, staged = self._staging_for(m.num_bytes)
                    tag = tag_for(seq, m.index)
                    buffer = staged if staged.is_cuda else staged.numpy()
                    posted.append((tag, self._worker.ctx.worker.tag_recv(
                        Array(buffer), Tag(tag)), slot_id))
                    buffers[tag] = (staged, m)
                    next_post += 1
                self._worker.progress.kick()
                tag, request, slot_id = posted[0]
                await request.wait()
                posted.pop(0)
                staged, m = buffers.pop(tag)
                try:
                    if transfer.state is TransferState.IN_FLIGHT:
                        scatter(self._kv, m, dst_index, staged)
                        wait_device(self._kv)  # before the slot is reused or Landed sent
                finally:
                    if slot_id is not None:
                        self._staging.release(slot_id)
                on_landed(transfer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            on_failed(transfer, exc)
        else:
            self._requests.pop(seq, None)
        finally:
            if self._watchers.get(seq) is asyncio.current_task():
                del self._watchers[seq]

    def _staging_for(self, num_bytes: int) -> tuple[int | None, torch.Tensor]:
        """A pool slot, or (pool exhausted or too small) a buffer of its own: the receiver
        never waits for staging, so a sender holding a slot for us always gets matched."""
        if num_bytes <= self._staging.slot_bytes:
            slot_id = self._staging.try_acquire()
            if slot_id is not None:
                return slot_id, self._staging.slot(slot_id)[:num_bytes]
        return None, torch.empty(num_bytes, dtype=torch.uint8, device=self._kv.device)

    def dest_for(self, tag: int) -> memoryview | None:
        return None  # data never arrives on the control connection

    def data_landed(self, tag: int) -> None:
        return None

    async def flush(self, transfer: InboundTransfer) -> None:
        seq = transfer.seq
        watcher = self._watchers.pop(seq, None)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        requests = self._requests.pop(seq, [])
        pending = [(tag, r) for tag, r, _ in requests if not r.completed]
        if pending:
            await self._complete(transfer, pending)
        for _, _, slot_id in requests:  # no receive into these slots is posted any more
            if slot_id is not None:
                self._staging.release(slot_id)

    async def _complete(self, transfer: InboundTransfer, pending: list[tuple[int, Any]]) -> None:
        """Complete unmatched receives with zero-byte messages from ourselves, all within
        `flush_timeout_s` (a wait that outlives it is cancelled and logged)."""
        timeout_s = self._worker.flush_timeout_s
        waits = [asyncio.ensure_future(r.wait()) for _, r in pending]
        try:
            async with asyncio.timeout(timeout_s):
                loopback = await self._worker.loopback()
                for tag, _ in pending:
                    await loopback.send(_EMPTY, tag=tag, force_tag=True)
                for wait in waits:
                    try:
                        await wait
                    except Exception:  # noqa: BLE001 - a failed receive is just as finished
                        pass
                # A zero-byte message whose receive was matched by the real one stays
                # unexpected: take it out of the worker's queue.
                worker = self._worker.ctx.worker
                for tag, _ in pending:
                    probe = worker.tag_probe(Tag(tag), remove=True)
                    if probe.matched:
                        await worker.tag_recv_with_handle(Array(_EMPTY), probe).wait()
        except TimeoutError:
            log.error("transfer %s: %d receives still posted %.1f s into the flush",
                      transfer.request_id, sum(not w.done() for w in waits), timeout_s)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    @property
    def num_posted(self) -> int:
        return sum(len(r) for r in self._requests.values())

    def check_invariants(self) -> None:
        for seq, watcher in self._watchers.items():
            assert seq in self._requests, f"watcher of transfer {seq} without receives"
            assert not watcher.done(), f"watcher of transfer {seq} ended but is listed"
        held = sum(1 for posted in self._requests.values() for _, _, slot_id in posted
                   if slot_id is not None)
        assert held == self._staging.num_acquired, \
            f"{self._staging.num_acquired} staging slots held, {held} by posted receives"

    async def close(self) -> None:
        for watcher in self._watchers.values():
            watcher.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        self._watchers.clear()
        self._worker.detach()


class UcxSendCarrier:
    def __init__(self, worker: UcxWorker) -> None:
        self._worker = worker
        worker.attach()
        self.num_endpoints = 0

    async def connect(self, link: PeerLink, welcome: Welcome) -> None:
        if welcome.ucx_address is None:
            raise ValueError(f"KV receiver {link.address} has no UCX worker address "
                             "(it runs the TCP backend)")
        # One endpoint per link, i.e. per peer and epoch: a restarted receiver has a new
        # control connection and worker address, hence a new endpoint.
        link.data = await self._worker.endpoint_to(welcome.ucx_address)
        self.num_endpoints += 1

    reuses_staging = True  # send_staged returns only once UCX is done with the buffer

    async def send(self, link: PeerLink, transfer_seq: int, messages: list[Message],
                   src: PoolBytes, transfer: OutboundTransfer) -> None:
        # Post every send of the layer first (no coroutine per message: ~10 us each in
        # Python), then wait for them in order; UCX progresses them all meanwhile.
        endpoint = link.data._ep
        requests = []
        first_tag = tag_for(transfer_seq, 0)  # a plan's indices are < MAX_MESSAGES
        for m in messages:
            if transfer.stopped:
                break
            view = src[m.src_offset_bytes:m.src_offset_bytes + m.num_bytes]
            requests.append(endpoint.tag_send(Array(view), Tag(first_tag | m.index)))
        self._worker.progress.kick()
        for request in requests:
            if not request.completed:
                await request.wait()
            request.check_error()

    async def send_staged(self, link: PeerLink, tag: int, staged: torch.Tensor) -> None:
        buffer = staged if staged.is_cuda else staged.numpy()
        request = link.data._ep.tag_send(Array(buffer), Tag(tag))
        self._worker.progress.kick()
        if not request.completed:
            await request.wait()
        request.check_error()

    def disconnect(self, link: PeerLink) -> None:
        if link.data is not None:
            # Short period: a dead peer never acknowledges the close.
            link.data.abort(period=10**8)
            link.data = None
            self.num_endpoints -= 1

    async def close(self) -> None:
        self._worker.detach()
