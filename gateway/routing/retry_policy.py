"""What the gateway does when a worker fails a request: pure functions over the failure.

A generation runs as one or more attempts. Each attempt is a plan (a decode worker, and a
prefill worker or not) and ends in one of three ways: finished, the client went away, or a
`LegFailed`. The failure's kind decides what follows:

    kind          what happened                                    next
    UNREACHABLE   refused, reset or cut: the process is gone      retry elsewhere; the worker is
                                                                   marked dead for every request
    STALLED       no frame within its deadline                     retry elsewhere
    BUSY          the worker said overloaded / retry later         retry elsewhere
    WORKER_ERROR  the worker failed it (engine error, transfer     retry elsewhere
                  failed, aborted by a shutdown, stale epoch)
    REFUSED       the worker refused the request itself            give up: another worker would
                                                                   refuse it too

"Retry elsewhere" is the same move before and after the first token: before it, a fresh
plan (another prefill worker, or a local prefill on a decode worker); after it, the stream
migrates: another decode worker recomputes prompt + tokens so far and continues, and the
client's stream goes on without a token lost or repeated. At most `max_attempts` attempts
per generation (default 4: the first and three more); the worker that failed is excluded
from the generation's later plans.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aiohttp import ClientError

from protocol.messages import ErrorCode
from rpc.errors import ControlError, FrameDeadlineError, RemoteError


class FailureKind(enum.Enum):
    UNREACHABLE = "unreachable"
    STALLED = "stalled"
    BUSY = "busy"
    WORKER_ERROR = "worker_error"
    REFUSED = "refused"


class Phase(enum.Enum):
    """Where in an attempt a failure happened (metrics and messages)."""

    RESERVE = "reserve"
    PREFILL = "prefill"
    TRANSFER = "transfer"
    DECODE = "decode"


class LegFailed(Exception):
    """One worker failed one attempt of a generation."""

    def __init__(self, worker_id: str, phase: Phase, kind: FailureKind, detail: str) -> None:
        super().__init__(f"{phase.value} on {worker_id}: {kind.value}: {detail}")
        self.worker_id = worker_id
        self.phase = phase
        self.kind = kind
        self.detail = detail  # for the log: may name hosts and ports, never sent to clients


_REFUSING_CODES = frozenset({ErrorCode.BAD_REQUEST, ErrorCode.PROTOCOL_VERSION,
                             ErrorCode.UNAUTHORIZED})
_BUSY_CODES = frozenset({ErrorCode.OVERLOADED, ErrorCode.WRONG_ROLE})


def failure_kind(exc: BaseException) -> FailureKind:
    """The kind of a failed worker call (see the module table)."""
    if isinstance(exc, RemoteError):
        code = exc.frame.code
        if code in _REFUSING_CODES:
            return FailureKind.REFUSED
        if code in _BUSY_CODES:
            return FailureKind.BUSY
        return FailureKind.WORKER_ERROR
    if isinstance(exc, (FrameDeadlineError, TimeoutError)):
        return FailureKind.STALLED
    if isinstance(exc, (ControlError, ClientError, OSError)):
        return FailureKind.UNREACHABLE
    raise TypeError(f"not a worker call failure: {type(exc).__name__}") from exc


@dataclass(frozen=True, slots=True)
class RetryLimits:
    max_attempts: int = 4  # the first attempt and up to three retries or migrations

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")


def should_retry(kind: FailureKind, num_attempts: int, limits: RetryLimits) -> bool:
    """After `num_attempts` attempts, the last failing with `kind`: try once more?"""
    return kind is not FailureKind.REFUSED and num_attempts < limits.max_attempts


def marks_worker_dead(kind: FailureKind) -> bool:
    """A worker that cannot be reached is dead for every request until it re-registers."""
    return kind is FailureKind.UNREACHABLE


def leg_failed(worker_id: str, phase: Phase, exc: BaseException) -> LegFailed:
    """A failed worker call as a LegFailed of its kind."""
    return LegFailed(worker_id, phase, failure_kind(exc), str(exc) or type(exc).__name__)


_PHASE_WORDS = {Phase.RESERVE: "reserving KV cache for it", Phase.PREFILL: "prefilling it",
                Phase.TRANSFER: "moving its KV cache (KV transfer failed)",
                Phase.DECODE: "generating it"}


_TRANSFER_CODES = frozenset({ErrorCode.TRANSFER_FAILED, ErrorCode.PEER_LOST})


def decode_failure(own: LegFailed, exc: BaseException, transfer_failure: LegFailed | None,
                   sender_id: str | None) -> LegFailed:
    """Which leg a failed decode stream blames (`own`: the decode worker's failure, from
    `exc`). A decode worker that is gone explains everything; else the transfer's failure,
    when the gateway saw it first; else, when the decode worker said the KV pushed into it
    failed, the prefill worker `sender_id` that pushed it (phase TRANSFER, not marked dead):
    a prefill worker that dies mid-push is often seen by its decode peer before the
    gateway's own stream from it breaks, and blaming the decode worker would exclude it
    from the migration, the one plan that needs no transfer; else the decode worker."""
    if own.kind is FailureKind.UNREACHABLE:
        return own
    if transfer_failure is not None:
        return transfer_failure
    if sender_id is not None and isinstance(exc, RemoteError) \
            and exc.frame.code in _TRANSFER_CODES:
        return LegFailed(sender_id, Phase.TRANSFER, FailureKind.WORKER_ERROR,
                         f"its decode peer {own.worker_id} said: {own.detail}")
    return own


def client_message(num_attempts: int, failure: LegFailed) -> str:
    """What the client is told: what failed and how often it was tried, no internals."""
    tries = num_attempts
    what = _PHASE_WORDS[failure.phase]
    if failure.kind is FailureKind.REFUSED:
        return f"A worker refused the request while {what}."
    reason = {FailureKind.UNREACHABLE: "a worker became unreachable",
              FailureKind.STALLED: "a worker stopped answering",
              FailureKind.BUSY: ("no decode worker had free KV cache blocks in time"
                                 if failure.phase is Phase.RESERVE
                                 else "the workers are overloaded"),
              FailureKind.WORKER_ERROR: "a worker failed"}[failure.kind]
    return (f"The request failed while {what}: {reason}, after {tries} attempt"
            f"{'s' if tries != 1 else ''}. Retry later.")


def client_code(failure: LegFailed) -> str:
    """The error `code` the client gets (and /metrics counts) for a generation that failed so."""
    if failure.kind is FailureKind.BUSY:
        return "kv_cache_full" if failure.phase is Phase.RESERVE else "workers_busy"
    return {FailureKind.REFUSED: "worker_refused", FailureKind.UNREACHABLE: "worker_unreachable",
            FailureKind.STALLED: "worker_stalled",
            FailureKind.WORKER_ERROR: "worker_error"}[failure.kind]


def retry_after_s(kind: FailureKind) -> float | None:
    """Retry-After for a generation that failed so: soon, unless it was refused."""
    return None if kind is FailureKind.REFUSED else 1.0
