"""The receiving side (decode worker): a control server, expected transfers, a carrier.

Runs: one asyncio TCP server (127.0.0.1, port 0 by default) accepting sender sessions; the
carrier (tcp.py or ucx.py) lands bytes straight into the KV pool.

Lifecycle of a transfer (see interface.py): expect() -> PENDING; an Announce on a session
-> carrier.post() then Accepted -> IN_FLIGHT; the carrier reports each landed message; the last
one -> DONE, Landed sent to the sender. On deadline, cancel(), or sender Abort/death:

    begin_failure --(peer alive and not the initiator)--> Abort to sender, wait for its
    Abort back (<= abort_timeout_s; it drains its in-flight sends first) --> carrier.flush()
    (no byte can land any more) --> release(dst_block_ids) once --> waiter raises

Mapped transfers (the sender mapped this pool from the Welcome's export, pool_mapping.py;
`export_pool` off: never): Announce(mapped) -> Accepted with nothing posted on the carrier;
the sender copies the blocks itself and sends Written -> DONE, Landed. There is nothing to
flush: the sender answers an Abort only after its copies finished (outbound.py). A mapped
sender whose connection is lost may still have a GPU copy in flight for a moment while its
process is torn down, so its CUDA transfers are released `mapped_loss_grace_s` later.

A sender that does not answer an Abort within abort_timeout_s has its session closed, which
fails its other transfers with PeerLost: a peer that ignores aborts cannot be trusted to
stop writing. A dead sender is seen as its session's TCP connection closing (the kernel
closes a killed process's sockets); a silent one (host loss) by each transfer's deadline.

Invariants (check_invariants): every expected transfer is in `_expected` until settled;
`_by_seq` holds exactly the IN_FLIGHT/cleaning transfers; every task is in `_tasks`.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import secrets
from typing import Protocol

from engine.kv_storage import KVStorage
from kv_transfer.errors import KVTransferError, PeerLost, TransferCancelled, TransferTimeout
from kv_transfer.framing import FrameConnection
from kv_transfer.inbound import InboundHandle, InboundTransfer, OnFailed, OnLanded
from kv_transfer.interface import ReleaseBlocks, TransferState
from kv_transfer.layout import TransferPlan
from kv_transfer.messages import (PROTOCOL_VERSION, Abort, Accepted, Announce, ControlMessage,
                                  Hello, Landed, Refused, Rejected, Welcome, Written)
from kv_transfer.packing import PackedPlan
from kv_transfer.pool_mapping import export_pool

log = logging.getLogger(__name__)


class ReceiveCarrier(Protocol):
    """How bytes land in the pool; tcp.py and ucx.py implement it."""

    def ucx_address(self) -> bytes | None: ...
    def post(self, transfer: InboundTransfer, on_landed: OnLanded,
             on_failed: OnFailed) -> None: ...
    def dest_for(self, tag: int) -> memoryview | None: ...
    def data_landed(self, tag: int) -> None: ...
    async def flush(self, transfer: InboundTransfer) -> None: ...
    async def close(self) -> None: ...
    def check_invariants(self) -> None: ...


class TransferReceiver:
    def __init__(self, storage: KVStorage, carrier: ReceiveCarrier, *, host: str = "127.0.0.1",
                 port: int = 0, token: str = "", abort_timeout_s: float = 1.0,
                 export: bool = True, mapped_loss_grace_s: float = 0.5) -> None:
        self.storage = storage
        self.export = export
        self.mapped_loss_grace_s = mapped_loss_grace_s if storage.kv.is_cuda else 0.0
        self.layout = storage.layout
        self.carrier = carrier
        self.epoch = secrets.token_hex(8)  # changes on restart: senders rebuild endpoints
        self._host, self._port, self._token = host, port, token
        self._abort_timeout_s = abort_timeout_s
        self._server: asyncio.Server | None = None
        self._sessions: set[FrameConnection] = set()
        self._session_transfers: dict[FrameConnection, set[InboundTransfer]] = {}
        self._welcomed: set[FrameConnection] = set()
        self._expected: dict[str, InboundTransfer] = {}
        self._by_seq: dict[int, InboundTransfer] = {}
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._new_session, self._host, self._port)

    def _new_session(self) -> FrameConnection:
        conn = FrameConnection(self._on_message, self._on_lost, self.carrier.dest_for,
                               self.carrier.data_landed)
        self._sessions.add(conn)
        return conn

    @property
    def address(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    # -- the owner's API -------------------------------------------------------------------
    def expect(self, request_id: str, dst_block_ids: list[int], layers: range,
               release: ReleaseBlocks, timeout_s: float) -> InboundHandle:
        if request_id in self._expected:
            raise ValueError(f"transfer {request_id} is already expected")
        loop = asyncio.get_running_loop()
        transfer = InboundTransfer(request_id, dst_block_ids, layers, release,
                                   loop.time() + timeout_s)
        transfer.timer = loop.call_at(transfer.deadline, self.fail, transfer, TransferTimeout(
            f"transfer {request_id}: not complete within {timeout_s:.3f}s"), True)
        self._expected[request_id] = transfer
        return InboundHandle(transfer, self.cancel_transfer)

    async def cancel_transfer(self, transfer: InboundTransfer, reason: str) -> None:
        self.fail(transfer, TransferCancelled(
            f"transfer {transfer.request_id} cancelled by receiver: {reason}"), True)
        await self.settled(transfer)

    async def settled(self, transfer: InboundTransfer) -> None:
        try:
            await transfer.wait()
        except KVTransferError:
            pass

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    @property
    def num_tasks(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        for transfer in list(self._expected.values()):
            self.fail(transfer, TransferCancelled(
                f"transfer {transfer.request_id}: receiver closing"), False)
        if self._tasks:  # clean-ups: each bounded by the abort handshake and the flush
            _, late = await asyncio.wait(set(self._tasks), timeout=self._abort_timeout_s + 3.0)
            for task in late:
                log.error("KV receiver closing: a transfer clean-up outlived its deadline")
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            self._server.close()
        for session in list(self._sessions):
            session.close()
        if self._server is not None:
            await self._server.wait_closed()
        await self.carrier.close()

    # -- failure -----------------------------------------------------------------------------
    def fail(self, transfer: InboundTransfer, error: KVTransferError, notify_peer: bool) -> None:
        if not transfer.begin_failure(error):
            return
        log.info("kv transfer %s failed: %s", transfer.request_id, error)
        task = asyncio.get_running_loop().create_task(self._clean_up(transfer, notify_peer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _clean_up(self, transfer: InboundTransfer, notify_peer: bool) -> None:
        session = transfer.session
        try:
            if isinstance(session, FrameConnection) and not session.is_lost:
                if notify_peer:
                    session.send_message(Abort(request_id=transfer.request_id,
                                               reason=str(transfer._outcome)))
                    try:
                        await asyncio.wait_for(transfer.peer_drained.wait(),
                                               self._abort_timeout_s)
                    except TimeoutError:
                        log.warning("sender did not answer abort of %s; closing its session",
                                    transfer.request_id)
                        session.close()
                        self._on_lost(session, None)
            if transfer.mapped:
                if not transfer.peer_drained.is_set():  # the sender may be dying mid-copy
                    await asyncio.sleep(self.mapped_loss_grace_s)
            elif transfer.plan is not None:
                await self.carrier.flush(transfer)
        finally:
            if transfer.transfer_seq is not None:
                self._by_seq.pop(transfer.transfer_seq, None)
            if isinstance(session, FrameConnection):
                self._session_transfers.get(session, set()).discard(transfer)
            self._expected.pop(transfer.request_id, None)
            transfer.finish_failure()

    # -- control messages ------------------------------------------------------------------
    def _on_message(self, conn: FrameConnection, message: ControlMessage) -> None:
        if conn not in self._welcomed:
            return self._on_hello(conn, message)
        if isinstance(message, Announce):
            self._on_announce(conn, message)
        elif isinstance(message, Written):
            transfer = self._expected.get(message.request_id)
            if transfer is not None and transfer.session is conn and transfer.all_landed():
                self._done(transfer)
        elif isinstance(message, Abort):
            transfer = self._expected.get(message.request_id)
            if transfer is None or transfer.session is not conn:
                return
            transfer.peer_drained.set()
            self.fail(transfer, TransferCancelled(
                f"transfer {message.request_id} cancelled by sender: {message.reason}"), False)
        else:
            log.warning("unexpected %s from a sender; closing", type(message).__name__)
            conn.close()

    def _on_hello(self, conn: FrameConnection, message: ControlMessage) -> None:
        refusal = None
        if not isinstance(message, Hello) or message.version != PROTOCOL_VERSION:
            refusal = Refused(reason="expected Hello of protocol version "
                                     f"{PROTOCOL_VERSION}")
        elif not hmac.compare_digest(message.token.encode(), self._token.encode()):
            refusal = Refused(reason="bad internal token")
        elif (diff := self.layout.compatible_with(message.layout, "at this receiver",
                                                  "at the sender")) is not None:
            refusal = Refused(reason=f"KV layout differs: {diff}", layout_mismatch=True)
        if refusal is not None:
            log.warning("refusing KV sender: %s", refusal.reason)
            conn.send_message(refusal)
            conn.close()
            return
        self._welcomed.add(conn)
        self._session_transfers[conn] = set()
        conn.send_message(Welcome(layout=self.layout, epoch=self.epoch,
                                  ucx_address=self.carrier.ucx_address(),
                                  export=export_pool(self.storage) if self.export else None))

    def _on_announce(self, conn: FrameConnection, message: Announce) -> None:
        spec = message.spec
        transfer = self._expected.get(spec.request_id)
        reason = None
        if transfer is None or transfer.state is not TransferState.PENDING:
            reason = "not expected (expect() must precede the announcement)"
        elif spec.dst_block_ids != transfer.dst_block_ids or spec.layers != transfer.layers:
            reason = "destination blocks or layers differ from the expected ones"
        elif message.mapped and not self.export:
            reason = "this receiver's pool is not exported for mapped transfers"
        if reason is None:
            try:
                plan = (TransferPlan(self.layout, spec) if message.packing is None
                        else PackedPlan(self.layout, spec, message.packing))
            except ValueError as exc:
                reason = str(exc)
        if reason is not None or transfer is None:
            conn.send_message(Rejected(request_id=spec.request_id, reason=reason or "unknown"))
            return
        seq = next(self._seq)
        transfer.accept(plan, seq, conn, mapped=message.mapped)
        self._by_seq[seq] = transfer
        self._session_transfers[conn].add(transfer)
        # Accepted leaves first, then the receives are posted in the same callback: the
        # sender plans and posts its sends while this side posts its receives (a few
        # microseconds each, thousands for a long prompt), and no other callback (a flush,
        # a data frame on TCP) runs before every receive is posted. A UCX message arriving
        # before its receive waits in UCX's unexpected queue and is matched when posted,
        # as a packed transfer's receives always are (posted as slots free up).
        conn.send_message(Accepted(request_id=spec.request_id, transfer_seq=seq))
        if not message.mapped:
            try:
                self.carrier.post(transfer, self._on_landed, self._on_data_failed)
            except Exception as exc:  # noqa: BLE001 - UCX refused a receive: abort, flush
                self._on_data_failed(transfer, exc)

    def _on_landed(self, transfer: InboundTransfer) -> None:
        if transfer.message_landed():
            self._done(transfer)

    def _done(self, transfer: InboundTransfer) -> None:
        """Forget a DONE transfer and tell its sender."""
        self._by_seq.pop(transfer.seq, None)
        self._expected.pop(transfer.request_id, None)
        session = transfer.session
        if isinstance(session, FrameConnection):
            self._session_transfers.get(session, set()).discard(transfer)
            session.send_message(Landed(request_id=transfer.request_id))

    def _on_data_failed(self, transfer: InboundTransfer, exc: Exception) -> None:
        self.fail(transfer, PeerLost(f"transfer {transfer.request_id}: carrier: {exc}"),
                  True)

    def _on_lost(self, conn: FrameConnection, exc: Exception | None) -> None:
        self._sessions.discard(conn)
        self._welcomed.discard(conn)
        for transfer in list(self._session_transfers.pop(conn, ())):
            self.fail(transfer, PeerLost(
                f"transfer {transfer.request_id}: sender connection lost ({exc})"), False)

    def check_invariants(self) -> None:
        for transfer in self._expected.values():
            transfer.check_invariants()
        for seq, transfer in self._by_seq.items():
            assert transfer.transfer_seq == seq and transfer.request_id in self._expected
        assert set(self._session_transfers) <= self._welcomed
        self.carrier.check_invariants()
