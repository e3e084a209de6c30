"""How many KV blocks fit on the device: the arithmetic (pure) and its measured inputs.

    device total x gpu_memory_fraction = this engine's budget
    budget
      - in use after loading     weights, rope tables, CUDA context's allocator reserve
      - peak activations         measured: the largest eager step (a full prefill batch)
      - CUDA graph pool          measured: the largest captured decode step; with mixed
                                 graphs also the largest eager step again, and their
                                 static logits (engine/mixed_graphs.py)
      = KV pool, rounded down to whole blocks (all layers, K and V)

The pool is also capped by what is actually free now, less the same activation and graph
reserves and a safety margin, because other processes may share the device.

Start-up order (see `profile_step_memory`): load weights -> profile one eager prefill of
`max_num_batched_tokens` and one decode step of the largest graph batch over a one-block
pool -> `plan_kv_pool` -> allocate the pool -> capture graphs -> `MemoryPlan.report()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig

# Left free for the allocator's fragmentation and NCCL/cuBLAS workspaces created later.
SAFETY_MARGIN_BYTES = 512 << 20


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    total_bytes: int
    budget_bytes: int
    in_use_bytes: int
    activation_bytes: int
    cuda_graph_bytes: int
    kv_cache_bytes: int
    block_bytes: int  # one block, K and V of every layer
    num_kv_blocks: int
    limited_by: str  # "budget" (gpu_memory_fraction) or "free memory"

    def report(self) -> str:
        gib = 1 << 30
        return (f"memory plan: budget {self.budget_bytes / gib:.2f} GiB of "
                f"{self.total_bytes / gib:.2f} GiB; in use {self.in_use_bytes / gib:.2f} GiB, "
                f"activations {self.activation_bytes / gib:.2f} GiB, cuda graphs "
                f"{self.cuda_graph_bytes / gib:.2f} GiB; KV pool {self.num_kv_blocks} blocks "
                f"= {self.kv_cache_bytes / gib:.2f} GiB (limited by {self.limited_by})")


def kv_block_bytes(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V (the unit the pool is counted in), in
    a pool of `kv_dtype` (an FP8 block's scales included)."""
    from engine.kv_storage import DTYPE_NAMES, KVLayout

    layout = KVLayout(dtype=DTYPE_NAMES[kv_dtype], num_layers=config.num_layers, num_blocks=1,
                      block_size=block_size, num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim)
    return 2 * config.num_layers * layout.block_bytes


def plan_kv_pool(total_bytes: int, free_bytes: int, in_use_bytes: int, activation_bytes: int,
                 cuda_graph_bytes: int, gpu_memory_fraction: float, block_bytes: int,
                 safety_margin_bytes: int = SAFETY_MARGIN_BYTES) -> MemoryPlan:
    """The KV pool size; side-effect free. Raises ValueError when not one block fits, with
    the numbers that say why."""
    if not 0.0 < gpu_memory_fraction <= 1.0:
        raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    budget = int(total_bytes * gpu_memory_fraction)
    reserves = activation_bytes + cuda_graph_bytes
    by_budget = budget - in_use_bytes - reserves
    by_free = free_bytes - reserves - safety_margin_bytes
    kv_bytes, limited_by = ((by_budget, "budget") if by_budget <= by_free
                            else (by_free, "free memory"))
    num_blocks = max(0, kv_bytes) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV pool: budget {budget} B ({gpu_memory_fraction:.2f} of "
            f"{total_bytes} B), in use {in_use_bytes} B, activations {activation_bytes} B, "
            f"cuda graphs {cuda_graph_bytes} B, free {free_bytes} B; one block needs "
            f"{block_bytes} B. Raise gpu_memory_fraction or lower the batch limits.")
    return MemoryPlan(total_bytes=total_bytes, budget_bytes=budget, in_use_bytes=in_use_bytes,
                      activation_bytes=activation_bytes, cuda_graph_bytes=cuda_graph_bytes,
                      kv_cache_bytes=num_blocks * block_bytes, block_bytes=block_bytes,
                      num_kv_blocks=num_blocks, limited_by=limited_by)


