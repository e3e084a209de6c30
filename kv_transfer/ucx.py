"""UCX data plane on ucxx: tagged zero-copy sends between the two KV pools.

Choices (measured on a 2-core host; see docs/kv_transfer.md):
  * Endpoints are built from the receiver's published *worker address* (sent in Welcome),
    not through a UCX listener: listener endpoints always enable error handling, which
    the shared-memory transports (cma, posix, sysv) and cuda_ipc do not support, so they
    would run over TCP. `error_handling=True` trades that speed for UCX-reported peer
    failures (UCX over TCP).
  * Transports come from `transports` (UCX_TLS syntax, e.g. "cma,posix,sysv,self,tcp" or
    "cuda_ipc,cuda_copy,cma,posix,sysv,self,tcp"), default: UCX's own choice.
  * Progress mode "blocking" (epoll fd on the event loop): about twice the throughput of
    ucxx's default progress thread on 2 cores.
  * The pool is never copied: every message is a view of the flat pool (numpy on CPU, a
    uint8 tensor exposing __cuda_array_interface__ on CUDA). ucxx has no explicit memory
    registration API; UCX's registration cache maps the pool's pages on first use and
    keeps them, since the pool never moves (so no per-transfer registration).
  * Tags: transfer_seq (assigned by the receiver, unique in its worker) << 20 | message
    index: concurrent transfers, from any number of senders, cannot collide.

Receiver side: all receives of a transfer are posted before Accepted is sent. ucxx cannot
cancel one receive, so `flush()` completes the not-yet-matched ones with zero-byte sends
to our own worker (a zero-byte message writes nothing) and drains any such message left
unmatched; after flush no receive of the transfer is posted, so no byte can land.

Peer death: without endpoint error handling UCX does not report a dead peer, and a peer
killed *during* a cma copy makes UCX abort the copying process (the receiver with the
default get-based rendezvous). The control connection (framing.py) reports a dead peer
at once; deadlines cover the rest. Invariants: `_requests` holds exactly the posted,
unflushed receives; every watcher task is in `_watchers` and cancelled by flush/close.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import ucxx
from ucxx._lib.arr import Array
from ucxx._lib.libucxx import UCXAddress
from ucxx._lib_async import application_context
from ucxx.types import Tag

from kv_transfer.inbound import InboundTransfer
from kv_transfer.layout import Message, tag_for
from kv_transfer.sender import OutboundTransfer, PeerLink

log = logging.getLogger(__name__)

_EMPTY = np.empty(0, dtype=np.uint8)


class UcxWorker:
    """This process's UCX context and worker (one per event loop; ucxx allows no more)."""

    def __init__(self, *, transports: str | None = None, progress_mode: str = "blocking",
                 error_handling: bool = False, flush_timeout_s: float = 2.0) -> None:
        loop = asyncio.get_running_loop()
        if loop in application_context.ProgressTasks:
            raise RuntimeError("a UCX worker already runs on this event loop; share it")
        options = {"TLS": transports} if transports else {}
        self.ctx = application_context.ApplicationContext(options, progress_mode=progress_mode)
        self.error_handling = error_handling
        self.flush_timeout_s = flush_timeout_s
        self.address_bytes: bytes = self.ctx.worker_address.tobytes()
        self._loopback: Any = None
        log.info("UCX worker up (ucx %s, progress %s, transports %s)",
                 ucxx.__ucx_version__, progress_mode, transports or "UCX default")

    async def loopback(self) -> Any:
        """An endpoint to our own worker, for the zero-byte sends of flush()."""
        if self._loopback is None:
            self._loopback = await self.ctx.create_endpoint_from_worker_address(
                self.ctx.worker_address, endpoint_error_handling=False)
        return self._loopback

    async def endpoint_to(self, address: bytes) -> Any:
        return await self.ctx.create_endpoint_from_worker_address(
            UCXAddress.create_from_buffer(address),
            endpoint_error_handling=self.error_handling)

    def close(self) -> None:
        if self._loopback is not None:
            self._loopback.abort(period=10**8)
            self._loopback = None


