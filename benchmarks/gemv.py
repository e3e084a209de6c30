"""Small-batch linear layers: the gemv kernel against cuBLAS (F.linear), side by side.

Two parts, in one run on a CUDA device:

1. Each linear layer of a shape (fused q/k/v, o, fused gate/up, down, the vocabulary
   projection) at 1, 2, 4 and 8 rows, timed inside a CUDA graph as a decode step runs it.
   Every call reads a different copy of the weight (more copies than the L2 holds), so
   the weight comes from HBM as in a real step. Floor: the weight's bytes at the measured
   read+write copy rate. `--sweep` also times other tiles of the kernel.
2. The whole decode step (`ModelRunner.execute`, CUDA-graph replay, logits included) on
   random weights, with the kernel off (GEMV_MAX_ROWS = 0: cuBLAS everywhere), with the
   tiles of 2026-12-02 (no split-K) and with today's, alternating in one process, at
   batch 1, 2, 4 and 8 and 512 / 2048 tokens of context.

    python benchmarks/gemv.py --shapes llama3-8b,llama3-1b [--sweep] [--steps] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROW_COUNTS = (1, 2, 4, 8)
L2_BYTES = 60 << 20  # H100/H200: 50-60 MiB; copies of the weight fill several times this


LAYER_NAMES = ("qkv", "o", "gate_up", "down", "lm_head")  # linear_shapes_of's order


def layer_shapes(config) -> list[tuple[str, int, int]]:
    """(name, n, k) of every linear layer of one decoder layer, and the vocabulary head."""
    from engine.models.llama import LlamaForCausalLM

    return [(name, n, k) for name, (n, k) in
            zip(LAYER_NAMES, LlamaForCausalLM.linear_shapes_of(config), strict=True)]


def graph_us(torch, calls, reps: int = 10) -> float:
    """Per-call device time of `calls` (a list of thunks) replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up outside the capture (compiles, picks cuBLAS algorithms)
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(samples)


SWEEP_SHAPES = ((16, 256, 4), (16, 512, 3), (32, 256, 4), (32, 512, 3), (64, 128, 4),
                (64, 256, 3))  # (block_n, block_k, num_stages) tried with each warp count
SWEEP_SPLITS = (1, 2, 4, 8)


def sweep_tiles() -> list:
    from engine.kernels.gemv import GemvConfig

    return [GemvConfig(bn, bk, nw, ns, sk) for bn, bk, ns in SWEEP_SHAPES for nw in (4, 8)
            for sk in SWEEP_SPLITS]


