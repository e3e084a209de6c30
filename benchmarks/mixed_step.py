"""A mixed step's attention: decode rows in the decode kernel vs in the prefill kernel.

A mixed step (the scheduler puts its decode rows first, then prefill chunks) used to run
every row through the chunked-prefill kernel; now its leading single-token chunks go to the
split-K decode kernel and the rest to the prefill kernel (engine/attention_kernels.py). This
times one layer's attention (`attend_cached_kernels`, the K/V already written) both ways, side by
side in one run, with CUDA events, at Llama-3-8B attention shapes (32 heads, 8 KV heads,
head dim 128, bf16, 16-token blocks) and every mix of `--decodes` rows at `--contexts`
tokens with one `--prefill`-token chunk; and checks the two agree.

    python -m benchmarks.mixed_step [--decodes 16 64 256] [--contexts 512 2048 8192]
        [--prefill 512] [--iters 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from engine.attention_kernels import attend_cached_kernels
from engine.attention_metadata import AttentionMetadata
from engine.schedule_output import ScheduledChunk, ScheduleOutput

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def schedule(num_decodes: int, context: int, prefill: int) -> tuple[ScheduleOutput, int]:
    chunks, next_block = [], 0
    for i in range(num_decodes):
        blocks = tuple(range(next_block, next_block + -(-(context + 1) // BLOCK)))
        next_block += len(blocks)
        chunks.append(ScheduledChunk(f"d{i}", (1,), context, blocks, True))
    blocks = tuple(range(next_block, next_block + -(-prefill // BLOCK)))
    next_block += len(blocks)
    chunks.append(ScheduledChunk("p", tuple(range(prefill)), 0, blocks, True))
    return ScheduleOutput(tuple(chunks)), next_block


def time_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decodes", type=int, nargs="+", default=[16, 64, 256],
                        help="decode rows beside the prefill chunk (default 16 64 256)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192],
                        help="context tokens per decode row (default 512 2048 8192)")
    parser.add_argument("--prefill", type=int, default=512,
                        help="the prefill chunk's tokens (default 512)")
    parser.add_argument("--iters", type=int, default=50,
                        help="timed calls per case; the median is reported (default 50)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("mixed_step: needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    print(f"| decode rows | context | prefill tokens | prefill kernel for all, ms "
          f"| decode rows split off, ms | speedup |")
    print("|---|---|---|---|---|---|")
    for num_decodes in args.decodes:
        for context in args.contexts:
            sched, num_blocks = schedule(num_decodes, context, args.prefill)
            cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device,
                                dtype=dtype)
            q = torch.randn(num_decodes + args.prefill, HEADS, HEAD_DIM, device=device,
                            dtype=dtype)
            # Both ways, whatever split_mixed_step would choose at this size.
            meta = AttentionMetadata.from_schedule(sched, BLOCK, device, use_kernels=True,
                                                   num_kv_heads=KV_HEADS,
                                                   mixed_split_min_tokens=1).kernels
            assert meta is not None and meta.num_decode_chunks == num_decodes
            whole = dataclasses.replace(meta, num_decode_chunks=0, prefill_part=None)
            scale = HEAD_DIM ** -0.5
            split_out = attend_cached_kernels(q, cache[0], cache[1], meta, scale)
            whole_out = attend_cached_kernels(q, cache[0], cache[1], whole, scale)
            error = float((split_out.float() - whole_out.float()).norm()
                          / whole_out.float().norm())
            assert error < 2e-2, f"the two paths disagree by {error:.2e}"
            before = time_ms(lambda: attend_cached_kernels(q, cache[0], cache[1], whole,
                                                           scale), args.iters)
            after = time_ms(lambda: attend_cached_kernels(q, cache[0], cache[1], meta,
                                                          scale), args.iters)
            print(f"| {num_decodes} | {context} | {args.prefill} | {before:.3f} | "
                  f"{after:.3f} | {before / after:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
