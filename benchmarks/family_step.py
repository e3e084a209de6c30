"""Model families side by side: the same decode and prefill steps of several shapes, each
against its own floor, in one process on one device (e.g. Qwen3-8B beside Llama-3-8B: the
per-head q/k norms and the wider vocabulary against the same engine).

Per shape: random bf16 weights (benchmarks/engine_gpu_model.py), the runner's default path
(Triton kernels, decode steps replayed from CUDA graphs), decode at each batch with
`--context` tokens cached, and one 1 x 2048 prefill. Floors as benchmarks/step_floor.py's:
decode = (weights but the embedding table + the batch's KV) / measured copy rate; prefill =
matmul FLOPs / measured matmul rate. The last column sets each shape's share of its floor
against the first shape's.

    python -m benchmarks.family_step --shapes llama3-8b,qwen3-8b --batches 1,64,256
    python -m benchmarks.family_step --shapes tiny,tiny-moe --batches 1,4 --context 32  # CPU

Output: a markdown table on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

from benchmarks.engine_gpu_model import build_random_model
from benchmarks.step_floor import Step, StepRig, floor_rates


def log(message: str) -> None:
    print(f"[family_step] {message}", file=sys.stderr, flush=True)


def measure_shape(shape: str, batches: list[int], context: int, kv_gib: float,
                  copy_rate: float, matmul_rate: float, device, dtype) -> list[Step]:
    """(case, ms, floor ms) per decode batch and the prefill."""
    from testing.shapes import SHAPES

    config = SHAPES[shape]
    rig = StepRig.build(build_random_model(config, 0, device, dtype), config, batches,
                        context, kv_gib, device, dtype)
    steps = rig.measure(copy_rate, matmul_rate, device, lambda line: log(f"{shape} {line}"))
    del rig
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama3-8b,qwen3-8b",
                        help="testing/shapes.py shapes, comma-separated; the first is the base")
    parser.add_argument("--batches", default="1,64,256", help="decode batch sizes")
    parser.add_argument("--context", type=int, default=512,
                        help="tokens of context each decode row attends to")
    parser.add_argument("--kv-gib", type=float, default=4.0,
                        help="KV pool size; rows share its blocks round-robin beyond it")
    args = parser.parse_args(argv)
    from testing.shapes import SHAPES

    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    batches = [int(b) for b in args.batches.split(",")]
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    copy_rate, matmul_rate = floor_rates(device)
    results = {s: measure_shape(s, batches, args.context, args.kv_gib, copy_rate, matmul_rate,
                                device, dtype) for s in shapes}
    name = torch.cuda.get_device_name() if on_cuda else "CPU (plumbing only)"
    print(f"{name}, {str(dtype).removeprefix('torch.')} random weights; copy "
          f"{copy_rate / 1e9:.0f} GB/s, matmul {matmul_rate / 1e12:.0f} TFLOP/s\n")
    print("| shape | step | ms | floor ms | % of floor | % of floor vs " + shapes[0] + " |")
    print("|---|---|---:|---:|---:|---:|")
    base = {case: floor / ms for case, ms, floor in results[shapes[0]]}
    for shape, rows in results.items():
        for case, ms, floor in rows:
            share = floor / ms
            print(f"| {shape} | {case} | {ms:.2f} | {floor:.2f} | {100 * share:.0f}% | "
                  f"{share / base[case]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
