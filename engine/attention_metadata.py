"""Attention metadata: one step's layout, built once per step and read by every layer.

One step flattens the new tokens of every scheduled chunk into one dimension T. Chunk c
owns the query rows [query_start[c], query_start[c+1]) of T and the sequence positions
[start_pos[c], end_pos[c]):

    T (flattened)   | chunk 0 (prefill, 5 tok) | chunk 1 (1 tok) | chunk 2 (1 tok) |
    query_start     0                          5                 6                 7
    chunk 0 keys    positions [0, end_pos[0])   -> cache slots via its block table
    slot of pos p   block_ids[p // block_size] * block_size + p % block_size

The torch path (engine/attention_reference.py) attends chunks in groups: all single-token
chunks (decode steps) in one padded batch, every longer chunk on its own, so a long prefill
never pads the decode batch to its length. All gather indices and masks are built here,
once per step. A chunk that starts its sequence (`start_pos == 0`, the common first prefill
chunk) has no cached keys to read: it is a `CausalChunk`, attended over its own new K/V
without gathering from the cache or building a mask (on the CPU a 512-token prefill step
takes a fifth less time than through the gather).

The kernel path (Triton, chosen on CUDA; engine/attention_kernels.py) needs no padded
groups: `KernelAttentionMetadata` carries what the kernels read, one row per chunk,

    block_tables[c, :]   chunk c's block ids, zero-padded to the widest table of the step
    context_lens[c]      end_pos[c]: positions [0, end_pos) are attended after the write
    cu_seqlens_q         query_start as an int32 tensor
    slot_mapping[t]      as above; a negative slot is a padding token (never written)

A mixed step whose decode rows carry enough context (engine/mixed_split.py) also gets a
`prefill_part`: the chunks after the leading decodes, as a step of their own. The prefill
part has tensors of its own rather than views into the step's: a view that starts past a
tensor's first 16 bytes would make Triton compile another variant of the kernel,
mid-traffic.

Side-effect free: building metadata uploads index tensors to the device and writes nothing
else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from engine.device_upload import to_device
from engine.kernels.backend import import_triton
from engine.mixed_split import MIXED_SPLIT_MIN_CONTEXT_TOKENS, split_mixed_step
from engine.schedule_output import ScheduledChunk, ScheduleOutput


@dataclass(frozen=True, slots=True)
class KernelAttentionMetadata:
    """What the Triton attention kernels read; tensors on the model's device."""

    slot_mapping: torch.Tensor  # [T] int64; negative: a padding token, not written
    block_tables: torch.Tensor  # [num_chunks, max_blocks] int32, zero-padded
    context_lens: torch.Tensor  # [num_chunks] int32: end_pos of each chunk (0 for padding)
    cu_seqlens_q: torch.Tensor  # [num_chunks + 1] int32: query_start
    max_query_len: int  # longest chunk of the step (a host int: no device sync)
    num_decode_splits: int  # split-K factor of the decode kernel's rows
    # A mixed step: its leading single-token chunks (the decode kernel's rows), and the
    # rest as a step of their own (the prefill kernel's); 0 and None otherwise.
    num_decode_chunks: int = 0
    prefill_part: KernelAttentionMetadata | None = None
    # The prefill part's cu_seqlens_q count rows from the step's row 0 (True: a mixed
    # graph's padded decode rows, engine/mixed_graphs.py), else from num_decode_chunks.
    prefill_rows_absolute: bool = False

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def for_decode(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor, num_decode_splits: int) -> "KernelAttentionMetadata":
        """A decode batch over caller-owned buffers (the CUDA-graph static inputs); the
        decode kernel never reads cu_seqlens_q, so it is left empty."""
        return cls(slot_mapping=slot_mapping, block_tables=block_tables,
                   context_lens=context_lens, cu_seqlens_q=context_lens[:0],
                   max_query_len=1, num_decode_splits=num_decode_splits)


