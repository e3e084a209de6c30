"""The serving loop: does one engine keep its device busy on a decode-heavy closed loop?

One engine in this process steps a closed loop of `--concurrency` requests (random
`--prompt-tokens`-token prompts, `--max-tokens` output tokens give or take half, EOS
ignored, greedy); a finished request is replaced at once, as a client at that concurrency
would. Per concurrency, the engine runs each mode in turn, `--repeats` times, alternating:

    plain       LLMEngine.step(): the host makes every output before the next step
    pipelined   LLMEngine.step(on_outputs=...): the text of one step's tokens is made while
                the device computes the next (engine/output_processor.py)
    overlapped  LLMEngine.step(overlap=True): the next step is planned and queued before this
                step's tokens reach the host (engine/inflight_step.py)

and each with the suffix `-eager` (`overlapped-eager`): steps that carry prefill chunks
launched kernel by kernel instead of replayed from their CUDA graphs (engine/mixed_graphs.py).

Per concurrency: `--warm-steps` steps to reach the steady state (the first requests end
at random lengths, so no wave finishes together); then per run (modes in ABBA order) one
step to change mode, `--steps` steps timed for
output tokens per second, then (CUDA) `--profile-steps` steps with CUDA events around each
graph replay for the device's share of the wall time without a profiler (`replay_window`),
then as many under the torch profiler for that share again (the union of its kernel and
copy intervals over the window, the profiler's own host cost included) and the device's
time per step. The last columns
set tokens/s against concurrency / (device time per step): what the loop would serve if
the device never waited for the host.

    python -m testing.random_model .tok --tokenizer-only       # once: the tokenizer
    python -m benchmarks.serving_loop --shape llama3-1b --tokenizer .tok --device cuda \\
        --concurrency 32,128,256
    python -m benchmarks.serving_loop --model default --concurrency 4,16 --steps 40  # CPU

`--host-split` adds a table of the host's milliseconds per step by engine phase
(benchmarks/host_split.py: timers, not a profiler).

Output: a markdown table on stdout (and `--json`); progress on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.host_split import PHASES, REPLAY, HostSplit

MODES = ("plain", "pipelined", "overlapped")
EAGER = "-eager"  # a mode's suffix: steps with prefill chunks launched eagerly, not replayed


def log(message: str) -> None:
    print(f"[serving_loop] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    concurrency: int
    mode: str
    tokens_per_s: float
    wall_ms_per_step: float
    mixed_graph_steps: int  # of the timed steps, those replayed from a mixed CUDA graph
    device_busy: float | None  # the device's share of the profiled window's wall time
    device_ms_per_step: float | None
    replay_busy: float | None = None  # the same share from events around graph replays
    host_ms: dict[str, float] | None = None  # per step, by phase (--host-split)


class ClosedLoop:
    """Keeps `concurrency` requests in one engine; counts the tokens its clients receive."""

    def __init__(self, engine, concurrency: int, prompt_tokens: int, max_tokens: int,
                 rng: random.Random, temperature: float = 0.0) -> None:
        from protocol.sampling_params import SamplingParams

        self.engine = engine
        self.rng = rng
        self.prompt_tokens = prompt_tokens
        self.params = [SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True)
                       for n in range(max(1, max_tokens // 2), max_tokens * 3 // 2 + 1)]
        self.live: set[str] = set()
        self.num_added = 0
        for _ in range(concurrency):
            # The first ones end anywhere up to the longest, as if the loop had long been
            # running: no wave of requests finishing together.
            self._add(SamplingParams(max_tokens=self.rng.randrange(1, self.params[-1].max_tokens),
                                     temperature=temperature, ignore_eos=True))

    def _add(self, params=None) -> None:
        rid = f"loop-{self.num_added}"
        self.num_added += 1
        vocab = self.engine.model_config.vocab_size
        prompt = [self.rng.randrange(vocab) for _ in range(self.prompt_tokens)]
        self.engine.add_request(rid, prompt, params or self.rng.choice(self.params))
        self.live.add(rid)

    def step(self, mode: str) -> int:
        """One engine step in `mode` (one of MODES); returns the output tokens it delivered."""
        early: list = []
        outputs = self.engine.step(on_outputs=early.extend if mode == "pipelined" else None,
                                   overlap=mode == "overlapped")
        num_tokens = 0
        for out in early + outputs:
            num_tokens += len(out.new_token_ids)
            if out.finished:
                self.live.discard(out.request_id)
                self._add()
        return num_tokens

    def drain(self) -> None:
        for rid in list(self.live):
            self.engine.abort_request(rid)
        self.live.clear()
        while self.engine.has_unfinished():
            self.engine.step()


def device_window(loop: ClosedLoop, num_steps: int, mode: str) -> tuple[float, float]:
    """(busy fraction, device ms per step) over `num_steps` steps, from the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(num_steps):
            loop.step(mode)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - started) * 1e6
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    busy_us = 0.0
    end = None
    for lo, hi in intervals:  # the union: overlapping kernels count once
        if end is None or lo > end:
            busy_us += hi - lo
            end = hi
        elif hi > end:
            busy_us += hi - end
            end = hi
    return min(busy_us / wall_us, 1.0), busy_us / num_steps / 1e3


