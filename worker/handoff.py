"""The prefill side of the handoff: which blocks a push sends, where they go (a destination
that may follow its request), and a push started mid-step. The push itself is
worker/kv_push.py.

Which blocks (`plan_push`, pure): blocks [h, n) of the prompt, where the decode side holds
the first h already; the range is kv_transfer/layout.py's `handoff_blocks` (the diagram is
there).

Where (`FollowingDestinations`): with `destination_follows`, the gateway sends the
ReserveRequest to the decode worker and the PrefillRequest to this worker at once; the
decode worker's answer (where the KV goes) reaches here later, in a DestinationNotice,
while the prompt computes. The push waits for it; nothing else does (the first token is
sent as soon as it is sampled). Lifecycle of one request's destination:

    expect(rid) ─▶ WAITING (a future) ─ deliver(rid, d) ─▶ KNOWN (the future's result)
                                      └ forget(rid) (the prefill stream ended) ─▶ gone
    deliver(rid, d) before expect(rid) ─▶ HELD (the notice overtook its request: two
        streams, handled by two tasks) ─ expect(rid) within `hold_s` ─▶ KNOWN; else dropped

Invariants (`FollowingDestinations.check_invariants`): a request id is never both waiting
and held; at most `max_held` notices are held, each for at most `hold_s`.

When (`EarlyPush`): a push started mid-step from a KVReady (worker/prefill_half.py's
doc), before the step's output arrived.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer.interface import TransferSpec
from kv_transfer.layout import handoff_blocks
from protocol.messages import DecodeDestination, Message
from worker.recent_entries import RecentEntries

log = logging.getLogger(__name__)


def plan_push(request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              num_prefix_blocks_held: int, num_prompt_tokens: int, block_size: int,
              num_layers: int) -> TransferSpec | None:
    """The transfer for one prefilled prompt, or None when the destination holds it all.

    Raises ValueError when either side has fewer blocks than the prompt needs.
    """
    blocks = handoff_blocks(num_prompt_tokens, block_size, num_prefix_blocks_held)
    if len(src_block_ids) < blocks.stop:
        raise ValueError(f"{request_id}: prefill side holds {len(src_block_ids)} blocks, "
                         f"the prompt needs {blocks.stop}")
    if len(dst_block_ids) < blocks.stop:
        raise ValueError(f"{request_id}: destination reserved {len(dst_block_ids)} blocks, "
                         f"the prompt needs {blocks.stop}")
    if not blocks:
        return None
    return TransferSpec(request_id=request_id,
                        src_block_ids=list(src_block_ids[blocks.start:blocks.stop]),
                        dst_block_ids=list(dst_block_ids[blocks.start:blocks.stop]),
                        layer_begin=0, layer_end=num_layers)


class FollowingDestinations:
    def __init__(self, hold_s: float = 10.0, max_held: int = 4096) -> None:
        self._waiting: dict[str, asyncio.Future[DecodeDestination]] = {}
        self._held: RecentEntries[DecodeDestination] = RecentEntries(hold_s, max_held)

    def __len__(self) -> int:
        return len(self._waiting)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def expect(self, request_id: str, now: float) -> asyncio.Future[DecodeDestination]:
        """The future of `request_id`'s destination (already done if its notice came first)."""
        if request_id in self._waiting:
            raise ValueError(f"{request_id}: a destination is already expected")
        future: asyncio.Future[DecodeDestination] = asyncio.get_running_loop().create_future()
        held = self._held.pop(request_id, now)
        if held is not None:
            future.set_result(held)
        self._waiting[request_id] = future
        return future

    def deliver(self, request_id: str, destination: DecodeDestination, now: float) -> bool:
        """Hand `destination` to the prefill waiting for it (True), or hold it (False)."""
        future = self._waiting.get(request_id)
        if future is not None:
            if not future.done():
                future.set_result(destination)
            return True
        self._held.put(request_id, destination, now)
        return False

    def forget(self, request_id: str) -> None:
        """The prefill of `request_id` ended: nobody waits for its destination any more."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def check_invariants(self) -> None:
        both = [request_id for request_id in self._waiting if request_id in self._held]
        assert not both, f"waiting and held at once: {sorted(both)[:5]}"
        self._held.check_invariants()


@dataclass(slots=True)
class EarlyPush:
    """A push started mid-step from a KVReady (see the module doc)."""

    task: asyncio.Task[Message] = field(init=False)  # a TransferResult or an ErrorFrame
    layer_events: tuple[torch.cuda.Event, ...] | None = None
    written: asyncio.Event = field(default_factory=asyncio.Event)  # the step's output arrived
    written_at: float | None = None  # perf_counter() when it did
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    counted: bool = True  # a failure counts in handoff_failures (not when asked to stop)

    def stop(self, reason: str, counted: bool = True) -> None:
        if not self.stopped.is_set():
            self.reason, self.counted = reason, counted
            self.stopped.set()


def log_push_error(task: asyncio.Task[Message]) -> None:
    """An early push that raised (not a transfer failure: those return FAILED) may have
    nobody awaiting it (its request ended at its first token): say so in the log."""
    if not task.cancelled() and task.exception() is not None:
        log.error("early KV push failed", exc_info=task.exception())
