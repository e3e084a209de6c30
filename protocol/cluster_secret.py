"""The cluster secret and what it proves, as pure functions (no I/O).

Every process of a cluster is given one internal token (PDSERVE_INTERNAL_TOKEN; `pdserve up`
makes a fresh one). The token itself never leaves the process: each use has its own key,
derived from it, and what travels is a MAC made with that key.

    registry key   a worker MACs its registry entry (`bind_entry`); the gateway and the
                   agent ignore an entry whose binding does not verify (`entry_is_bound`),
                   so a process that can write Redis but does not hold the token cannot
                   add a worker, nor point a real worker's entry at its own listener, its
                   own pid or another role
    channel key    the greeting of a control channel (rpc/channel_wire.py): the worker
                   proves first, for the caller's fresh nonce and the address the caller
                   dialled, then the caller proves, for the worker's nonce

Why both: the binding decides which entries exist; the greeting decides who is at an
address. An entry can be authentic and still name an address someone else now listens on
(a worker that died, its port taken; an old entry written again by someone with Redis
access), so the caller sends nothing (no token, no prompt) before the listener proved it
holds the secret and serves the address the entry names; a listener that relays the
greeting to a real worker gets that worker's proof for the worker's own address, which the
caller refuses. Without a token (a loopback-only cluster assembled by hand), nothing is
bound and nothing proved: such a cluster trusts every process that can reach its Redis and
its ports, as its unauthenticated control API already does.

Invariant: every field of WorkerInfo but `binding` is covered by the binding
(`ENTRY_FIELDS`; tests/unit/protocol checks it), so a field added later is bound too or
the test fails.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec

from protocol.messages import WorkerInfo

NONCE_BYTES = 16


class KeyPurpose(enum.StrEnum):
    """What a derived key is for; one key per purpose, so a MAC made for one use is never
    accepted for another."""

    REGISTRY = "registry-entry/v1"
    CHANNEL = "channel-greeting/v1"


class ProofSide(enum.StrEnum):
    """Who proves in a channel greeting; in the MAC, so a proof is never reflected back."""

    WORKER = "worker"
    CALLER = "caller"


# The WorkerInfo fields the binding covers, in the order they are MACed: all but `binding`.
ENTRY_FIELDS = ("worker_id", "epoch", "role", "model", "control_url", "kv_address", "device",
                "num_kv_blocks", "block_size", "max_num_batched_tokens", "started_unix_ms",
                "pid", "kv_bytes_per_token", "sm_share_percent", "draining", "kv_dtype")


def derive_key(token: str, purpose: KeyPurpose) -> bytes:
    """The key for `purpose`: HMAC-SHA256 keyed by the token over the purpose's name."""
    return hmac.new(token.encode(), b"pdserve/" + purpose.value.encode(),
                    hashlib.sha256).digest()


def derive_optional_key(token: str | None, purpose: KeyPurpose) -> bytes | None:
    """`derive_key`, or None without a token (a cluster that binds and proves nothing)."""
    return derive_key(token, purpose) if token else None


def _entry_mac(info: WorkerInfo, key: bytes) -> bytes:
    fields = [getattr(info, name) for name in ENTRY_FIELDS]
    return hmac.new(key, msgspec.msgpack.encode(["entry", fields]), hashlib.sha256).digest()


def bind_entry(info: WorkerInfo, key: bytes | None) -> WorkerInfo:
    """`info` with its binding made with the registry key (unchanged without a key)."""
    if key is None:
        return info
    return msgspec.structs.replace(info, binding=_entry_mac(info, key))


def entry_is_bound(info: WorkerInfo, key: bytes | None) -> bool:
    """Was `info` bound with `key`? Always True without a key (nothing is checked)."""
    if key is None:
        return True
    return hmac.compare_digest(info.binding, _entry_mac(info, key))


def channel_proof(key: bytes, side: ProofSide, endpoint: str, caller_nonce: bytes,
                  worker_nonce: bytes) -> bytes:
    """The MAC `side` sends in a channel greeting to the worker at `endpoint` (host:port as
    the caller dialled it and the worker serves it)."""
    body = msgspec.msgpack.encode([side.value, endpoint, caller_nonce, worker_nonce])
    return hmac.new(key, body, hashlib.sha256).digest()


def proof_matches(given: bytes | None, key: bytes, side: ProofSide, endpoint: str,
                  caller_nonce: bytes, worker_nonce: bytes) -> bool:
    """Constant time, so the comparison is no oracle for the proof."""
    if given is None:
        return False
    return hmac.compare_digest(given, channel_proof(key, side, endpoint, caller_nonce,
                                                    worker_nonce))
