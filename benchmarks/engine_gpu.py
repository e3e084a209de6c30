"""GPU engine benchmark: kernel correctness, kernel speed against the hardware floor, and
(once the model runner lands) model-level decode/prefill speed against `transformers`.

    python benchmarks/engine_gpu.py [--kernels-only] [--shape llama3-8b] [--markdown PATH]

Sections, in one run:
  1. correctness  every Triton kernel on fresh random inputs (a new seed each run, printed),
                  outputs poisoned with NaN first, compared with its torch reference;
  2. floors       a device-to-device copy (bytes/s, read + write counted) and a bf16 matmul
                  (FLOP/s) measured on this device, now;
  3. kernels      each kernel's median time beside its floor: the bytes it must move at the
                  measured copy rate (or, for prefill attention, its FLOPs at the matmul rate);
  4. model        decode and prefill steps of a Llama-3-8B-shaped model with random bf16
                  weights beside their floors and `transformers` (benchmarks/engine_gpu_model.py),
                  inside --time-budget-s.

Without a CUDA device, section 1 runs under Triton's interpreter in fp32 on small shapes (bf16
is wrong there), sections 2-3 are skipped and section 4 runs the torch path on a toy shape:
it checks the plumbing, it measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.engine_gpu_kernels import CheckResult, Floors, TimingResult

def model_section(args: argparse.Namespace, floors: Floors | None, seed: int,
                  device_name: str) -> list[str]:
    """Section 4 (benchmarks/engine_gpu_model.py); markdown lines, never raises."""
    shape = args.model_shape or ("llama3-8b" if floors is not None else "tiny")
    # Without a device there is no floor to measure: nominal rates keep the arithmetic
    # running, and the table says so.
    copy_rate = floors.copy_bytes_per_s if floors else 1e11
    matmul_rate = floors.matmul_flop_per_s if floors else 1e12
    return run_model_section(shape, seed, copy_rate, matmul_rate, args.time_budget_s,
                             device_name)


def run_model_section(shape: str, seed: int, copy_rate: float, matmul_rate: float,
                      time_budget_s: float, device_name: str) -> list[str]:
    """Ours and transformers at one shape inside the time budget; markdown lines, never
    raises."""
    import torch

    from benchmarks.engine_gpu_baseline import (run_transformers_compiled, run_transformers_eager,
                                                to_transformers)
    from benchmarks.engine_gpu_model import (ModelResults, build_random_model, guarded, log, render,
                                             run_ours, weight_bytes_per_step)
    from testing.shapes import SHAPES

    deadline = time.monotonic() + time_budget_s
    results = ModelResults()
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config = SHAPES[shape]
    small = {} if on_cuda else dict(batches=(1, 4), contexts=(32,), prefills=(1,))
    try:
        start = time.perf_counter()
        model = build_random_model(config, seed, device, dtype)
        log(f"built {shape} with random weights in {time.perf_counter() - start:.1f} s "
            f"({weight_bytes_per_step(model) / 1e9:.2f} GB read per step)")
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return ["### Model", "", f"- model construction failed: {exc}"]
    guarded("ours", results, lambda: run_ours(model, config, device, dtype, copy_rate,
                                                matmul_rate, results, **small))

    def eager() -> None:
        hf = to_transformers(model, config)
        run_transformers_eager(hf, config, device, results, deadline - 150, **small)

    guarded("transformers eager", results, eager)
    if on_cuda:
        del model
        torch.cuda.empty_cache()
        guarded("transformers compiled", results,
                lambda: run_transformers_compiled(shape, seed, results, deadline))
    else:
        results.notes.append("transformers compiled: skipped (no CUDA device)")
    return render(results, device_name)


def render_markdown(device_name: str, command: str, checks: list[CheckResult],
                    timings: list[TimingResult], floors: Floors | None,
                    model_rows: list[str]) -> str:
    lines = [f"## Engine GPU benchmark — {device_name}", "",
             f"- date: {datetime.date.today().isoformat()}", f"- command: `{command}`"]
    if floors is not None:
        lines += [f"- measured copy rate: {floors.copy_bytes_per_s / 1e12:.2f} TB/s "
                  "(read + write)",
                  f"- measured bf16 matmul: {floors.matmul_flop_per_s / 1e12:.0f} TFLOP/s"]
    lines += ["", "| kernel | case | max abs err | ok |", "|---|---|---|---|"]
    lines += [f"| {r.kernel} | {r.case} | {r.max_abs_err:.2e} | {'yes' if r.ok else 'NO'} |"
              for r in checks]
    if timings:
        lines += ["", "time: one call launched from Python, L2 flushed (includes the host's "
                  "launch cost); in graph: per call, replayed back to back from a CUDA graph "
                  "(the decode step's situation; L2 warm).", "",
                  "| kernel | case | time (us) | in graph (us) | floor (us) | floor kind "
                  "| % of floor |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {t.kernel} | {t.case} | {t.time_us:.1f} | {t.graph_us:.1f} | "
                  f"{t.floor_us:.1f} | {t.floor_kind} | {100 * t.fraction_of_floor:.0f}% |"
                  for t in timings]
    if model_rows:
        lines += [""] + model_rows
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from benchmarks.engine_gpu_kernels import (KernelCases, Tolerance, check_kernels,
                                               measure_floors, time_kernels)
    from testing.shapes import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels-only", action="store_true", help="sections 1-3 only")
    parser.add_argument("--model-shape", choices=("llama3-8b", "tiny"), default=None,
                        help="section 4's model (default: llama3-8b on CUDA, tiny on CPU)")
    parser.add_argument("--time-budget-s", type=float, default=420.0,
                        help="wall time for section 4; transformers' compiled runs are "
                             "skipped or killed to stay inside it (default: %(default)s)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="model shape (default: llama3-8b on CUDA, smollm2-135m on CPU)")
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = parser.parse_args(argv)

    import torch

    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        # Must precede the first import of triton (inside check_kernels).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    shape = args.shape or ("llama3-8b" if on_cuda else "smollm2-135m")
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    device_name = torch.cuda.get_device_name(device) if on_cuda else "CPU (Triton interpreter)"
    print(f"device: {device_name}  shape: {shape}  dtype: {dtype}  seed: {seed}", flush=True)

    # bf16 keeps 8 mantissa bits: a rounding or two apart from the fp32 reference is fine.
    tol = Tolerance(atol=2e-2, rtol=2e-2) if on_cuda else Tolerance(atol=1e-4, rtol=1e-4)
    checks = check_kernels(KernelCases(shape, device, dtype, seed), tol, small=not on_cuda)
    for r in checks:
        print(f"{'PASS' if r.ok else 'FAIL'}  {r.kernel:24s} {r.case:44s} "
              f"max_abs_err={r.max_abs_err:.2e}", flush=True)

    floors, timings = None, []
    if on_cuda:
        floors = measure_floors()
        print(f"floors: copy {floors.copy_bytes_per_s / 1e12:.2f} TB/s, "
              f"bf16 matmul {floors.matmul_flop_per_s / 1e12:.0f} TFLOP/s", flush=True)
        timings = time_kernels(KernelCases(shape, device, dtype, seed + 1), floors)
        for t in timings:
            print(f"{t.kernel:24s} {t.case:36s} {t.time_us:9.1f} us  graph {t.graph_us:8.1f} us"
                  f"  floor {t.floor_us:9.1f} us"
                  f" ({t.floor_kind})  {100 * t.fraction_of_floor:5.1f}% of floor", flush=True)
    else:
        print("timings: skipped (no CUDA device)")

    model_rows: list[str] = []
    if not args.kernels_only:
        model_rows = model_section(args, floors, seed, device_name)

    if args.markdown:
        command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(render_markdown(device_name, command, checks, timings, floors, model_rows))
    return 0 if all(r.ok for r in checks) else 1


if __name__ == "__main__":
    # Run as a file (`python benchmarks/engine_gpu.py`): make the repository importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
