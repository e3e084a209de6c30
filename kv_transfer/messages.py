"""Control messages of the KV-transfer handshake, msgpack-encoded (never pickle).

    sender                                   receiver
      |-- Hello(token, layout, epoch, ucx) ---->|   checks token and layout
      |<-- Welcome(layout, epoch, ucx, export) -|   (or Refused, then close)
      |-- Announce(spec, packing | mapped) ---->|   matches an expect(); assigns seq
      |<-- Accepted(request_id, seq) -----------|   (or Rejected); data may flow now
      |== data: UCX tags or TCP data frames ===>|   or, mapped: the sender copies into the
      |-- Written(request_id) ----------------->|   pool it mapped from `export`, then says so
      |<-- Landed(request_id) ------------------|   every block of every layer landed
    Abort(request_id, reason) goes either way; the side that receives it stops
    (sender: stops posting sends and drains those in flight) and answers with Abort, so
    the receiver knows no more bytes of that transfer will arrive before it releases.
"""

from __future__ import annotations

import msgspec

from engine.kv_storage import KVLayout
from kv_transfer.interface import TransferSpec
from kv_transfer.packing import Packing
from kv_transfer.pool_mapping import PoolExport

PROTOCOL_VERSION = 2


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    version: int
    token: str
    layout: KVLayout
    epoch: str
    ucx_address: bytes | None = None


class Welcome(msgspec.Struct, tag="welcome", kw_only=True):
    layout: KVLayout
    epoch: str
    ucx_address: bytes | None = None
    export: PoolExport | None = None  # how a sender on this host may map the pool


class Refused(msgspec.Struct, tag="refused", kw_only=True):
    reason: str
    layout_mismatch: bool = False


class Announce(msgspec.Struct, tag="announce", kw_only=True):
    spec: TransferSpec
    packing: Packing | None = None  # None: one message per (layer, K|V, run), zero copy
    mapped: bool = False  # the sender copies into the mapped pool (no data messages)


class Accepted(msgspec.Struct, tag="accepted", kw_only=True):
    request_id: str
    transfer_seq: int


class Rejected(msgspec.Struct, tag="rejected", kw_only=True):
    request_id: str
    reason: str


class Landed(msgspec.Struct, tag="landed", kw_only=True):
    request_id: str


class Written(msgspec.Struct, tag="written", kw_only=True):
    """Mapped transfers: every block of every layer is in the receiver's pool."""

    request_id: str


class Abort(msgspec.Struct, tag="abort", kw_only=True):
    request_id: str
    reason: str


ControlMessage = (Hello | Welcome | Refused | Announce | Accepted | Rejected | Written | Landed
                  | Abort)

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(ControlMessage)
