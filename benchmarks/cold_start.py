"""Cold start on a GPU: the first requests of a freshly started engine, with and without
the start-up warm-up (engine/warm_up.py), against the same engine's steady state.

Each mode runs in a child process of its own with an empty Triton cache (TRITON_CACHE_DIR
in a new temporary folder: nothing compiled by an earlier run), random bf16 weights in a
real model's shape, and the worker's defaults (512-token steps, CUDA graphs captured):

    build      weights on the device, KV pool, decode graphs captured (what every worker does)
    warm-up    only in mode `warm`: engine/warm_up.py's requests
    round 1    16 requests, a new one every 4 engine steps (so prefills join running
               decodes), prompts of 32..2048 tokens (seeded), 32 tokens out each, greedy,
               sampled and with logprobs in turn: TTFT = first token - arrival, wall clock
    round 2    the same 16 again (new token ids, same lengths): the steady state

The target: round 1's TTFT p99 <= 2 x round 2's p50. The last column compares each request
of round 1 with the same request of round 2 (same length, same place in the schedule):
what the cold start alone adds, without the spread of TTFT over prompt lengths. The parent prints one table row per
mode and shape; `--json PATH` keeps every figure.

    python -m benchmarks.cold_start --tokenizer DIR --shapes llama3-8b,llama3-1b
    (DIR: `python -m testing.random_model DIR --tokenizer-only`, run where the default
    model is installed)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

NUM_REQUESTS = 16
ARRIVAL_EVERY_STEPS = 4


def log(message: str) -> None:
    print(f"[cold-start] {message}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_round(engine: LLMEngine, lengths: list[int], rng: random.Random, tag: str
              ) -> list[float]:
    """TTFT of each request, seconds, in arrival order."""
    from protocol.sampling_params import SamplingParams

    samplings = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True),
                 SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, ignore_eos=True),
                 SamplingParams(max_tokens=32, temperature=1.0, logprobs=5, ignore_eos=True)]
    vocab = engine.model_config.vocab_size
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    pending = list(enumerate(lengths))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % ARRIVAL_EVERY_STEPS == 0:
            index, length = pending.pop(0)
            rid = f"{tag}-{index}"
            engine.add_request(rid, [rng.randrange(1, vocab) for _ in range(length)],
                               samplings[index % len(samplings)])
            arrived[rid] = time.perf_counter()
        for out in engine.step():
            if out.request_id not in first and out.new_token_ids:
                first[out.request_id] = time.perf_counter()
        steps += 1
    return [first[f"{tag}-{i}"] - arrived[f"{tag}-{i}"] for i in range(len(lengths))]


def compiled_kernels() -> dict[str, str]:
    """Triton's cache entries now (entry -> kernel name and specialization): the ones that
    appear during a round were compiled during it."""
    root = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    out = {}
    for meta in root.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            data = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        keys = ("name", "constants", "signature", "num_warps", "num_stages")
        detail = json.dumps({k: data.get(k) for k in keys if k in data})
        # The specialization (which arguments Triton took as 1 or as 16-aligned) is in the
        # kernel's signature in its TTIR.
        for ttir in meta.parent.glob("*.ttir"):
            line = next((ln for ln in ttir.read_text().splitlines() if "tt.func" in ln), "")
            detail += " " + re.sub(r"loc\(#loc\d*\)", "", line)[:2000]
        out[meta.parent.name] = detail
    return out


def child(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.engine_gpu_model import build_random_model
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.memory_plan import plan_for_model
    from engine.warm_up import warm_up
    from telemetry.start_up_heap import freeze_start_up_heap
    from testing.shapes import SHAPES
    from text.tokenizer import Tokenizer

    cuda = args.device == "cuda"
    device = torch.device(args.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    tokenizer = Tokenizer.from_hf_dir(Path(args.tokenizer))
    config = dataclasses.replace(SHAPES[args.shape], vocab_size=tokenizer.vocab_size)
    model = build_random_model(config, seed=1, device=device, dtype=dtype)
    num_blocks = plan_for_model(model, 16, dtype, 0.85, args.max_batched_tokens,
                                256).num_kv_blocks if cuda else 1024
    engine = LLMEngine.for_model(model, config, tokenizer, EngineConfig(
        num_kv_blocks=num_blocks, block_size=16, max_num_seqs=256,
        max_num_batched_tokens=args.max_batched_tokens, dtype=dtype, device=args.device))
    if cuda:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - started
    log(f"{args.shape}: engine built in {build_s:.1f} s ({num_blocks} KV blocks)")
    warm_s = 0.0
    if args.mode == "warm":
        report = warm_up(engine, log)
        warm_s = report.seconds
        log(f"{args.shape}: warmed up in {warm_s:.1f} s ({report.num_steps} steps)")
        freeze_start_up_heap()  # as a worker does after its warm-up
    rng = random.Random(args.seed)
    lengths = [rng.randrange(32, 2049) for _ in range(NUM_REQUESTS)]
    compiled_before = compiled_kernels()
    if args.mode == "warm":
        for name, detail in sorted(compiled_before.items()):
            if "_prefill_kernel" in detail:
                log(f"{args.shape} warm: compiled by the warm-up: {name[:8]} {detail}")
    first_round = run_round(engine, lengths, rng, "first")
    for name, detail in sorted(compiled_kernels().items() - compiled_before.items()):
        log(f"{args.shape} {args.mode}: compiled during round 1: {name} {detail}")
    steady = run_round(engine, lengths, rng, "steady")
    result = {"shape": args.shape, "mode": args.mode, "build_s": build_s, "warm_up_s": warm_s,
              "lengths": lengths, "first_ttft_s": first_round, "steady_ttft_s": steady,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def parent(args: argparse.Namespace) -> int:
    results = []
    for shape in args.shapes.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
                env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
                command = [sys.executable, "-m", "benchmarks.cold_start", "--child",
                           "--mode", mode, "--shape", shape, "--tokenizer", args.tokenizer,
                           "--seed", str(args.seed), "--device", args.device,
                           "--max-batched-tokens", str(args.max_batched_tokens)]
                log(f"{shape} {mode}: {' '.join(command[1:])}")
                done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True,
                                      timeout=args.timeout_s)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
                if done.returncode != 0 or not lines:
                    log(f"{shape} {mode} failed (exit {done.returncode})")
                    continue
                results.append(json.loads(lines[-1][len("RESULT "):]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("| shape | mode | build s | warm-up s | first 16: TTFT p50 / p90 / p99 ms | "
          "steady TTFT p50 ms | p99 / steady p50 | target <= 2 | worst first / steady, "
          "same request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        first, steady_p50 = r["first_ttft_s"], statistics.median(r["steady_ttft_s"])
        ratio = percentile(first, 0.99) / steady_p50
        worst = max(a / b for a, b in zip(first, r["steady_ttft_s"]))
        print(f"| {r['shape']} | {r['mode']} | {r['build_s']:.1f} | {r['warm_up_s']:.1f} | "
              f"{percentile(first, 0.5) * 1e3:.0f} / {percentile(first, 0.9) * 1e3:.0f} / "
              f"{percentile(first, 0.99) * 1e3:.0f} | {steady_p50 * 1e3:.0f} | "
              f"{ratio:.2f} | {'met' if ratio <= 2 else 'missed'} | {worst:.2f} |")
    return 0 if results else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True,
                        help="folder with tokenizer.json and tokenizer_config.json")
    parser.add_argument("--shapes", default="llama3-8b",
                        help="comma-separated model shapes (testing/shapes.py)")
    parser.add_argument("--seed", type=int, default=1, help="prompt lengths and token ids")
    parser.add_argument("--modes", default="cold,warm", help="cold, warm or both, in order")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="tokens per engine step, as a worker's --max-num-batched-tokens")
    parser.add_argument("--timeout-s", type=float, default=400.0,
                        help="a child that runs longer is stopped")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--device", default="cuda",
                        help="cuda (the benchmark), or cpu for a plumbing check with --shapes tiny")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("cold", "warm"), help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