def replay_window(loop: ClosedLoop, num_steps: int, mode: str) -> float:
    """The device's busy fraction over `num_steps` steps without the profiler (whose own
    host cost slows a host-bound loop): CUDA events recorded on the stream right before and
    after each CUDA-graph replay, their spans summed over the window's wall time. It leans
    low: an eager step and the sampler's kernels count as idle (on the device's side only
    the launch latency of a replay on an idle device counts as busy)."""
    import torch

    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        replay(graph)
        end.record()
        spans.append((start, end))

    torch.cuda.synchronize()
    torch.cuda.CUDAGraph.replay = timed_replay  # this window only; restored below
    try:
        started = time.perf_counter()
        for _ in range(num_steps):
            loop.step(mode)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    finally:
        torch.cuda.CUDAGraph.replay = replay
    return min(sum(start.elapsed_time(end) for start, end in spans) / wall_ms, 1.0)


def parse_mode(mode: str) -> tuple[str, int | None, bool] | None:
    """(base mode, split threshold or None, mixed graphs on) of `MODE[-eager][@N]`; None
    when it is not one."""
    rest, _, split = mode.partition("@")
    base, eager = (rest[:-len(EAGER)], True) if rest.endswith(EAGER) else (rest, False)
    if base not in MODES or ("@" in mode and not split.isdigit()):
        return None
    return base, int(split) if split else None, not eager


def measure(loop: ClosedLoop, concurrency: int, mode: str, args: argparse.Namespace, cuda: bool,
            profiler: cProfile.Profile | None) -> Run:
    parsed = parse_mode(mode)
    assert parsed is not None  # main checked every mode
    base, split, mixed_graphs = parsed
    runner = loop.engine.runner
    runner.use_mixed_graphs, graphs_before = mixed_graphs, runner.use_mixed_graphs
    if split is not None:
        runner.mixed_split_min_tokens, default_split = split, runner.mixed_split_min_tokens
    loop.step(base)  # the other mode's last outputs leave
    if cuda:
        import torch
        torch.cuda.synchronize()
    num_tokens = 0
    mixed = runner.mixed_graphs
    mixed_before = 0 if mixed is None else mixed.num_runs
    phases = HostSplit(loop.engine) if args.host_split else None
    if profiler is not None:
        profiler.enable()
    started = time.perf_counter()
    for _ in range(args.steps):
        num_tokens += loop.step(base)
    wall_s = time.perf_counter() - started
    host_ms = None
    if phases is not None:
        host_ms = phases.per_step_ms(args.steps)
        phases.close()
    mixed_steps = 0 if mixed is None else mixed.num_runs - mixed_before
    if profiler is not None:
        profiler.disable()
    busy = per_step = replay_busy = None
    if cuda and args.profile_steps:
        replay_busy = replay_window(loop, args.profile_steps, base)
        busy, per_step = device_window(loop, args.profile_steps, base)
    if split is not None:
        runner.mixed_split_min_tokens = default_split
    runner.use_mixed_graphs = graphs_before
    return Run(concurrency, mode, num_tokens / wall_s, wall_s / args.steps * 1e3, mixed_steps,
               busy, per_step, replay_busy, host_ms)


