"""Errors raised by KV transfers, on both the sending and the receiving side.

Every failure of a transfer surfaces as one `KVTransferError` subclass, so a worker can
catch the family and tell a retryable loss (`PeerLost`, `TransferTimeout`) from a
configuration error (`LayoutMismatch`) or a decision (`TransferCancelled`).
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of every KV-transfer failure."""


class TransferTimeout(KVTransferError):
    """The transfer's deadline passed before every block of every layer landed."""


class PeerLost(KVTransferError):
    """The peer's control connection closed or its carrier failed mid-transfer."""


class LayoutMismatch(KVTransferError):
    """Both pools disagree on dtype, block size, heads, head dim or layers; no byte moved."""


class TransferCancelled(KVTransferError):
    """One side cancelled the transfer (the message says which)."""


class TransferRejected(KVTransferError):
    """The receiver refused the announcement (unknown request, other blocks, bad token)."""
