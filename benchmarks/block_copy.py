"""The KV block copy kernel: variants of it beside a contiguous copy, and its launch's host cost.

A mapped KV transfer on CUDA (kv_transfer/mapped_copy.py) moves a request's blocks from
the prefill worker's pool into the decode worker's with one kernel per layer range
(engine/kernels/block_copy.py: program (unit, part) copies part of one layer's K or V of
one block). Between two processes on one H200 that path reached 55-68% of a raw cuda_ipc
copy at 256 MiB-1 GiB (docs/benchmark_journal.md): the kernel itself moved bytes at about half
the rate of a contiguous device copy. This script times, in one process, on one pool
layout (Llama-3-8B: 32 layers, 8 KV heads of 128, 16-token blocks, bf16: 32 KiB per
block per layer for K and again for V; destination blocks shuffled in runs of 4):

  shipped          BlockCopier.launch, what the sender runs
  part P / w W     the same kernel with P-byte parts, W warps, no mask where P divides a block
  ... stream       the same with streaming cache hints (evict-first loads, .cs stores)
  persistent xM    132 x M programs, each looping over (unit, part) work items
  contiguous       one torch copy_ of as many contiguous bytes (the ceiling)

every variant checked bit for bit against the torch reference; and the host time of a
launch: back to back, after the thread idled 2 ms and 20 ms asleep (what a sender does
between transfers) or spinning (the CPU busy, the GPU idle), one launch over every layer
against one per layer (the layer-wise push).

    python -m benchmarks.block_copy --sizes-mib 16,64,256,1024      # on a GPU
    python -m benchmarks.block_copy --check-only                     # any machine: variants
                                                                      # against the reference
Output: markdown tables on stdout, progress on stderr. Times from CUDA events (medians).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # the interpreter runs the kernels; set before Triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.backend import import_triton  # noqa: E402
from engine.kernels.block_copy import BlockCopier, copy_blocks_reference  # noqa: E402

triton, tl, _ = import_triton()

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
UNIT_BYTES = BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # one block of one layer's K (or V), bf16


@triton.jit
def _parts_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_blocks, src_unit_stride,
                  dst_unit_stride, block_elems, PART: tl.constexpr, EVEN: tl.constexpr,
                  STREAM: tl.constexpr):
    unit = tl.program_id(0)
    part = tl.program_id(1)
    i = unit % num_blocks
    layer_kv = (unit // num_blocks).to(tl.int64)
    src = src_ptr + layer_kv * src_unit_stride + tl.load(src_ids_ptr + i).to(tl.int64) * block_elems
    dst = dst_ptr + layer_kv * dst_unit_stride + tl.load(dst_ids_ptr + i).to(tl.int64) * block_elems
    offs = part * PART + tl.arange(0, PART)
    mask = None if EVEN else offs < block_elems
    if STREAM:
        x = tl.load(src + offs, mask=mask, eviction_policy="evict_first")
        tl.store(dst + offs, x, mask=mask, cache_modifier=".cs")
    else:
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def _persistent_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, num_blocks, src_unit_stride,
                       dst_unit_stride, block_elems, num_items, num_parts,
                       PART: tl.constexpr):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        unit = item // num_parts
        i = unit % num_blocks
        layer_kv = (unit // num_blocks).to(tl.int64)
        src = (src_ptr + layer_kv * src_unit_stride
               + tl.load(src_ids_ptr + i).to(tl.int64) * block_elems)
        dst = (dst_ptr + layer_kv * dst_unit_stride
               + tl.load(dst_ids_ptr + i).to(tl.int64) * block_elems)
        offs = (item % num_parts) * PART + tl.arange(0, PART)
        tl.store(dst + offs, tl.load(src + offs))


def variants(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
             num_sms: int, quick: bool) -> dict[str, Callable[[], None]]:
    """Each variant as a call copying `src_ids` -> `dst_ids` over every layer."""
    copier = BlockCopier(src, dst)
    sw, dw = src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32)
    elems = UNIT_BYTES // 4
    src_stride, dst_stride = src.shape[2] * elems, dst.shape[2] * elems
    n = src_ids.shape[0]
    units = LAYERS * 2 * n
    out: dict[str, Callable[[], None]] = {
        "shipped": lambda: copier.launch(src_ids, dst_ids, range(LAYERS))}

    def parts(part_bytes: int, warps: int, stream: bool) -> Callable[[], None]:
        part = part_bytes // 4
        grid = (units, triton.cdiv(elems, part))
        return lambda: _parts_kernel[grid](sw, dw, src_ids, dst_ids, n, src_stride, dst_stride,
                                           elems, PART=part, EVEN=elems % part == 0,
                                           STREAM=stream, num_warps=warps)

    def persistent(mult: int, part_bytes: int, warps: int) -> Callable[[], None]:
        part = part_bytes // 4
        num_parts = elems // part
        grid = (min(units * num_parts, num_sms * mult),)
        return lambda: _persistent_kernel[grid](sw, dw, src_ids, dst_ids, n, src_stride,
                                                dst_stride, elems, units * num_parts,
                                                num_parts, PART=part, num_warps=warps)

    shapes = [(16384, 4), (32768, 8)] if quick else [(8192, 4), (16384, 4), (16384, 8),
                                                       (32768, 4), (32768, 8)]
    for part_bytes, warps in shapes:
        out[f"part {part_bytes // 1024} KiB / w{warps}"] = parts(part_bytes, warps, False)
        out[f"part {part_bytes // 1024} KiB / w{warps} stream"] = parts(part_bytes, warps, True)
    for mult, part_bytes, warps in ([(4, 16384, 4)] if quick else
                                    [(4, 16384, 4), (8, 16384, 4), (4, 32768, 8)]):
        out[f"persistent x{mult} {part_bytes // 1024} KiB / w{warps}"] = \
            persistent(mult, part_bytes, warps)
    return out


def pools(num_blocks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Source and destination pools (2n + 8 blocks each), the source blocks 0..n-1 and n
    destination blocks from n on, shuffled in runs of 4."""
    shape = (LAYERS, 2, 2 * num_blocks + 8, BLOCK_TOKENS, HEADS, HEAD_DIM)
    src = torch.randint(-30000, 30000, shape, dtype=torch.int16, device=device)
    src = src.view(torch.bfloat16)
    dst = torch.zeros_like(src)
    runs = [list(range(s, s + 4)) for s in range(num_blocks, 2 * num_blocks, 4)]
    random.Random(num_blocks).shuffle(runs)
    dst_ids = [b for run in runs for b in run][:num_blocks]
    return (src, dst, torch.arange(num_blocks, dtype=torch.int32, device=device),
            torch.tensor(dst_ids, dtype=torch.int32, device=device))