class UcxReceivePlane:
    def __init__(self, worker: UcxWorker, dst: Any) -> None:
        self._worker = worker
        self._dst = dst
        self._requests: dict[int, list[tuple[int, Any]]] = {}
        self._watchers: dict[int, asyncio.Task[None]] = {}

    def ucx_address(self) -> bytes | None:
        return self._worker.address_bytes

    def post(self, transfer: InboundTransfer, on_landed, on_failed) -> None:
        seq, worker = transfer.transfer_seq, self._worker.ctx.worker
        requests = []
        for m in transfer.plan.all_messages():
            tag = tag_for(seq, m.index)
            view = self._dst[m.dst_offset_bytes:m.dst_offset_bytes + m.num_bytes]
            requests.append((tag, worker.tag_recv(Array(view), Tag(tag))))
        self._requests[seq] = requests
        self._watchers[seq] = asyncio.get_running_loop().create_task(
            self._watch(transfer, requests, on_landed, on_failed))

    async def _watch(self, transfer: InboundTransfer, requests, on_landed, on_failed) -> None:
        try:
            for _, request in requests:
                await request.wait()
                on_landed(transfer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a UCX error on a receive (peer failure with EH)
            on_failed(transfer, exc)
        else:
            self._requests.pop(transfer.transfer_seq, None)
        finally:
            if self._watchers.get(transfer.transfer_seq) is asyncio.current_task():
                del self._watchers[transfer.transfer_seq]

    def dest_for(self, tag: int) -> memoryview | None:
        return None  # data never arrives on the control connection

    def data_landed(self, tag: int) -> None:
        return None

    async def flush(self, transfer: InboundTransfer) -> None:
        seq = transfer.transfer_seq
        watcher = self._watchers.pop(seq, None)
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        requests = self._requests.pop(seq, [])
        pending = [(tag, r) for tag, r in requests if not r.completed]
        if not pending:
            return
        loopback = await self._worker.loopback()
        for tag, _ in pending:
            await loopback.send(_EMPTY, tag=tag, force_tag=True)
        done, _ = await asyncio.wait([asyncio.ensure_future(r.wait()) for _, r in pending],
                                     timeout=self._worker.flush_timeout_s)
        for future in done:
            future.exception()  # a receive that failed is just as finished
        if len(done) != len(pending):
            log.error("transfer %s: %d receives did not complete after flush",
                      transfer.request_id, len(pending) - len(done))
        # A zero-byte message whose receive was matched by the real one stays unexpected.
        worker = self._worker.ctx.worker
        for tag, _ in pending:
            probe = worker.tag_probe(Tag(tag), remove=True)
            if probe.matched:
                await worker.tag_recv_with_handle(Array(_EMPTY), probe).wait()

    @property
    def num_posted(self) -> int:
        return sum(len(r) for r in self._requests.values())

    async def close(self) -> None:
        for watcher in self._watchers.values():
            watcher.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        self._watchers.clear()
        self._worker.close()


class UcxSendPlane:
    def __init__(self, worker: UcxWorker) -> None:
        self._worker = worker
        self.num_endpoints = 0

    async def connect(self, link: PeerLink, welcome: Any) -> None:
        if welcome.ucx_address is None:
            raise ValueError(f"KV receiver {link.address} has no UCX worker address "
                             "(it runs the TCP backend)")
        # One endpoint per link, i.e. per peer and epoch: a restarted receiver has a new
        # control connection and worker address, hence a new endpoint.
        link.data = await self._worker.endpoint_to(welcome.ucx_address)
        self.num_endpoints += 1

    async def send(self, link: PeerLink, transfer_seq: int, messages: list[Message],
                   src: Any, transfer: OutboundTransfer) -> None:
        endpoint = link.data
        sends = [endpoint.send(src[m.src_offset_bytes:m.src_offset_bytes + m.num_bytes],
                               tag=tag_for(transfer_seq, m.index), force_tag=True)
                 for m in messages if not transfer.stopped]
        await asyncio.gather(*sends)

    def disconnect(self, link: PeerLink) -> None:
        if link.data is not None:
            # Short period: a dead peer never acknowledges the close.
            link.data.abort(period=10**8)
            link.data = None
            self.num_endpoints -= 1

    async def close(self) -> None:
        self._worker.close()
