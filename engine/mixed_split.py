"""Mixed-step split policy (pure): which rows of a mixed step the decode kernel attends.

A mixed step has single-token decode chunks first (the scheduler's order) and prefill chunks
after them. On the kernel path it can run as one chunked-prefill kernel over every row, or
split: the leading decode rows to the split-K decode kernel, the rest to the prefill kernel
(engine/attention_kernels.py). The split halves a long-context step's GPU time but costs
two more kernel launches per layer on the host. This module decides, from numbers only,
when the split pays; no torch, no device.
"""

from __future__ import annotations

# Decode rows x their longest context below which a mixed step keeps them in the prefill
# kernel. The split saves GPU time from about 16k up (benchmarks/mixed_step.py, H200,
# Llama-3-8B attention: 16 rows at 512 took 0.20 ms split vs 0.17 whole; 16 at 2048, 0.21
# vs 0.37; 64 at 2048, 0.21 vs 1.22 per layer), but costs two more kernel launches per
# layer on the CPU, which a small model's CPU-bound serving loop pays in full. Measured on
# one H200 (docs/benchmark_journal.md): from 16k, one colocated Llama-3.2-1B worker served 48
# req/s against 72 unsplit, and its closed decode loop (benchmarks/serving_loop.py) lost
# 6-7%; from 128k, 60 and 60 twice. The Llama-3-8B loop, whose steps are GPU-bound, gained
# 14% (128 requests) and 45% (256) from 16k: its mixed steps' GPU time halved.
MIXED_SPLIT_MIN_CONTEXT_TOKENS = 128 * 1024  # small models: the CPU-bound loop
MIXED_SPLIT_MIN_CONTEXT_TOKENS_WIDE = 16 * 1024  # hidden size >= 4096: the GPU-bound loop
WIDE_HIDDEN_SIZE = 4096


def mixed_split_threshold(hidden_size: int) -> int:
    """Pure policy: from how many decode context tokens a model's mixed steps are split.

    Wide models (the 8B shape and up) spend long enough on the GPU per step that the
    split's GPU saving counts; narrower ones are bound by the host, which the split's extra
    launches cost. Two shapes measured, one on each side of the line."""
    return (MIXED_SPLIT_MIN_CONTEXT_TOKENS_WIDE if hidden_size >= WIDE_HIDDEN_SIZE
            else MIXED_SPLIT_MIN_CONTEXT_TOKENS)


def split_mixed_step(num_decode_rows: int, max_decode_context: int,
                     min_tokens: int = MIXED_SPLIT_MIN_CONTEXT_TOKENS) -> bool:
    """Pure policy: do a mixed step's leading decode rows get the decode kernel?"""
    return num_decode_rows * max_decode_context >= min_tokens

