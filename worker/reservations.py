"""The decode worker's reservations: blocks held for a prompt whose KV a prefill worker sends.

Lifecycle of one reservation (one request id):

    reserve() ──▶ RECEIVING ──(every layer landed)──▶ LANDED ──(DecodeRequest joins)──▶ JOINED
        │              │                                 │          (the engine owns the blocks)
        │              └─ transfer failed / cancelled ───┤
        └── no DecodeRequest by the deadline, its caller's ┴──────────▶ RELEASED
            channel closed before one joined, or an abort

    A prompt whose blocks are all held already (prefix cache) starts in LANDED.

Invariants (check_invariants):
  * a request id is in `_live` iff its state is RECEIVING or LANDED;
  * `release()` returns True at most once per reservation (the engine frees its blocks
    exactly once); a JOINED reservation is never released here (its request owns them);
  * blocks are released only after the KV receiver guarantees no byte can still land
    (enforced by the caller: release only with no transfer, a DONE one, or from the
    receiver's own release callback).

The table keeps the last `max_tombstones` end reasons, so a DecodeRequest arriving after
its reservation failed gets the failure's reason instead of "unknown request".
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kv_transfer.interface import RecvHandle
from kv_transfer.layout import handoff_blocks


class ReservationState(enum.Enum):
    RECEIVING = "receiving"
    LANDED = "landed"
    JOINED = "joined"
    RELEASED = "released"


class EndReason(enum.Enum):
    TRANSFER_FAILED = "transfer_failed"
    EXPIRED = "expired"
    ABORTED = "aborted"
    SHUTDOWN = "shutdown"


@dataclass(slots=True)
class Reservation:
    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]  # the whole reservation: len(prompt) + 1 positions
    num_prefix_blocks_held: int  # leading blocks already holding this prompt's KV here
    num_receive_blocks: int  # blocks after those that the prefill side writes
    deadline: float  # loop.time(): freed if no DecodeRequest joins by then
    created_at: float = 0.0  # loop.time() when reserved (the agent reclaims old ones)
    state: ReservationState = ReservationState.RECEIVING
    handle: RecvHandle | None = None
    attached: bool = False  # a DecodeRequest is waiting on it
    end_reason: EndReason | None = None
    end_detail: str = ""
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    # Forgets the watch on the reserving caller's channel (rpc/control_app.on_caller_lost).
    forget_caller: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def receive_block_ids(self) -> list[int]:
        held = self.num_prefix_blocks_held
        return self.block_ids[held:held + self.num_receive_blocks]


def blocks_to_receive(num_prompt_tokens: int, block_size: int, num_cached_tokens: int
                      ) -> tuple[int, int]:
    """(prefix blocks held here, blocks the prefill side must send) for one prompt
    (kv_transfer/layout.py's `handoff_blocks`)."""
    blocks = handoff_blocks(num_prompt_tokens, block_size, num_cached_tokens // block_size)
    return blocks.start, len(blocks)


class ReservationTable:
    def __init__(self, max_tombstones: int = 4096) -> None:
        self.max_tombstones = max_tombstones
        self._live: dict[str, Reservation] = {}
        self._tombstones: OrderedDict[str, tuple[EndReason, str]] = OrderedDict()
        self.num_released = 0
        self.num_joined = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def get(self, request_id: str) -> Reservation | None:
        return self._live.get(request_id)

    def live(self) -> Sequence[Reservation]:
        return list(self._live.values())

    def unjoined(self, created_before: float) -> list[Reservation]:
        """Live reservations made before `created_before` that no decode request joined."""
        return [r for r in self._live.values()
                if not r.attached and r.created_at < created_before]

    def tombstone(self, request_id: str) -> tuple[EndReason, str] | None:
        return self._tombstones.get(request_id)

    def add(self, reservation: Reservation) -> None:
        if reservation.request_id in self._live:
            raise ValueError(f"request {reservation.request_id!r} already has a reservation")
        if reservation.num_receive_blocks == 0:
            reservation.state = ReservationState.LANDED
        self._tombstones.pop(reservation.request_id, None)
        self._live[reservation.request_id] = reservation

    def mark_landed(self, request_id: str) -> None:
        reservation = self._live[request_id]
        if reservation.state is ReservationState.RECEIVING:
            reservation.state = ReservationState.LANDED

    def join(self, request_id: str) -> Reservation:
        """LANDED -> JOINED: the engine's request takes over the blocks."""
        reservation = self._live[request_id]
        if reservation.state is not ReservationState.LANDED:
            raise ValueError(f"{request_id}: cannot join a {reservation.state.value} reservation")
        del self._live[request_id]
        reservation.state = ReservationState.JOINED
        self._cancel_timer(reservation)
        self.forget_caller(reservation)
        self.num_joined += 1
        return reservation

    def release(self, request_id: str, reason: EndReason, detail: str = "") -> bool:
        """End a live reservation; True exactly once (the caller then frees the blocks)."""
        reservation = self._live.pop(request_id, None)
        if reservation is None:
            return False
        reservation.state = ReservationState.RELEASED
        reservation.end_reason, reservation.end_detail = reason, detail
        self._cancel_timer(reservation)
        self.forget_caller(reservation)
        self._tombstones[request_id] = (reason, detail)
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)
        self.num_released += 1
        return True

    @staticmethod
    def forget_caller(reservation: Reservation) -> None:
        if reservation.forget_caller is not None:
            reservation.forget_caller()
            reservation.forget_caller = None

    @staticmethod
    def _cancel_timer(reservation: Reservation) -> None:
        if reservation.timer is not None:
            reservation.timer.cancel()
            reservation.timer = None

    def check_invariants(self) -> None:
        for request_id, reservation in self._live.items():
            assert reservation.request_id == request_id
            assert reservation.state in (ReservationState.RECEIVING, ReservationState.LANDED), \
                f"{request_id} is live in state {reservation.state}"
            assert reservation.num_prefix_blocks_held + reservation.num_receive_blocks \
                <= len(reservation.block_ids)
