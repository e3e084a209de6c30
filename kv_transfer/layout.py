"""Block ids <-> byte ranges in the paged KV pool, coalescing, and the layout check.

The pool (engine/kv_storage.py) is one tensor kv[layer, K|V, block, slot, head, dim], so
one block of one layer's K is `block_bytes` contiguous bytes and adjacent block ids are
adjacent. A transfer is cut into messages, one per (layer, K|V, run), where a run is a
stretch of blocks consecutive on *both* sides:

    src ids  4 5 6 | 9 | 10 11        dst ids  0 1 2 | 7 | 3 4
             run 0  run1  run 2                run 0  run1 run 2

Message index (the low bits of a UCX tag, the frame tag on TCP):

    index = ((layer - layer_begin) * 2 + kv_index) * num_runs + run_index

so both sides derive the same numbering from the spec alone, and the messages of one
layer are one contiguous index range (what `send_layer` sends).

Which prompt blocks a handoff moves, computed here once for both sides:

    prompt positions   [0 ........................................ P)
    blocks (size B)    | 0 | 1 | ... | h-1 | h | ... | n-1 |          n = ceil(P / B)
                        held by the decode side   sent: src[h:n] -> dst[h:n]

The decode side's reservation has one more position (P) for the token sampled by the
prefill side; its KV is computed by the decode side's first step, so it never travels.
The last prompt block may be partial: it travels whole (the slots past P are never read).
"""

from __future__ import annotations

from typing import TypeAlias

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from engine.kv_storage import KVLayout
from kv_transfer.errors import LayoutMismatch
from kv_transfer.interface import TransferSpec

# Message indices take the low bits of a 64-bit tag; the receiver's transfer sequence
# number takes the rest (see tag_for), so tags of concurrent transfers never collide.
MESSAGE_INDEX_BITS = 20
MAX_MESSAGES = 1 << MESSAGE_INDEX_BITS
MAX_TRANSFER_SEQ = 1 << (64 - MESSAGE_INDEX_BITS)


class BlockRun(msgspec.Struct, frozen=True):
    src_start: int
    dst_start: int
    num_blocks: int


class Message(msgspec.Struct, frozen=True):
    index: int
    src_offset_bytes: int
    dst_offset_bytes: int
    num_bytes: int


def handoff_blocks(num_prompt_tokens: int, block_size: int, num_blocks_held: int) -> range:
    """The indices [h, n) into a prompt's block table that the prefill side sends, when the
    decode side already holds the first `num_blocks_held` blocks (capped at n)."""
    if num_prompt_tokens < 1 or block_size < 1 or num_blocks_held < 0:
        raise ValueError(f"bad handoff: {num_prompt_tokens} tokens, block size {block_size}, "
                         f"{num_blocks_held} blocks held")
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    return range(min(num_blocks_held, num_prompt_blocks), num_prompt_blocks)


def transfer_bytes(layout: KVLayout, num_blocks: int, num_layers: int) -> int:
    """Bytes a transfer of `num_blocks` blocks moves over `num_layers` layers (K and V)."""
    return num_layers * 2 * num_blocks * layout.block_bytes


def plan_runs(src_block_ids: list[int], dst_block_ids: list[int]) -> list[BlockRun]:
    """Coalesce (src, dst) pairs into runs consecutive on both sides, in spec order."""
    runs: list[BlockRun] = []
    start = 0
    for i in range(1, len(src_block_ids) + 1):
        if (i == len(src_block_ids) or src_block_ids[i] != src_block_ids[i - 1] + 1
                or dst_block_ids[i] != dst_block_ids[i - 1] + 1):
            runs.append(BlockRun(src_block_ids[start], dst_block_ids[start], i - start))
            start = i
    return runs


class TransferPlan:
    """Every message of one transfer, per layer; side-effect free after construction."""

    def __init__(self, layout: KVLayout, spec: TransferSpec) -> None:
        spec.validate(layout.num_layers)
        self.layout = layout
        self.spec = spec
        self.runs = plan_runs(spec.src_block_ids, spec.dst_block_ids)
        self.num_messages = (spec.layer_end - spec.layer_begin) * 2 * len(self.runs)
        if self.num_messages > MAX_MESSAGES:
            raise ValueError(f"transfer {spec.request_id}: {self.num_messages} messages "
                             f"exceed {MAX_MESSAGES}; send fewer layers or blocks at once")
        self.num_bytes = transfer_bytes(layout, len(spec.src_block_ids),
                                        spec.layer_end - spec.layer_begin)
        # layout.offset_bytes(layer, kv, block) = (layer * 2 + kv) * unit + block * block
        # bytes: each run's part is the same in every (layer, K|V), so it is taken once
        # (both sides list every message of a transfer: thousands for a long prompt).
        block_bytes = layout.block_bytes
        self._unit_bytes = layout.num_blocks * block_bytes
        self._run_bytes = [(r.src_start * block_bytes, r.dst_start * block_bytes,
                            r.num_blocks * block_bytes) for r in self.runs]

    def layer_messages(self, layer: int) -> list[Message]:
        if layer not in self.spec.layers:
            raise ValueError(f"transfer {self.spec.request_id}: layer {layer} not in "
                             f"{self.spec.layers}")
        out, num_runs = [], len(self._run_bytes)
        for kv_index in (0, 1):
            index = ((layer - self.spec.layer_begin) * 2 + kv_index) * num_runs
            base = (layer * 2 + kv_index) * self._unit_bytes
            out += [Message(index + i, base + src, base + dst, num_bytes)
                    for i, (src, dst, num_bytes) in enumerate(self._run_bytes)]
        return out

    def all_messages(self) -> list[Message]:
        return [m for layer in self.spec.layers for m in self.layer_messages(layer)]


def tag_for(transfer_seq: int, message_index: int) -> int:
    """64-bit tag: receiver-assigned sequence number (high bits) | message index (low)."""
    if not 0 < transfer_seq < MAX_TRANSFER_SEQ:
        raise ValueError(f"transfer sequence {transfer_seq} out of range")
    return (transfer_seq << MESSAGE_INDEX_BITS) | message_index


def split_tag(tag: int) -> tuple[int, int]:
    return tag >> MESSAGE_INDEX_BITS, tag & (MAX_MESSAGES - 1)


# The pool's bytes as the transports take them: numpy on the host, a uint8 tensor on CUDA.
PoolBytes: TypeAlias = "npt.NDArray[np.uint8] | torch.Tensor"


def pool_bytes(kv: torch.Tensor) -> PoolBytes:
    """The whole pool as a flat uint8 object the transports accept, without a copy.

    CPU: a numpy array (buffer protocol; torch tensors are not bytes-like). CUDA: a uint8
    tensor, which exposes `__cuda_array_interface__` (bf16 tensors do not, hence the view).
    """
    if not kv.is_contiguous():
        raise ValueError("the KV pool must be contiguous")
    flat = kv.view(-1).view(torch.uint8)
    return flat if flat.is_cuda else flat.numpy()


def check_layouts(local: KVLayout, remote: KVLayout, remote_name: str) -> None:
    """Raise LayoutMismatch when blocks cannot move between the two pools."""
    diff = local.compatible_with(remote, "here", f"at {remote_name}")
    if diff is not None:
        raise LayoutMismatch(f"KV layout of {remote_name} differs from ours: {diff}")