def event_time(fn: Callable[[], None], repeats: int) -> float:
    """Median device time of `fn` in microseconds (after one untimed call)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def check(fn: Callable[[], None], src: torch.Tensor, dst: torch.Tensor,
          src_ids: torch.Tensor, dst_ids: torch.Tensor) -> bool:
    """The variant's copy equals the reference's, and nothing else of `dst` was written."""
    dst.zero_()
    fn()
    expected = torch.zeros_like(dst)
    copy_blocks_reference(src, expected, src_ids.long(), dst_ids.long(), range(LAYERS))
    return torch.equal(dst.view(torch.int16), expected.view(torch.int16))


def launch_costs(device: torch.device, repeats: int) -> list[str]:
    """Host microseconds per launch (medians), hot and after idling, and per layer."""
    src, dst, src_ids, dst_ids = pools(8, device)
    copier = BlockCopier(src, dst)
    a = torch.empty(1 << 20, device=device)
    b = torch.empty_like(a)
    # Idle by sleeping (the thread's core may drop into a sleep state) or by spinning (the
    # core stays busy, only the GPU idles): which of the two idles makes a launch slow.
    idles = ((0.0, False), (0.002, False), (0.02, False), (0.002, True), (0.02, True))
    rows = ["| launch | back to back | after 2 ms asleep | after 20 ms asleep "
            "| after 2 ms spinning | after 20 ms spinning |",
            "|---|---:|---:|---:|---:|---:|"]
    cases: dict[str, Callable[[], None]] = {
        "BlockCopier, all 32 layers in one": lambda: copier.launch(src_ids, dst_ids,
                                                                   range(LAYERS)),
        "BlockCopier, one per layer (x32), per launch": lambda: [
            copier.launch(src_ids, dst_ids, range(layer, layer + 1)) for layer in range(LAYERS)],
        "torch copy_ of 4 MiB": lambda: b.copy_(a),
    }
    for name, fn in cases.items():
        per = 32 if "x32" in name else 1
        cells = []
        for idle, spin in idles:
            times = []
            for i in range(repeats):
                if idle and spin:
                    until = time.perf_counter() + idle
                    while time.perf_counter() < until:
                        pass
                elif idle:
                    time.sleep(idle)
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) / per * 1e6)
                if i % 8 == 7:
                    torch.cuda.synchronize()
            cells.append(f"{statistics.median(times[4:]):.1f} µs")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
        print(f"   launch cost: {name} done", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="16,64,256,1024",
                        help="comma-separated transfer sizes in MiB, each a multiple of 2 "
                             "(one block of every layer's K and V is 2 MiB; default "
                             "%(default)s)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed calls per variant and size; the median is reported "
                             "(default %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer variants (two tile shapes, one persistent grid)")
    parser.add_argument("--check-only", action="store_true",
                        help="only check every variant against the reference on an 8-block "
                             "copy (on a machine without CUDA through Triton's interpreter: "
                             "TRITON_INTERPRET=1 is set when no GPU is found)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes_mib.split(",")]
    except ValueError:
        parser.error("--sizes-mib takes comma-separated integers")
    if any(s < 2 or s % 2 for s in sizes) or args.repeats < 1:
        parser.error("sizes must be positive multiples of 2 MiB and repeats >= 1")
    cuda = torch.cuda.is_available()
    if not cuda and not args.check_only:
        parser.error("timing needs a CUDA device; --check-only runs anywhere")
    device = torch.device("cuda" if cuda else "cpu")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    if args.check_only:
        src, dst, src_ids, dst_ids = pools(8, device)
        bad = [name for name, fn in variants(src, dst, src_ids, dst_ids, num_sms,
                                             args.quick).items()
               if not check(fn, src, dst, src_ids, dst_ids)]
        print("every variant copies exactly the reference's bytes" if not bad
              else f"variants that differ from the reference: {bad}")
        return 1 if bad else 0
    table: dict[str, dict[int, str]] = {}
    for mib in sizes:
        num_blocks = mib // 2
        src, dst, src_ids, dst_ids = pools(num_blocks, device)
        num_bytes = num_blocks * LAYERS * 2 * UNIT_BYTES
        for name, fn in variants(src, dst, src_ids, dst_ids, num_sms, args.quick).items():
            ok = check(fn, src, dst, src_ids, dst_ids)
            us = event_time(fn, args.repeats)
            table.setdefault(name, {})[mib] = (f"{num_bytes / us / 1e3:.0f}"
                                               + ("" if ok else " WRONG"))
        flat_src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        flat_dst = torch.empty_like(flat_src)
        us = event_time(lambda: flat_dst.copy_(flat_src), args.repeats)
        table.setdefault("contiguous copy_", {})[mib] = f"{num_bytes / us / 1e3:.0f}"
        del src, dst, flat_src, flat_dst
        torch.cuda.empty_cache()
        print(f"   {mib} MiB done", file=sys.stderr)
    print("| variant | " + " | ".join(f"{m} MiB" for m in sizes) + " |  GB/s")
    print("|---|" + "---:|" * len(sizes))
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells[m] for m in sizes) + " |")
    print()
    print("\n".join(launch_costs(device, max(args.repeats, 40))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