def build(args: argparse.Namespace):
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.warm_up import warm_up
    from telemetry.start_up_heap import freeze_start_up_heap

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.model:
        from engine.engine_builder import load_tokenizer
        from engine.loader import load_model

        loaded = load_model(args.model, dtype=dtype, device=args.device)
        model, config = loaded.model, loaded.config
        tokenizer = load_tokenizer(loaded.tokenizer_source)
    else:
        from benchmarks.engine_gpu_model import build_random_model
        from testing.shapes import SHAPES
        from text.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_dir(Path(args.tokenizer))
        config = dataclasses.replace(SHAPES[args.shape], vocab_size=tokenizer.vocab_size)
        model = build_random_model(config, seed=1, device=torch.device(args.device),
                                   dtype=dtype)
    max_c = max(int(c) for c in args.concurrency.split(","))
    blocks_per_seq = -(-(args.prompt_tokens + args.max_tokens * 3 // 2 + 1) // 16)
    engine = LLMEngine.for_model(model, config, tokenizer, EngineConfig(
        num_kv_blocks=blocks_per_seq * max_c + 64, block_size=16, max_num_seqs=max_c,
        max_num_batched_tokens=args.max_batched_tokens, dtype=dtype, device=args.device))
    if cuda:
        report = warm_up(engine, log)
        log(f"warmed up in {report.seconds:.1f} s")
    freeze_start_up_heap()  # as a worker does before traffic
    return engine, cuda


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="weights to load (a path, or 'default')")
    source.add_argument("--shape", help="random weights in this shape (testing/shapes.py); "
                        "needs --tokenizer")
    parser.add_argument("--tokenizer", help="folder with tokenizer.json (with --shape)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--concurrency", default="32,128,256",
                        help="comma-separated numbers of requests in flight")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="any of plain, pipelined, overlapped; MODE-eager runs MODE "
                        "with steps that carry prefill chunks launched eagerly instead of "
                        "replayed from their CUDA graphs (engine/mixed_graphs.py); MODE@N "
                        "with an eager mixed step's decode rows split off to the decode "
                        "kernel from N context tokens (engine/mixed_split.py)")
    parser.add_argument("--repeats", type=int, default=4,
                        help="runs per mode, alternating (ABBA)")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=256,
                        help="output tokens per request, give or take half")
    parser.add_argument("--warm-steps", type=int, default=100,
                        help="steps before timing, per concurrency")
    parser.add_argument("--steps", type=int, default=150, help="timed steps per run")
    parser.add_argument("--profile-steps", type=int, default=30,
                        help="steps per run timed with replay events, then as many under "
                        "the profiler (CUDA; 0: neither)")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="tokens per engine step, as a worker's --max-num-batched-tokens")
    parser.add_argument("--seed", type=int, default=0, help="prompts and output lengths")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default 0: greedy; 1 samples, as "
                             "an OpenAI request without one does)")
    parser.add_argument("--json", help="also write the runs here")
    parser.add_argument("--host-split", action="store_true",
                        help="time the engine's phases over the timed steps (schedule, "
                        "runner, sampler, resolve, update: benchmarks/host_split.py) and "
                        "print host ms per step by phase")
    parser.add_argument("--cprofile", help="profile the host over the timed steps (cProfile) "
                        "and write the top functions here")
    args = parser.parse_args(argv)
    profiler = cProfile.Profile() if args.cprofile else None
    if args.shape and not args.tokenizer:
        parser.error("--shape needs --tokenizer")
    if not 0 <= args.temperature <= 2:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")
    modes = args.modes.split(",")
    if any(parse_mode(m) is None for m in modes):
        parser.error(f"--modes: choose from {', '.join(MODES)}, each optionally with "
                     f"{EAGER} and @N")

    import torch
    torch.manual_seed(args.seed)
    engine, cuda = build(args)
    name = args.shape or args.model
    runs: list[Run] = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        loop = ClosedLoop(engine, concurrency, args.prompt_tokens, args.max_tokens,
                          random.Random(args.seed), args.temperature)
        for _ in range(args.warm_steps):
            loop.step("plain")
        for repeat in range(args.repeats):
            # ABBA: neither mode always meets the same phase of the loop first.
            for mode in (modes if repeat % 2 == 0 else modes[::-1]):
                run = measure(loop, concurrency, mode, args, cuda, profiler)
                runs.append(run)
                log(f"{name} c={concurrency} {mode} #{repeat + 1}: "
                    f"{run.tokens_per_s:.0f} tok/s, {run.wall_ms_per_step:.2f} ms/step, "
                    f"{run.mixed_graph_steps} of {args.steps} steps from mixed graphs"
                    + (f", device busy {run.device_busy:.0%} (replay events "
                       f"{run.replay_busy or 0:.0%}), {run.device_ms_per_step:.2f} device "
                       "ms/step" if run.device_busy else ""))
        loop.drain()
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    if profiler is not None:
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(40)
        Path(args.cprofile).write_text(text.getvalue())
    print(f"{name} on {torch.cuda.get_device_name() if cuda else 'cpu'}; medians of "
          f"{args.repeats} runs of {args.steps} steps")
    print()
    print("| concurrency | mode | output tok/s | wall ms/step | device busy (profiler) "
          "| device busy (replay events) | device ms/step "
          "| concurrency / device step, tok/s | tok/s of that |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for concurrency in sorted({r.concurrency for r in runs}):
        for mode in modes:
            mine = [r for r in runs if r.concurrency == concurrency and r.mode == mode]
            tps = statistics.median(r.tokens_per_s for r in mine)
            wall = statistics.median(r.wall_ms_per_step for r in mine)
            if mine[0].device_busy is None:
                print(f"| {concurrency} | {mode} | {tps:.0f} | {wall:.2f} | - | - | - | - | - |")
                continue
            busy = statistics.median(r.device_busy or 0.0 for r in mine)
            replay_busy = statistics.median(r.replay_busy or 0.0 for r in mine)
            dev = statistics.median(r.device_ms_per_step or 0.0 for r in mine)
            bound = concurrency / dev * 1e3
            print(f"| {concurrency} | {mode} | {tps:.0f} | {wall:.2f} | {busy:.0%} "
                  f"| {replay_busy:.0%} | {dev:.2f} | {bound:.0f} | {tps / bound:.0%} |")
    if args.host_split:
        print_host_split(runs, modes)
    engine.close()
    return 0


def print_host_split(runs: list[Run], modes: list[str]) -> None:
    print()
    print("| concurrency | mode | wall ms/step | " + " | ".join(PHASES)
          + " | rest (glue, the loop) | of runner.execute: graph replay |")
    print("|---:|---|---:|" + "---:|" * (len(PHASES) + 2))
    for concurrency in sorted({r.concurrency for r in runs}):
        for mode in modes:
            mine = [r for r in runs if r.concurrency == concurrency and r.mode == mode]
            wall = statistics.median(r.wall_ms_per_step for r in mine)
            parts = [statistics.median((r.host_ms or {}).get(p, 0.0) for r in mine)
                     for p in PHASES]
            replay = statistics.median((r.host_ms or {}).get(REPLAY, 0.0) for r in mine)
            print(f"| {concurrency} | {mode} | {wall:.2f} | "
                  + " | ".join(f"{ms:.3f}" for ms in parts)
                  + f" | {wall - sum(parts):.3f} | {replay:.3f} |")


if __name__ == "__main__":
    raise SystemExit(main())
