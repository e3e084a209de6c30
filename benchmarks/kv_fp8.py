"""An FP8 KV cache against the model dtype's, side by side in one process, same weights.

For each pool dtype: how many blocks `plan_for_model` gives it in the same share of the
GPU (the capacity the FP8 pool buys), then one decode step (ModelRunner.execute, CUDA-graph
replay, logits included, synced) at each batch over a cached context, and how far its
logits are from the model-dtype pool's on the same step (relative L2, and whether the
greedy tokens agree). The cached context is the same random K/V in both pools (N(0, 1),
drawn per layer from one seed; the FP8 pool holds it quantized), so both steps read
their real number of bytes. Where batch x context is more than the model-dtype pool can hold
on the GPU, both pools get that pool's planned number of blocks and the rows past it read
the blocks of the first rows again (stated in the output): the distinct bytes read per step
stay tens of GiB, far past the L2 cache, so the step still reads from HBM.

    python -m benchmarks.kv_fp8 --shape llama3-8b --device cuda --batches 1 64 256 --context 2048
    python -m benchmarks.kv_fp8 --shape tiny --device cpu --batches 1 4 --context 64

Random weights in the shape's real dimensions (benchmarks/engine_gpu_model.py's builder).
Output: one markdown table on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from benchmarks.engine_gpu_model import (BLOCK_SIZE, build_random_model, decode_schedule,
                                         time_ms)
from testing.shapes import SHAPES


def _log(message: str) -> None:
    print(f"[kv_fp8] {message}", file=sys.stderr, flush=True)


def _runner(model, kv_dtype: torch.dtype, num_blocks: int, device: torch.device,
            batches: list[int]):
    from engine.kv_storage import KVStorage
    from engine.model_runner import ModelRunner

    kv = KVStorage.for_model(model.config, num_blocks, BLOCK_SIZE, kv_dtype, device)
    graphs = tuple(batches) if device.type == "cuda" else ()
    return ModelRunner(model, kv, BLOCK_SIZE, cuda_graph_batch_sizes=graphs)


def _fill(kv, num_blocks: int, dtype: torch.dtype) -> None:
    """The same N(0, 1) K/V in blocks [0, num_blocks) of every layer, whatever the pool's
    dtype (an FP8 pool holds it quantized, engine/kv_quant.py)."""
    from engine.kv_quant import QuantizedCache, quantize

    device = kv.kv.device
    gen = torch.Generator(device=device).manual_seed(1)
    for layer in range(kv.layout.num_layers):
        for cache in kv.layer(layer):
            shape = (num_blocks, *(cache.values if isinstance(cache, QuantizedCache)
                                   else cache).shape[1:])
            x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
            if isinstance(cache, QuantizedCache):
                values, scales = quantize(x)
                cache.values[:num_blocks], cache.scales[:num_blocks] = values, scales
            else:
                cache[:num_blocks] = x


def _planned_blocks(model, kv_dtype: torch.dtype, fraction: float, batches: list[int]) -> int:
    from engine.memory_plan import plan_for_model

    plan = plan_for_model(model, BLOCK_SIZE, kv_dtype, fraction, 2048, max(batches))
    _log(f"{kv_dtype}: {plan.report()}")
    return plan.num_kv_blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_fp8", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES),
                        help="the model's dimensions (random weights)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128],
                        help="decode batch sizes")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens already cached per sequence")
    parser.add_argument("--fraction", type=float, default=0.9,
                        help="CUDA: the share of the GPU each pool is planned in")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_random_model(SHAPES[args.shape], seed=0, device=device, dtype=dtype)
    per_seq = -(-args.context // BLOCK_SIZE)
    needed = max(args.batches) * per_seq
    rows = []
    baseline: dict[int, torch.Tensor] = {}
    for kv_dtype in (dtype, torch.float8_e4m3fn):
        planned = (_planned_blocks(model, kv_dtype, args.fraction, args.batches)
                   if device.type == "cuda" else None)
        if kv_dtype == dtype and planned is not None and planned < needed:
            _log(f"{needed} blocks needed, {planned} fit: rows past {planned // per_seq} "
                 f"re-read the first rows' blocks")
            needed = planned
        runner = _runner(model, kv_dtype, needed, device, args.batches)
        for batch in args.batches:
            schedule = decode_schedule(batch, args.context, per_seq, needed)
            _fill(runner.kv, needed, dtype)
            logits = runner.execute(schedule).float().cpu()  # before the timing rewrites it
            ms = time_ms(lambda: runner.execute(schedule), device, warmup=3, reps=20)
            if kv_dtype == dtype:
                baseline[batch] = logits
                error, same = 0.0, 1.0
            else:
                ref = baseline[batch]
                error = float((logits - ref).norm() / ref.norm())
                same = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
            rows.append((str(kv_dtype).removeprefix("torch."), planned, batch, ms, error, same))
            _log(f"{kv_dtype} batch {batch}: {ms:.3f} ms, logits error {error:.2e}")
        del runner
        gc.collect()  # the runner's CUDA graphs and pool sit in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"| KV dtype | blocks planned | batch | decode step ms (ctx {args.context}) "
          f"| over {str(dtype).removeprefix('torch.')} | logits rel. error | same argmax |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_ms = {r[2]: r[3] for r in rows if r[0] == str(dtype).removeprefix("torch.")}
    for name, planned, batch, ms, error, same in rows:
        print(f"| {name} | {planned if planned is not None else '-'} | {batch} | {ms:.3f} | "
              f"{ms / base_ms[batch]:.2f}x | {error:.2e} | {same:.0%} |")
    print(f"\n{needed} distinct blocks of {BLOCK_SIZE} tokens in each pool during the steps "
          f"({max(args.batches) * per_seq} asked by the largest batch).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