def layers_table(torch, shape: str, config, copy_rate: float, sweep: bool,
                 layers: set[str] | None) -> list[str]:
    import torch.nn.functional as F

    from engine.kernels.gemv import (DEFAULT_TILE, ROWS, GemvConfig, GemvWorkspace, gemv_config,
                                     gemv_triton)

    rows = []
    for name, n, k in layer_shapes(config):
        if layers is not None and name not in layers:
            continue
        nbytes = n * k * 2
        copies = max(4, -(-3 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        workspace = GemvWorkspace("cuda", max(SWEEP_SPLITS) * ROWS * n, -(-n // 16))
        floor = nbytes / copy_rate * 1e6
        for m in ROW_COUNTS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            shipped = gemv_config(n, k) or DEFAULT_TILE
            got = gemv_triton(x, weights[0], config=shipped, workspace=workspace)
            err = (got.float() - F.linear(x, weights[0]).float()).abs().max()
            cublas = graph_us(torch, [lambda w=w: torch.mm(x, w.t(), out=out)
                                      for w in weights])

            def gemv_us(cfg: GemvConfig) -> float:
                return graph_us(torch, [lambda w=w: gemv_triton(
                    x, w, out=out, config=cfg, workspace=workspace) for w in weights])

            default_us = gemv_us(shipped)  # the tile the model runs: must work
            best = (default_us, shipped)
            for cfg in (sweep_tiles() if sweep else []):
                try:
                    us = gemv_us(cfg)
                except Exception as exc:  # e.g. a tile that needs more shared memory than exists
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                print(f"  tile {shape} {name} m={m} {us:.1f} us {cfg}", flush=True)
                best = min(best, (us, cfg), key=lambda pair: pair[0])
            row = (f"| {shape} | {name} {n}x{k} | {m} | {cublas:.1f} | {default_us:.1f} | "
                   f"{floor:.1f} | {100 * floor / cublas:.0f}% | {100 * floor / default_us:.0f}% | "
                   f"{cublas / default_us:.2f}x | {err:.1e} | "
                   f"{'gemv' if gemv_config(n, k) else 'cuBLAS'} |")
            if sweep:
                row += f" {best[0]:.1f} {best[1]} |"
            print(row, flush=True)
            rows.append(row)
        del weights, workspace
        torch.cuda.empty_cache()
    return rows


def tiles_of_12_02(n: int, k: int):
    """The shape policy shipped on 2026-12-02 (no split-K): the baseline of --steps."""
    from engine.kernels.gemv import DEFAULT_TILE, GemvConfig

    if n >= 32768:
        return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if min(n, k) < 4096 or n >= 2 * k:
        return None
    if k >= 2 * n or n == k:
        return GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
    return DEFAULT_TILE


def steps_table(torch, shape: str, config, seed: int, copy_rate: float) -> list[str]:
    from benchmarks.engine_gpu_model import (build_random_model, decode_schedule, kv_bytes, time_ms,
                                             weight_bytes_per_step)
    from engine.kernels import gemv
    from engine.kv_storage import KVStorage
    from engine.model_runner import ModelRunner

    device = torch.device("cuda")
    model = build_random_model(config, seed, device, torch.bfloat16)
    batches, contexts = (1, 2, 4, 8), (512, 2048)
    block = 16
    kv = KVStorage.for_model(config, max(batches) * max(contexts) // block + 1, block,
                             torch.bfloat16, device)
    runners = {}
    shipped = gemv.gemv_config
    policies = (("cuBLAS", 0, shipped), ("gemv 12-02", gemv.GEMV_MAX_ROWS, tiles_of_12_02),
                ("gemv", gemv.GEMV_MAX_ROWS, shipped))
    for label, max_rows, policy in policies:
        # Read at capture: each runner's graphs keep the tiles they were captured with.
        gemv.GEMV_MAX_ROWS, gemv.gemv_config = max_rows, policy
        runners[label] = ModelRunner(model, kv, block, cuda_graph_batch_sizes=batches)
    gemv.GEMV_MAX_ROWS, gemv.gemv_config = policies[-1][1], shipped
    weights = weight_bytes_per_step(model)
    rows = []
    for batch in batches:
        for context in contexts:
            schedule = decode_schedule(batch, context, -(-context // block))
            ms = {label: [] for label in runners}
            for _ in range(3):  # alternate, so drift hits both alike
                for label, runner in runners.items():
                    ms[label].append(time_ms(lambda r=runner: r.execute(schedule), device,
                                             warmup=3, reps=20))
            base, before, ours = (statistics.median(ms[label]) for label in runners)
            floor = 1000 * (weights + kv_bytes(config, batch * context, 2)) / copy_rate
            row = (f"| {shape} | {batch} | {context} | {base:.2f} | {before:.2f} | {ours:.2f} | "
                   f"{floor:.2f} | {100 * floor / base:.0f}% / {100 * floor / before:.0f}% / "
                   f"{100 * floor / ours:.0f}% | {before / ours:.3f}x |")
            print(row, flush=True)
            rows.append(row)
    del runners, kv, model
    torch.cuda.empty_cache()
    return rows


def breakdown(torch, config, seed: int) -> None:
    """The kernels of one decode step at batch 1 and 512 tokens of context, by device time."""
    from benchmarks.engine_gpu_model import ModelResults, build_random_model, decode_breakdown
    from engine.kv_storage import KVStorage

    model = build_random_model(config, seed, torch.device("cuda"), torch.bfloat16)
    kv = KVStorage.for_model(config, 64, 16, torch.bfloat16, torch.device("cuda"))
    decode_breakdown(model, kv, ModelResults(), batch=1, context=512)
    del model, kv
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b,llama3-1b",
                        help="comma-separated shapes of testing/shapes.py")
    parser.add_argument("--sweep", action="store_true",
                        help="also time other kernel tiles (each printed, the best in the table)")
    parser.add_argument("--layers", default=None,
                        help="comma-separated layers to time (qkv,o,gate_up,down,lm_head; "
                             "default all)")
    parser.add_argument("--no-layers", action="store_true", help="skip the per-layer table")
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps")
    parser.add_argument("--breakdown", action="store_true",
                        help="also list the kernels of one batch-1 decode step by device time")
    parser.add_argument("--seed", type=int, default=1, help="random weights' seed (default 1)")
    args = parser.parse_args(argv)

    import torch

    from benchmarks.engine_gpu_kernels import measure_floors
    from testing.shapes import SHAPES

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the kernel's CPU tests are in tests/gpu)")
    started = time.perf_counter()
    copy_rate = measure_floors().copy_bytes_per_s
    print(f"device: {torch.cuda.get_device_name()}  copy rate {copy_rate / 1e12:.2f} TB/s",
          flush=True)
    print("| shape | layer n x k | rows | cuBLAS us | gemv us | floor us | cuBLAS % of floor "
          "| gemv % of floor | speed-up | max abs diff | the model uses |" + (" best tile |" if args.sweep else ""))
    layers = set(args.layers.split(",")) if args.layers else None
    for shape in ([] if args.no_layers else args.shapes.split(",")):
        layers_table(torch, shape, SHAPES[shape], copy_rate, args.sweep, layers)
    if args.steps:
        print("\n| shape | batch | context | cuBLAS step ms | gemv 12-02 ms | gemv ms | floor ms "
              "| % of floor (cuBLAS / 12-02 / now) | now vs 12-02 |")
        for shape in args.shapes.split(","):
            steps_table(torch, shape, SHAPES[shape], args.seed, copy_rate)
    if args.breakdown:
        for shape in args.shapes.split(","):
            breakdown(torch, SHAPES[shape], args.seed)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