def profile_step_memory(model, block_size: int, kv_dtype: torch.dtype, num_tokens: int,
                        decode_batch: int) -> tuple[int, int]:
    """(peak activation bytes of an eager `num_tokens` prefill, of a `decode_batch` decode
    step), measured on the model's CUDA device over a one-block pool: every token writes to
    slot -1 (skipped) and attends through block 0, so no real pool is needed yet."""
    from engine.attention_metadata import AttentionMetadata, KernelAttentionMetadata
    from engine.kv_storage import KVStorage

    device = model.model.embed_tokens.weight.device
    model.prepare_kernels()
    kv = KVStorage.for_model(model.config, 1, block_size, kv_dtype, device)
    peaks = []
    for num_seqs, q_len in ((1, num_tokens), (decode_batch, 1)):
        tokens = num_seqs * q_len
        # Every table entry names block 0, so attention reads stay inside the tiny pool
        # while doing the work (and holding the memory) of a real step of this shape.
        kernels = KernelAttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros(num_seqs, -(-q_len // block_size), dtype=torch.int32,
                                     device=device),
            context_lens=torch.full((num_seqs,), q_len, dtype=torch.int32, device=device),
            cu_seqlens_q=torch.arange(num_seqs + 1, dtype=torch.int32, device=device) * q_len,
            max_query_len=q_len, num_decode_splits=1)
        attn = AttentionMetadata(slot_mapping=kernels.slot_mapping, query_start=(), start_pos=(),
                                 end_pos=(), block_tables=(), block_size=block_size, groups=(),
                                 kernels=kernels)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            hidden = model(torch.zeros(tokens, dtype=torch.int64, device=device),
                           torch.zeros(tokens, dtype=torch.int64, device=device), kv, attn)
            model.compute_logits(hidden[-num_seqs:])
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        del hidden
    del kv
    torch.cuda.empty_cache()
    return peaks[0], peaks[1]


def graph_reserve_bytes(decode_step_bytes: int, activation_bytes: int,
                        mixed_logits_rows: int, vocab_size: int) -> int:
    """What the CUDA graphs need besides the KV pool; pure. One pool for every graph holds
    the largest step's activations (a mixed step's are an eager step's, counted again, on
    top of the decode steps': a plain sum, an upper bound), and the mixed graphs write
    their logits into one float32 buffer of `mixed_logits_rows` rows (0: no mixed graphs)."""
    if not mixed_logits_rows:
        return decode_step_bytes
    return decode_step_bytes + activation_bytes + mixed_logits_rows * vocab_size * 4


def plan_for_model(model, block_size: int, kv_dtype: torch.dtype, gpu_memory_fraction: float,
                   max_num_batched_tokens: int, max_graph_batch: int,
                   mixed_logits_rows: int = 0) -> MemoryPlan:
    """Measure, then plan: call after loading weights and before allocating the pool.
    `mixed_logits_rows`: the mixed graphs' logits rows (engine/mixed_graphs.py), 0: none."""
    device = model.model.embed_tokens.weight.device
    activation, decode_step = profile_step_memory(model, block_size, kv_dtype,
                                                  max_num_batched_tokens, max_graph_batch)
    free, total = torch.cuda.mem_get_info(device)
    return plan_kv_pool(total_bytes=total, free_bytes=free,
                        in_use_bytes=torch.cuda.memory_reserved(device),
                        activation_bytes=activation,
                        cuda_graph_bytes=graph_reserve_bytes(
                            decode_step if max_graph_batch else 0, activation,
                            mixed_logits_rows, model.config.vocab_size),
                        gpu_memory_fraction=gpu_memory_fraction,
                        block_bytes=kv_block_bytes(model.config, block_size, kv_dtype))
