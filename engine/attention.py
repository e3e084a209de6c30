"""Paged attention: step metadata and the torch reference implementation.

One step flattens the new tokens of every scheduled chunk into one dimension T. Chunk c
owns the query rows [query_start[c], query_start[c+1]) of T and the sequence positions
[start_pos[c], end_pos[c]):

    T (flattened)   | chunk 0 (prefill, 5 tok) | chunk 1 (1 tok) | chunk 2 (1 tok) |
    query_start     0                          5                 6                 7
    chunk 0 keys    positions [0, end_pos[0])   -> cache slots via its block table
    slot of pos p   block_ids[p // block_size] * block_size + p % block_size

`paged_attention` first writes the new K/V rows into the cache at `slot_mapping`, then each
query at position p attends to the cached keys at positions 0..p of its own sequence. So a
chunk whose first `start_pos` positions were written by an earlier step (an earlier chunk of
a chunked prefill, or a shared prefix) sees them exactly as if it had computed them itself.

Chunks are attended in groups: all single-token chunks (decode steps) in one padded batch,
every longer chunk on its own, so a long prefill never pads the decode batch to its length.
All gather indices and masks are built once per step here and reused by every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.schedule_output import ScheduleOutput


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Chunks attended in one padded SDPA call (C chunks, Q query rows, L key positions)."""

    query_rows: torch.Tensor  # [C, Q] long: row of T for each padded query (pads point at 0)
    query_valid: torch.Tensor  # [C, Q] bool: False for padding rows
    key_slots: torch.Tensor  # [C, L] long: cache slot of each key position (pads point at 0)
    mask: torch.Tensor  # [C, 1, Q, L] bool: True where the query may see the key
    out_rows: torch.Tensor  # [num valid queries] long: where the valid outputs go in T


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's layout; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start: tuple[int, ...]  # num_chunks + 1 offsets into T
    start_pos: tuple[int, ...]  # per chunk: first position computed this step
    end_pos: tuple[int, ...]  # per chunk: one past the last position computed this step
    block_tables: tuple[tuple[int, ...], ...]  # per chunk: the request's block ids
    block_size: int
    groups: tuple[AttentionGroup, ...]

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def num_chunks(self) -> int:
        return len(self.start_pos)

    @classmethod
    def from_schedule(cls, schedule: ScheduleOutput, block_size: int,
                      device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Builds the metadata; raises ValueError when a block table is too short."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        query_start = [0]
        slots: list[int] = []
        for chunk in schedule.chunks:
            if len(chunk.block_ids) * block_size < chunk.end_pos:
                raise ValueError(
                    f"chunk of {chunk.request_id}: {len(chunk.block_ids)} blocks of "
                    f"{block_size} cannot hold {chunk.end_pos} positions")
            table = chunk.block_ids
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(chunk.start_pos, chunk.end_pos))
            query_start.append(query_start[-1] + len(chunk.token_ids))
        meta_without_groups = cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start=tuple(query_start),
            start_pos=tuple(c.start_pos for c in schedule.chunks),
            end_pos=tuple(c.end_pos for c in schedule.chunks),
            block_tables=tuple(c.block_ids for c in schedule.chunks),
            block_size=block_size,
            groups=(),
        )
        decode = [i for i, c in enumerate(schedule.chunks) if len(c.token_ids) == 1]
        longer = [[i] for i, c in enumerate(schedule.chunks) if len(c.token_ids) > 1]
        groups = [_build_group(meta_without_groups, g, device)
                  for g in ([decode] if decode else []) + longer]
        return dataclasses.replace(meta_without_groups, groups=tuple(groups))


def _build_group(meta: AttentionMetadata, chunk_ids: list[int],
                 device: torch.device | str) -> AttentionGroup:
    num_queries = [meta.query_start[i + 1] - meta.query_start[i] for i in chunk_ids]
    max_q = max(num_queries)
    max_l = max(meta.end_pos[i] for i in chunk_ids)
    bs = meta.block_size
    query_rows = torch.zeros(len(chunk_ids), max_q, dtype=torch.long)
    query_valid = torch.zeros(len(chunk_ids), max_q, dtype=torch.bool)
    query_pos = torch.zeros(len(chunk_ids), max_q, dtype=torch.long)
    key_slots = torch.zeros(len(chunk_ids), max_l, dtype=torch.long)
    key_pos = torch.arange(max_l)
    for row, (i, q) in enumerate(zip(chunk_ids, num_queries)):
        query_rows[row, :q] = torch.arange(meta.query_start[i], meta.query_start[i] + q)
        query_valid[row, :q] = True
        query_pos[row, :q] = torch.arange(meta.start_pos[i], meta.end_pos[i])
        end = meta.end_pos[i]
        table = torch.tensor(meta.block_tables[i][: (end + bs - 1) // bs], dtype=torch.long)
        key_slots[row, :end] = (table[:, None] * bs + torch.arange(bs)).reshape(-1)[:end]
    # Causal with an offset: a query at position p sees keys 0..p. Padding rows sit at
    # position 0 so they still see one key; a row with no visible key would yield NaN.
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    return AttentionGroup(
        query_rows=query_rows.to(device),
        query_valid=query_valid.to(device),
        key_slots=key_slots.to(device),
        mask=mask[:, None].to(device),
        out_rows=query_rows[query_valid].to(device),
    )


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    kv_layer_k: torch.Tensor, kv_layer_v: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Writes the step's K/V into the paged cache, then attends through the block tables.

    Shapes: q [T, num_heads, head_dim]; k_new, v_new [T, num_kv_heads, head_dim];
    kv_layer_k, kv_layer_v [num_blocks, block_size, num_kv_heads, head_dim] (one layer of
    `KVStorage`, written in place at `meta.slot_mapping` only). Returns [T, num_heads,
    head_dim]. num_heads must be a multiple of num_kv_heads (grouped-query attention).
    This is the reference every faster kernel is tested against.
    """
    num_kv_heads, head_dim = kv_layer_k.shape[2], kv_layer_k.shape[3]
    cache_k = kv_layer_k.view(-1, num_kv_heads, head_dim)
    cache_v = kv_layer_v.view(-1, num_kv_heads, head_dim)
    # index_copy_/index_select over flat slot ids: far less per-call overhead on CPU than
    # advanced-index assignment, which matters with 16+ sequences per decode step.
    cache_k.index_copy_(0, meta.slot_mapping, k_new.to(cache_k.dtype))
    cache_v.index_copy_(0, meta.slot_mapping, v_new.to(cache_v.dtype))
    out = torch.empty_like(q)
    for group in meta.groups:
        num_chunks, num_keys = group.key_slots.shape
        keys = group.key_slots.reshape(-1)
        # [C, Q, H, D] -> [C, H, Q, D]; keys [C, L, KVH, D] -> [C, KVH, L, D]
        qg = q.index_select(0, group.query_rows.reshape(-1))
        qg = qg.view(num_chunks, -1, *q.shape[1:]).transpose(1, 2)
        kg = cache_k.index_select(0, keys).view(num_chunks, num_keys, num_kv_heads, head_dim)
        vg = cache_v.index_select(0, keys).view(num_chunks, num_keys, num_kv_heads, head_dim)
        kg, vg = kg.to(q.dtype).transpose(1, 2), vg.to(q.dtype).transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.mask, scale=scale,
                                            enable_gqa=qg.shape[1] != kg.shape[1])
        out.index_copy_(0, group.out_rows, og.transpose(1, 2)[group.query_valid])
    return out
