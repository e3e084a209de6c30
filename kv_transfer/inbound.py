"""The receiver's record of one expected transfer: state, deadline, release-exactly-once.

Lifecycle: PENDING (expect) -> IN_FLIGHT (announce accepted) -> DONE | FAILED | CANCELLED.
`begin_failure()` moves it to FAILED/CANCELLED at once (so late completions are ignored);
the owner then makes sure no byte can still land (abort handshake, carrier flush) and
calls `finish_failure()`, which releases the blocks and wakes the waiter.

Invariants (check_invariants):
  * `num_releases` is 0 while not terminal or DONE, and exactly 1 after `finish_failure`;
  * `num_landed <= num_messages`; DONE implies `num_landed == num_messages`;
  * the waiter is woken only once the state is terminal and, on failure, after release.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kv_transfer.errors import KVTransferError, TransferCancelled
from kv_transfer.interface import ReleaseBlocks, TransferState
from kv_transfer.layout import TransferPlan
from kv_transfer.packing import PackedPlan

log = logging.getLogger(__name__)


class InboundTransfer:
    def __init__(self, request_id: str, dst_block_ids: list[int], layers: range,
                 release: ReleaseBlocks, deadline: float) -> None:
        self.request_id = request_id
        self.dst_block_ids = list(dst_block_ids)
        self.layers = layers
        self.deadline = deadline  # loop.time() based
        self.state = TransferState.PENDING
        self.plan: TransferPlan | PackedPlan | None = None
        self.transfer_seq: int | None = None
        self.session: object | None = None  # the control connection it was announced on
        self.num_landed = 0
        self.num_releases = 0
        self.mapped = False  # the sender writes the blocks itself (no data messages)
        self.timer: asyncio.TimerHandle | None = None
        self.peer_drained: asyncio.Event = asyncio.Event()  # the sender's Abort arrived
        self._release = release
        self._outcome: KVTransferError | None = None
        self._terminal = asyncio.Event()

    @property
    def seq(self) -> int:
        """The receiver-assigned sequence number; a carrier asks only once accepted."""
        if self.transfer_seq is None:
            raise RuntimeError(f"transfer {self.request_id} has not been accepted")
        return self.transfer_seq

    @property
    def accepted_plan(self) -> TransferPlan | PackedPlan:
        """The plan the announcement was accepted with; only once accepted."""
        if self.plan is None:
            raise RuntimeError(f"transfer {self.request_id} has not been accepted")
        return self.plan

    @property
    def num_messages(self) -> int:
        return self.plan.num_messages if self.plan is not None else 0

    def accept(self, plan: TransferPlan | PackedPlan, transfer_seq: int, session: object,
               mapped: bool = False) -> None:
        assert self.state is TransferState.PENDING
        self.plan, self.transfer_seq, self.session = plan, transfer_seq, session
        self.mapped = mapped
        self.state = TransferState.IN_FLIGHT

    def all_landed(self) -> bool:
        """Mapped transfers: the sender says every block is written (Written); True when
        this completed the transfer."""
        if self.state is not TransferState.IN_FLIGHT or not self.mapped:
            return False
        self.num_landed = self.num_messages
        self._done()
        return True

    def message_landed(self) -> bool:
        """Count one landed message; True when this completed the transfer."""
        if self.state is not TransferState.IN_FLIGHT:
            return False  # a late completion after a failure began: ignored
        self.num_landed += 1
        if self.num_landed < self.num_messages:
            return False
        self._done()
        return True

    def _done(self) -> None:
        self.state = TransferState.DONE
        self._cancel_timer()
        self._terminal.set()

    def begin_failure(self, error: KVTransferError) -> bool:
        """Enter FAILED/CANCELLED; False when already terminal (the first failure wins)."""
        if self.state.is_terminal:
            return False
        self.state = (TransferState.CANCELLED if isinstance(error, TransferCancelled)
                      else TransferState.FAILED)
        self._outcome = error
        self._cancel_timer()
        return True

    def finish_failure(self) -> None:
        """Release the blocks (exactly once) and wake the waiter; no byte may land after."""
        assert self.state in (TransferState.FAILED, TransferState.CANCELLED)
        if self.num_releases == 0:
            self.num_releases = 1
            try:
                self._release(self.dst_block_ids)
            except Exception:  # the owner's bug must not leave the waiter hanging
                log.exception("release callback of transfer %s raised", self.request_id)
        self._terminal.set()

    async def wait(self) -> None:
        await self._terminal.wait()
        if self._outcome is not None:
            raise self._outcome

    @property
    def is_settled(self) -> bool:
        """Terminal and, on failure, released: nothing more will happen to it."""
        return self._terminal.is_set()

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def check_invariants(self) -> None:
        assert 0 <= self.num_landed <= self.num_messages or self.plan is None
        if self.state is TransferState.DONE:
            assert self.num_landed == self.num_messages and self.num_releases == 0
        if self._terminal.is_set() and self.state is not TransferState.DONE:
            assert self.num_releases == 1
        if not self.state.is_terminal:
            assert self.num_releases == 0


# Called by a receive carrier: one message of the transfer landed / its carrier failed.
OnLanded = Callable[[InboundTransfer], None]
OnFailed = Callable[[InboundTransfer, Exception], None]


class InboundHandle:
    """The receiver's handle on one expected transfer (kv_transfer.interface.RecvHandle).

    `cancel_transfer` is the owning receiver's: it fails the transfer with TransferCancelled
    and returns once no byte of it can still land (so the blocks are released)."""

    def __init__(self, transfer: InboundTransfer,
                 cancel_transfer: Callable[[InboundTransfer, str], Awaitable[None]]) -> None:
        self._transfer, self._cancel_transfer = transfer, cancel_transfer

    @property
    def state(self) -> TransferState:
        return self._transfer.state

    async def wait(self) -> None:
        await self._transfer.wait()

    async def cancel(self, reason: str) -> None:
        await self._cancel_transfer(self._transfer, reason)

