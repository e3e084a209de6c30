"""Which worker failures are retried (or migrated), and what the client is told."""

from __future__ import annotations

import pytest
from aiohttp import ClientConnectionError

from gateway.routing.retry_policy import (FailureKind, LegFailed, Phase, RetryLimits, client_code,
                                          client_message, decode_failure, failure_kind,
                                          leg_failed, marks_worker_dead, retry_after_s,
                                          should_retry)
from protocol.messages import ErrorCode, ErrorFrame
from rpc.errors import ControlError, FrameDeadlineError, RemoteError


def remote(code: ErrorCode) -> RemoteError:
    return RemoteError(ErrorFrame(request_id="r", code=code, message="worker says no"), 500)


@pytest.mark.parametrize("exc, kind", [
    (ControlError("/internal/decode: stream broken"), FailureKind.UNREACHABLE),
    (ClientConnectionError("refused"), FailureKind.UNREACHABLE),
    (ConnectionRefusedError(), FailureKind.UNREACHABLE),
    (FrameDeadlineError("no frame within 60 s"), FailureKind.STALLED),
    (TimeoutError(), FailureKind.STALLED),
    (remote(ErrorCode.OVERLOADED), FailureKind.BUSY),
    (remote(ErrorCode.INTERNAL), FailureKind.WORKER_ERROR),
    (remote(ErrorCode.TRANSFER_FAILED), FailureKind.WORKER_ERROR),
    (remote(ErrorCode.ABORTED), FailureKind.WORKER_ERROR),
    (remote(ErrorCode.STALE_EPOCH), FailureKind.WORKER_ERROR),
    (remote(ErrorCode.BAD_REQUEST), FailureKind.REFUSED),
    (remote(ErrorCode.UNAUTHORIZED), FailureKind.REFUSED),
])
def test_each_failure_has_its_kind(exc: BaseException, kind: FailureKind) -> None:
    assert failure_kind(exc) is kind
    assert leg_failed("d0", Phase.DECODE, exc).kind is kind


def test_a_bug_is_not_a_failed_call() -> None:
    with pytest.raises(TypeError):
        failure_kind(KeyError("oops"))


def test_retries_stop_at_the_limit_and_never_follow_a_refusal() -> None:
    limits = RetryLimits(max_attempts=3)
    for kind in FailureKind:
        expected = kind is not FailureKind.REFUSED
        assert should_retry(kind, 1, limits) is expected
        assert should_retry(kind, 2, limits) is expected
        assert not should_retry(kind, 3, limits)
    assert not should_retry(FailureKind.UNREACHABLE, 1, RetryLimits(max_attempts=1))
    with pytest.raises(ValueError):
        RetryLimits(max_attempts=0)


def test_only_an_unreachable_worker_is_marked_dead_for_everyone() -> None:
    assert [k for k in FailureKind if marks_worker_dead(k)] == [FailureKind.UNREACHABLE]


def test_client_messages_name_no_internals() -> None:
    failure = LegFailed("decode-0-abc123", Phase.TRANSFER, FailureKind.UNREACHABLE,
                        "http://10.1.2.3:40123/internal/decode: ClientOSError")
    message = client_message(4, failure)
    assert "transfer" in message.lower() and "4 attempts" in message
    for internal in ("decode-0", "10.1.2.3", "40123", "internal", "ClientOSError"):
        assert internal not in message
    assert retry_after_s(FailureKind.UNREACHABLE) == 1.0
    refused = LegFailed("d0", Phase.DECODE, FailureKind.REFUSED, "bad resume")
    assert "refused" in client_message(1, refused) and retry_after_s(FailureKind.REFUSED) is None


def test_a_full_kv_cache_is_named_as_the_cause() -> None:
    full = LegFailed("d0", Phase.RESERVE, FailureKind.BUSY, "KV cache full: 3 blocks needed")
    assert client_message(2, full) == (
        "The request failed while reserving KV cache for it: no decode worker had free KV "
        "cache blocks in time, after 2 attempts. Retry later.")
    busy = LegFailed("p0", Phase.PREFILL, FailureKind.BUSY, "draining")
    assert "the workers are overloaded" in client_message(1, busy)
    assert (client_code(full), client_code(busy)) == ("kv_cache_full", "workers_busy")


@pytest.mark.parametrize("kind, code", [
    (FailureKind.UNREACHABLE, "worker_unreachable"), (FailureKind.STALLED, "worker_stalled"),
    (FailureKind.WORKER_ERROR, "worker_error"), (FailureKind.REFUSED, "worker_refused"),
])
def test_every_failure_kind_has_an_error_code(kind: FailureKind, code: str) -> None:
    assert client_code(LegFailed("d0", Phase.DECODE, kind, "detail")) == code


@pytest.mark.parametrize("code, blamed, phase", [
    (ErrorCode.TRANSFER_FAILED, "p0", Phase.TRANSFER),
    (ErrorCode.PEER_LOST, "p0", Phase.TRANSFER),
    (ErrorCode.INTERNAL, "d0", Phase.DECODE),
    (ErrorCode.DEADLINE_EXCEEDED, "d0", Phase.DECODE),
])
def test_a_failed_push_seen_by_the_decode_worker_first_blames_the_prefill_worker(
        code: ErrorCode, blamed: str, phase: Phase) -> None:
    exc = remote(code)
    failure = decode_failure(leg_failed("d0", Phase.DECODE, exc), exc, None, "p0")
    assert (failure.worker_id, failure.phase) == (blamed, phase)
    assert failure.kind is FailureKind.WORKER_ERROR and not marks_worker_dead(failure.kind)


def test_a_gone_decode_worker_or_a_transfer_failure_seen_first_decides() -> None:
    exc = remote(ErrorCode.TRANSFER_FAILED)
    own = leg_failed("d0", Phase.DECODE, exc)
    seen = LegFailed("p0", Phase.TRANSFER, FailureKind.UNREACHABLE, "reset")
    assert decode_failure(own, exc, seen, "p0") is seen
    gone = ControlError("stream broken")
    assert decode_failure(leg_failed("d0", Phase.DECODE, gone), gone, seen, "p0").worker_id \
        == "d0"
    # A local prefill has no sender to blame.
    assert decode_failure(own, exc, None, None) is own