def choose_decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int,
                         device: torch.device) -> int:
    """Split-K factor for a decode batch: the kernel package's policy on CUDA; on the CPU
    (Triton's interpreter) one split per 32 positions, so tests cover the merge cheaply."""
    from engine.kernels.paged_decode_attention import MAX_SPLITS, num_decode_splits

    if device.type != "cuda":
        return max(1, min(MAX_SPLITS, max_context_len // 32))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return num_decode_splits(num_seqs, num_kv_heads, max_context_len, num_sms)


def kernels_available(device: torch.device | str) -> bool:
    """True where the Triton path is chosen automatically: a CUDA device with triton."""
    return torch.device(device).type == "cuda" and import_triton()[2]


@dataclass(frozen=True, slots=True)
class AttentionGroup:
    """Chunks attended in one padded SDPA call (C chunks, Q query rows, L key positions)."""

    query_rows: torch.Tensor  # [C, Q] long: row of T for each padded query (pads point at 0)
    query_valid: torch.Tensor  # [C, Q] bool: False for padding rows
    key_slots: torch.Tensor  # [C, L] long: cache slot of each key position (pads point at 0)
    mask: torch.Tensor  # [C, 1, Q, L] bool: True where the query may see the key
    query_pos: torch.Tensor  # [C, Q] long: sequence position of each query (pads: 0)
    out_rows: torch.Tensor  # [num valid queries] long: where the valid outputs go in T


@dataclass(frozen=True, slots=True)
class CausalChunk:
    """A chunk that starts its sequence: rows [row_start, row_end) of T attend causally to
    each other only (no cached keys exist before them)."""

    row_start: int
    row_end: int


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything attention needs about one step's layout; built once, read by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    query_start: tuple[int, ...]  # num_chunks + 1 offsets into T
    start_pos: tuple[int, ...]  # per chunk: first position computed this step
    end_pos: tuple[int, ...]  # per chunk: one past the last position computed this step
    block_tables: tuple[tuple[int, ...], ...]  # per chunk: the request's block ids
    block_size: int
    # The torch path's groups; () on the kernel path.
    groups: tuple[AttentionGroup | CausalChunk, ...]
    kernels: KernelAttentionMetadata | None = None  # set: the model runs the Triton path

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def num_chunks(self) -> int:
        return len(self.start_pos)

    @classmethod
    def from_schedule(cls, schedule: ScheduleOutput, block_size: int,
                      device: torch.device | str = "cpu", use_kernels: bool | None = None,
                      num_kv_heads: int = 1,
                      mixed_split_min_tokens: int = MIXED_SPLIT_MIN_CONTEXT_TOKENS
                      ) -> "AttentionMetadata":
        """Builds the metadata; raises ValueError when a block table is too short.

        `use_kernels`: None picks the Triton path on CUDA (see `kernels_available`); True
        forces it (Triton's interpreter runs it on CPU tensors in tests). `num_kv_heads`
        only informs the decode kernel's split-K choice; `mixed_split_min_tokens`, the
        kernel path's choice for a mixed step (`split_mixed_step`)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        query_start = [0]
        slots: list[int] = []
        for chunk in schedule.chunks:
            if len(chunk.block_ids) * block_size < chunk.end_pos:
                raise ValueError(
                    f"chunk of {chunk.request_id}: {len(chunk.block_ids)} blocks of "
                    f"{block_size} cannot hold {chunk.end_pos} positions")
            slots.extend(chunk_slots(chunk.block_ids, chunk.start_pos, chunk.end_pos, block_size))
            query_start.append(query_start[-1] + len(chunk.token_ids))
        meta_without_groups = cls(
            slot_mapping=to_device(slots, torch.long, torch.device(device)),
            query_start=tuple(query_start),
            start_pos=tuple(c.start_pos for c in schedule.chunks),
            end_pos=tuple(c.end_pos for c in schedule.chunks),
            block_tables=tuple(c.block_ids for c in schedule.chunks),
            block_size=block_size,
            groups=(),
        )
        if use_kernels is None:
            use_kernels = kernels_available(device)
        if use_kernels:
            return dataclasses.replace(meta_without_groups, kernels=_build_kernel_metadata(
                schedule, meta_without_groups.slot_mapping, num_kv_heads, device,
                mixed_split_min_tokens))
        decode = [i for i, c in enumerate(schedule.chunks) if len(c.token_ids) == 1]
        groups: list[AttentionGroup | CausalChunk] = []
        if decode:
            groups.append(_build_group(meta_without_groups, decode, device))
        for i, chunk in enumerate(schedule.chunks):
            if len(chunk.token_ids) == 1:
                continue
            if chunk.start_pos == 0:
                groups.append(CausalChunk(query_start[i], query_start[i + 1]))
            else:
                groups.append(_build_group(meta_without_groups, [i], device))
        return dataclasses.replace(meta_without_groups, groups=tuple(groups))


def chunk_slots(table: tuple[int, ...], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of positions [start, end) through one block table. Vectorised for
    long chunks: a 2048-token prefill would otherwise spend milliseconds in Python."""
    if end - start == 1:
        return [table[start // block_size] * block_size + start % block_size]
    positions = np.arange(start, end)
    blocks = np.asarray(table, dtype=np.int64)[positions // block_size]
    return (blocks * block_size + positions % block_size).tolist()


def _build_kernel_metadata(schedule: ScheduleOutput, slot_mapping: torch.Tensor,
                           num_kv_heads: int, device: torch.device | str,
                           mixed_split_min_tokens: int) -> KernelAttentionMetadata:
    chunks = schedule.chunks
    device = torch.device(device)
    num_decodes = schedule.num_leading_decodes
    splits = 1
    mixed = False
    if num_decodes:
        max_decode_context = max(c.end_pos for c in chunks[:num_decodes])
        splits = choose_decode_splits(num_decodes, num_kv_heads, max_decode_context, device)
        mixed = num_decodes < len(chunks) and split_mixed_step(
            num_decodes, max_decode_context, mixed_split_min_tokens)
    meta = _chunk_tensors(chunks, slot_mapping, device, splits)
    if not mixed:
        return meta
    return dataclasses.replace(meta, num_decode_chunks=num_decodes, prefill_part=_chunk_tensors(
        chunks[num_decodes:], slot_mapping[:0], device, 1))


def _chunk_tensors(chunks: tuple[ScheduledChunk, ...], slot_mapping: torch.Tensor,
                   device: torch.device, splits: int) -> KernelAttentionMetadata:
    width = max(len(c.block_ids) for c in chunks)
    tables = np.zeros((len(chunks), width), dtype=np.int32)
    for row, chunk in enumerate(chunks):
        tables[row, :len(chunk.block_ids)] = chunk.block_ids
    query_start = [0]
    for chunk in chunks:
        query_start.append(query_start[-1] + len(chunk.token_ids))
    return KernelAttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=to_device(tables, torch.int32, device),
        context_lens=to_device([c.end_pos for c in chunks], torch.int32, device),
        cu_seqlens_q=to_device(query_start, torch.int32, device),
        max_query_len=max(len(c.token_ids) for c in chunks),
        num_decode_splits=splits,
    )


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
        query_pos=query_pos.to(device),
        out_rows=query_rows[query_valid].to(device),
    )

