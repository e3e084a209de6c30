"""Errors of the internal control carrier (gateway ↔ worker calls), caught by type."""

from __future__ import annotations

from protocol.messages import ErrorFrame


class ControlError(RuntimeError):
    """A control-carrier call failed locally (transport, framing, deadline)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status, when there was a response


class FrameDeadlineError(ControlError, TimeoutError):
    """No frame (or no response) arrived within its deadline."""


class PeerUnverifiedError(ControlError):
    """The peer did not prove, in the channel's greeting, that it is this cluster's worker
    at the address dialled; nothing but the greeting was sent to it."""


class RemoteError(ControlError):
    """The worker answered with an ErrorFrame."""

    def __init__(self, frame: ErrorFrame, status: int | None = None) -> None:
        super().__init__(f"{frame.code.value}: {frame.message}", status)
        self.frame = frame
