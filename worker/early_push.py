"""A KV push a prefill worker started mid-step, from a KVReady (see worker.py's doc)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from protocol.messages import Message

log = logging.getLogger(__name__)


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
