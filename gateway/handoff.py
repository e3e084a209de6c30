"""One generation's upstream state, and the small rules its legs share.

`Handoff` records which workers a generation touched (each one is aborted if it does not
finish) and how its KV move went; `UpstreamTimeouts` bounds every wait of a leg. See
gateway/upstream.py for the legs themselves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from aiohttp import ClientError

from common.contract.control_client import ControlClient
from common.contract.control_errors import ControlError, RemoteError
from common.contract.finish_reason import FinishReason
from common.contract.protocol import ErrorCode, TokenFrame
from gateway.backend import BackendUnavailable

# What a failing worker call looks like from here; anything else is a bug and propagates.
UPSTREAM_FAILURES = (ControlError, ClientError, OSError, TimeoutError)


@dataclass(frozen=True, slots=True)
class UpstreamTimeouts:
    reserve_s: float = 5.0  # answer to /internal/reserve
    first_token_s: float = 120.0  # PrefillResult, or D's first frame (a long CPU prefill)
    frame_s: float = 60.0  # between two frames of a running stream
    reservation_ms: int = 120_000  # D holds the blocks this long for the KV + DecodeRequest
    request_ms: int = 600_000  # the budget sent to workers with each request
    abort_s: float = 2.0


class Handoff:
    """One generation's upstream state: which workers it touched, how the KV move went."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.legs: dict[str, ControlClient] = {}  # worker id -> client: abort these on failure
        self.transfer_error: str | None = None

    def failure_text(self, fallback: str) -> str:
        """Why the generation failed, as the client should hear it."""
        return f"KV transfer failed: {self.transfer_error}" if self.transfer_error else fallback


async def prepend(first: asyncio.Task[list[TokenFrame]],
                  rest: AsyncGenerator[list[TokenFrame], None]
                  ) -> AsyncGenerator[list[TokenFrame], None]:
    """`first`'s batch (a task already reading `rest`), then the rest of `rest`."""
    try:
        yield await first
    except StopAsyncIteration:
        return
    async for item in rest:
        yield item


def client_finish_reason(reason: FinishReason | None) -> FinishReason | None:
    """The reason a client sees: STOP or LENGTH; ABORT is reported as an error instead."""
    if reason is None or not reason.is_openai_reason:
        return None
    return reason


def unavailable(what: str, exc: BaseException) -> BackendUnavailable:
    """A failed worker call as the 503 the client sees (Retry-After when it may pass)."""
    retry = None
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, RemoteError):
        detail = exc.frame.message
        if exc.frame.code is ErrorCode.OVERLOADED or exc.frame.retryable:
            retry = 1.0
    return BackendUnavailable(f"{what}: {detail}", retry_after_s=retry)
