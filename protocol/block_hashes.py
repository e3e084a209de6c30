"""Chained block hashes: the names of full KV blocks that every process computes alike.

A full block (block_size tokens) is named by

    hash_0 = block_hash(None,   tokens[0:B])
    hash_i = block_hash(hash_{i-1}, tokens[i*B:(i+1)*B])

so a hash identifies the whole prefix up to the end of its block, not just the block's own
tokens. blake2b-64 over the msgpack encoding of (parent, tokens): stable across processes and
hosts, unlike the salted builtin `hash()`. The engine's prefix cache (engine/kv_cache.py), the
Redis prefix index and the gateway's router all use these names, so a hash computed at the
gateway finds the blocks a worker cached.

A block held in a worker's host KV tier (engine/host_kv_tier.py) rather than its KV cache is
named in the index by `host_tier_hash(h)`: a fixed bijection of the 64-bit names, so both
tiers share one index, one event stream and its epoch fence, and a router tells them apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_ENCODER = msgspec.msgpack.Encoder()


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Stable unsigned 64-bit name of a full block given its parent's name."""
    data = _ENCODER.encode((parent_hash, list(token_ids)))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_hashes(token_ids: Sequence[int], block_size: int,
                 num_blocks: int | None = None) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks (all full blocks when None)."""
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    hashes: list[int] = []
    parent: int | None = None
    for i in range(num_full):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


HOST_TIER_MASK = 0x9E3779B97F4A7C15  # any fixed 64-bit constant; this one is 2**64 / phi


def host_tier_hash(block_hash_: int) -> int:
    """The index name of the block `block_hash_` held in a worker's host KV tier (its own
    inverse: host_tier_hash(host_tier_hash(h)) == h)."""
    return block_hash_ ^ HOST_TIER_MASK
