"""Small-batch linear layers: the gemv kernel against cuBLAS (F.linear), side by side.

Two parts, in one run on a CUDA device:

1. Each linear layer of a shape (fused q/k/v, o, fused gate/up, down, the vocabulary
   projection) at 1, 2, 4 and 8 rows, timed inside a CUDA graph as a decode step runs it.
   Every call reads a different copy of the weight (more copies than the L2 holds), so
   the weight comes from HBM as in a real step. Floor: the weight's bytes at the measured
   read+write copy rate. `--sweep` also times other tiles of the kernel.
2. The whole decode step (`ModelRunner.execute`, CUDA-graph replay, logits included) on
   random weights, with the kernel off (GEMV_MAX_ROWS = 0: cuBLAS everywhere) and on,
   alternating, at batch 1, 2, 4 and 8 and 512 / 2048 tokens of context.

    python benchmarks/gemv.py --shapes llama3-8b,llama3-1b [--sweep] [--steps]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROW_COUNTS = (1, 2, 4, 8)
L2_BYTES = 60 << 20  # H100/H200: 50-60 MiB; copies of the weight fill several times this


def layer_shapes(config) -> list[tuple[str, int, int]]:
    """(name, n, k) of every linear layer of one decoder layer, and the vocabulary head."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * config.intermediate_size, h),
            ("down", h, config.intermediate_size), ("lm_head", config.vocab_size, h)]


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


def layers_table(torch, shape: str, config, copy_rate: float, sweep: bool) -> list[str]:
    import torch.nn.functional as F

    from engine.kernels.gemv import DEFAULT_TILE, GemvConfig, gemv_config, gemv_triton

    rows = []
    for name, n, k in layer_shapes(config):
        nbytes = n * k * 2
        copies = max(4, -(-3 * L2_BYTES // nbytes))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                   for _ in range(copies)]
        floor = nbytes / copy_rate * 1e6
        for m in ROW_COUNTS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            err = (gemv_triton(x, weights[0]).float() - F.linear(x, weights[0]).float()).abs().max()
            cublas = graph_us(torch, [lambda w=w: torch.mm(x, w.t(), out=out)
                                      for w in weights])

            def gemv_us(cfg: GemvConfig) -> float:
                return graph_us(torch, [lambda w=w: gemv_triton(x, w, out=out, config=cfg)
                                        for w in weights])

            shipped = gemv_config(n, k) or DEFAULT_TILE
            default_us = gemv_us(shipped)  # the tile the model runs: must work
            best = (default_us, shipped)
            tiles = [GemvConfig(bn, bk, nw, ns) for bn in (16, 32, 64) for bk in (128, 256, 512)
                     for nw in (4, 8) for ns in (3, 4, 6)] if sweep else []
            for cfg in tiles:
                try:
                    us = gemv_us(cfg)
                except Exception as exc:  # e.g. a tile that needs more shared memory than exists
                    print(f"  {name} m={m} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                best = min(best, (us, cfg), key=lambda pair: pair[0])
            row = (f"| {shape} | {name} {n}x{k} | {m} | {cublas:.1f} | {default_us:.1f} | "
                   f"{floor:.1f} | {100 * floor / cublas:.0f}% | {100 * floor / default_us:.0f}% | "
                   f"{cublas / default_us:.2f}x | {err:.1e} | "
                   f"{'gemv' if gemv_config(n, k) else 'cuBLAS'} |")
            if sweep:
                row += f" {best[0]:.1f} {best[1]} |"
            print(row, flush=True)
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def steps_table(torch, shape: str, config, seed: int, copy_rate: float) -> list[str]:
    from benchmarks.engine_gpu_model import (build_random_model, decode_schedule, kv_bytes,
                                             time_ms, weight_bytes_per_step)
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
    for label, max_rows in (("cuBLAS", 0), ("gemv", gemv.GEMV_MAX_ROWS)):
        gemv.GEMV_MAX_ROWS = max_rows  # read at capture: each runner's graphs keep theirs
        runners[label] = ModelRunner(model, kv, block, cuda_graph_batch_sizes=batches)
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
            base, ours = statistics.median(ms["cuBLAS"]), statistics.median(ms["gemv"])
            floor = 1000 * (weights + kv_bytes(config, batch * context, 2)) / copy_rate
            row = (f"| {shape} | {batch} | {context} | {base:.2f} | {ours:.2f} | {floor:.2f} | "
                   f"{100 * floor / base:.0f}% | {100 * floor / ours:.0f}% | {base / ours:.2f}x |")
            print(row, flush=True)
            rows.append(row)
    del runners, kv, model
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama3-8b,llama3-1b",
                        help="comma-separated shapes of benchmarks/shapes.py")
    parser.add_argument("--sweep", action="store_true", help="also time other kernel tiles")
    parser.add_argument("--steps", action="store_true", help="also time whole decode steps")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    import torch

    from benchmarks.engine_gpu_kernels import measure_floors
    from benchmarks.shapes import SHAPES

    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the kernel's CPU tests are in tests/gpu)")
    started = time.perf_counter()
    copy_rate = measure_floors().copy_bytes_per_s
    print(f"device: {torch.cuda.get_device_name()}  copy rate {copy_rate / 1e12:.2f} TB/s",
          flush=True)
    print("| shape | layer n x k | rows | cuBLAS us | gemv us | floor us | cuBLAS % of floor "
          "| gemv % of floor | speed-up | max abs diff | the model uses |" + (" best tile |" if args.sweep else ""))
    for shape in args.shapes.split(","):
        layers_table(torch, shape, SHAPES[shape], copy_rate, args.sweep)
    if args.steps:
        print("\n| shape | batch | context | cuBLAS step ms | gemv step ms | floor ms "
              "| cuBLAS % of floor | gemv % of floor | speed-up |")
        for shape in args.shapes.split(","):
            steps_table(torch, shape, SHAPES[shape], args.seed, copy_rate)
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
