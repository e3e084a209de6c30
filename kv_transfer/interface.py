"""What a KV transfer is, the states it moves through, and the two roles' protocols.

A transfer moves one request's KV blocks, for a range of layers, from the sender's paged
pool into the receiver's paged pool:

    TransferSpec(request_id, src_block_ids, dst_block_ids, layer_begin, layer_end)
    src_block_ids[i] (sender pool)  ->  dst_block_ids[i] (receiver pool), K and V, each layer

Lifecycle (both sides use the same states):

                 announce accepted              every block of every layer landed
    PENDING ------------------------> IN_FLIGHT ---------------------------------> DONE
       |                                  |
       |  deadline / peer lost /          |  deadline / peer lost / cancel (either side)
       |  layout mismatch / cancel        v
       +--------------------------> FAILED | CANCELLED   (terminal; the waiter raises)

  * receiver: `expect()` creates the transfer in PENDING; the sender's announcement moves it
    to IN_FLIGHT; `wait()` returns on DONE and raises a `KVTransferError` otherwise.
  * sender: `start()` returns once the receiver accepted (IN_FLIGHT); `send_layer(layer)` may
    be called as each layer finishes; `finish()` returns when the receiver confirmed DONE.

Invariants:
  * every wait has a deadline; a transfer reaches a terminal state by its deadline plus a
    bounded clean-up time (the abort handshake, see receiver.py);
  * on FAILED or CANCELLED the receiver calls the owner's `release(dst_block_ids)` exactly
    once, and only after no byte of the transfer can still land in those blocks; on DONE
    it never calls it (the owner keeps the blocks);
  * the layouts of both pools are checked before any data moves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import torch

# Called by the receiver, exactly once, with the destination blocks of a failed transfer.
ReleaseBlocks = Callable[[list[int]], None]


class TransferState(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)


class TransferSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One request's blocks and layers; sent as-is in the announcement."""

    request_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    layer_begin: int
    layer_end: int  # exclusive

    def validate(self, num_layers: int) -> None:
        """Raise ValueError when the spec cannot describe a transfer in a pool of num_layers."""
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(f"transfer {self.request_id}: {len(self.src_block_ids)} source "
                             f"blocks but {len(self.dst_block_ids)} destination blocks")
        if not self.src_block_ids:
            raise ValueError(f"transfer {self.request_id}: no blocks")
        if len(set(self.dst_block_ids)) != len(self.dst_block_ids):
            raise ValueError(f"transfer {self.request_id}: duplicate destination blocks")
        if not 0 <= self.layer_begin < self.layer_end <= num_layers:
            raise ValueError(f"transfer {self.request_id}: layers [{self.layer_begin}, "
                             f"{self.layer_end}) outside [0, {num_layers})")

    @property
    def layers(self) -> range:
        return range(self.layer_begin, self.layer_end)


class SendHandle(Protocol):
    """The sender's side of one accepted transfer."""

    @property
    def state(self) -> TransferState: ...

    @property
    def mapped(self) -> bool:
        """True when this process copies into the receiver's mapped pool (no carrier)."""

    @property
    def sends_after_events(self) -> bool:
        """True when `send_layers_after` may be used (a mapped transfer between CUDA pools)."""

    def send_layers_after(self, layer_events: Sequence[torch.cuda.Event]) -> None:
        """Hand over every layer at once: layer n moves once `layer_events[n]` completed
        (an event recorded behind the work writing it, engine/kv_ready.py), with no CPU
        wait in between; instead of `send_layer`. Raises ValueError where not
        `sends_after_events` or once a layer was sent."""

    def send_layer(self, layer: int) -> None:
        """Start moving `layer` (its K and V for every block); returns without waiting.

        Precondition: the layer's KV is written (on CUDA: its producing stream synchronized).
        Each layer of the spec is sent exactly once, in any order."""

    async def finish(self) -> None:
        """Wait until the receiver confirmed every layer landed; raises KVTransferError."""

    async def cancel(self, reason: str) -> None:
        """Stop sending, tell the receiver, and wait (bounded) until no send is in flight."""


class RecvHandle(Protocol):
    """The receiver's side of one expected transfer."""

    @property
    def state(self) -> TransferState: ...

    async def wait(self) -> None:
        """Return when every block of every layer landed; raises KVTransferError by the deadline."""

    async def cancel(self, reason: str) -> None:
        """Abort the transfer; the blocks are released (once) before this returns."""


class KVSender(Protocol):
    async def start(self, peer_address: str, spec: TransferSpec,
                    timeout_s: float) -> SendHandle:
        """Connect (or reuse the cached link), check layouts, announce; raises on refusal.

        `timeout_s` bounds the whole transfer: announcement, every send and `finish()`."""

    async def close(self) -> None: ...

    def check_invariants(self) -> None:
        """Raise AssertionError naming a broken invariant of the sender."""


class KVReceiver(Protocol):
    @property
    def address(self) -> str:
        """Where senders connect (e.g. "127.0.0.1:40123")."""

    def expect(self, request_id: str, dst_block_ids: list[int], layers: range,
               release: ReleaseBlocks, timeout_s: float) -> RecvHandle:
        """Register an expected transfer; must precede the sender's announcement."""

    async def close(self) -> None: ...

    def check_invariants(self) -> None:
        """Raise AssertionError naming a broken invariant of the receiver."""
