"""Copy blocks of a layer range from one paged pool into another, in one pass.

    dst[l, kv, dst_ids[i]] = src[l, kv, src_ids[i]]    for l in layers, kv in (K, V), each i

Both pools have the layout of engine/kv_storage.py ([layer, K|V, block, ...], one block of
one layer's K or V = `block_bytes` contiguous bytes) and may hold different numbers of
blocks. Each byte is read once and written once: no gather into a staging buffer.

One Triton kernel per call; program (unit, part) copies `part` of one (layer, K|V, block)
unit, block ids read from device index tensors. The destination may be a peer's pool mapped
by CUDA IPC (kv_transfer/pool_mapping.py: same GPU, or another one with peer access); host
pools are copied run by run instead (kv_transfer/mapped_copy.py). A `BlockCopier` checks a
pair of pools once and then only launches; `copy_blocks_triton` is a one-off copy. The
reference (`copy_blocks_reference`, index_select + index_copy_) is the tests' oracle.
Triton's interpreter runs the kernel on CPU tensors in tests.
"""

from __future__ import annotations

import torch

from engine.kernels.backend import import_triton, next_power_of_2, require_triton

triton, tl, _ = import_triton()

_MAX_PART = 4096  # elements per program


def copy_blocks_reference(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                          dst_ids: torch.Tensor, layers: range) -> None:
    """The two-pass torch oracle."""
    l0, l1 = layers.start, layers.stop
    dst[l0:l1].index_copy_(2, dst_ids, torch.index_select(src[l0:l1], 2, src_ids))


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_blocks, unit_begin,
                        src_unit_stride, dst_unit_stride, block_elems,
                        PART: tl.constexpr):
    unit = tl.program_id(0)  # (layer - layers.start) * 2 * num_blocks + kv * num_blocks + i
    part = tl.program_id(1)
    i = unit % num_blocks
    layer_kv = (unit // num_blocks + unit_begin).to(tl.int64)  # layer * 2 + kv in the pool
    src_block = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + i).to(tl.int64)
    offs = part * PART + tl.arange(0, PART)
    mask = offs < block_elems
    x = tl.load(src_ptr + layer_kv * src_unit_stride + src_block * block_elems + offs,
                mask=mask)
    tl.store(dst_ptr + layer_kv * dst_unit_stride + dst_block * block_elems + offs, x,
             mask=mask)


def _words(pool: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """The pool as a flat tensor of the widest word that divides a block."""
    flat = pool.view(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if block_bytes % size == 0:
            return flat.view(dtype)
    return flat


class BlockCopier:
    """The copies from one pool into another, checked and set up once.

    A KV sender copies into the same mapped pool for every transfer (layer by layer, while
    the prefill computes): the layout checks and the word views are made here, once per
    pair of pools, so that each `launch` costs one kernel launch and nothing else."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        require_triton()
        if src.shape[0] != dst.shape[0] or src.shape[1] != 2 or src.shape[3:] != dst.shape[3:] \
                or src.dtype != dst.dtype:
            raise ValueError(f"copy_blocks: pools {tuple(src.shape)} {src.dtype} and "
                             f"{tuple(dst.shape)} {dst.dtype} do not share a block layout")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy_blocks: both pools must be contiguous")
        self.num_layers = src.shape[0]
        block_bytes = src[0, 0, 0].numel() * src.element_size()
        self._src, self._dst = _words(src, block_bytes), _words(dst, block_bytes)
        self._block_elems = block_bytes // self._src.element_size()
        self._part = min(next_power_of_2(self._block_elems), _MAX_PART)
        self._num_parts = triton.cdiv(self._block_elems, self._part)
        self._src_stride = src.shape[2] * self._block_elems
        self._dst_stride = dst.shape[2] * self._block_elems

    def launch(self, src_ids: torch.Tensor, dst_ids: torch.Tensor, layers: range) -> None:
        """Queue the copy of blocks `src_ids` -> `dst_ids` (int32 device tensors) over
        `layers` on the current stream of the pools' device."""
        if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
            raise ValueError("copy_blocks: one source and one destination id per block")
        if not 0 <= layers.start <= layers.stop <= self.num_layers:
            raise ValueError(f"copy_blocks: layers {layers} outside the pool")
        num_blocks = src_ids.shape[0]
        if num_blocks == 0 or len(layers) == 0:
            return
        grid = (len(layers) * 2 * num_blocks, self._num_parts)
        _copy_blocks_kernel[grid](self._src, self._dst, src_ids, dst_ids, num_blocks,
                                  2 * layers.start, self._src_stride, self._dst_stride,
                                  self._block_elems, PART=self._part, num_warps=4)


def copy_blocks_triton(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor,
                       dst_ids: torch.Tensor, layers: range) -> None:
    """The kernel path, queued on the current stream of `src`'s device (one-off copies;
    repeated ones between the same pools keep a `BlockCopier`)."""
    BlockCopier(src, dst).launch(src_ids, dst_ids, layers)
