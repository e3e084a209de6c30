"""Structured outputs on the decode path: one engine's decode step with grammar rows in the
batch against the same batch without them, and what a new JSON schema costs to compile.

One engine in this process (random weights in a `--shape`, or a model directory) decodes
`--batch` requests, all of them decoding and none finishing while timed; per configuration,
side by side, `--repeats` times in alternating order:

    none        no row constrained (EOS ignored), the step mode a worker picks on this
                device (engine/step_mode.py: overlapped on CUDA, plain on the CPU)
    half        `--constrained-fraction` of the rows under a `json_schema` grammar (the
                200-property schema of benchmarks/grammar_compare.py), the rest as in
                `none`, in the same mode; the engine runs plain steps while a grammar row
                is live (engine/grammar_rows.py), so "ran as" says what it did
    none-plain  only where `half` ran in another mode than `none`: no row constrained, in
                the mode grammar rows force (plain), the like-for-like ratio

Before them, one untimed run each of `none` and `half`: llguidance builds its lexer's
states lazily as rows first reach them and keeps them for the schema's later requests, so
the first constrained run is slower (printed apart) than a worker that serves the schema.
Each run adds fresh requests (`--prompt-tokens` random tokens), steps until every one has
its first token, `--warm-steps` more, then times `--steps` steps, each as a worker's engine
thread calls `LLMEngine.step` in its mode (the call's wall time: in the steady state, the
interval between steps, whether or not they overlap). The figure is the median step, the
median over the runs.

Compile: the schema through the project's compile path (text/grammar.py GrammarCompiler,
as a worker's `compile_grammar` runs it before the request is added): the first compile of
a fresh worker (the vocabulary's token table built too), then the median of `--repeats`
cache misses of the same schema (what any first request with a new schema pays).

    # CPU, a plumbing check in under a minute (tokenizer of the default model; the
    # 2-core shared machine's load moves its step times by several times)
    PYTHONPATH=. .venv/bin/python benchmarks/grammar_step.py --shape tiny --batch 64 \\
        --steps 20 --warm-steps 3 --repeats 1
    # one H100 or H200, the 8B shape (tokenizer.json, or tokenizer.json.gz, in .tok/)
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/grammar_step.py --shape llama3-8b \\
        --batch 64 --tokenizer-from .tok

Output: a markdown table on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.grammar_compare import wide_schema
from engine.step_mode import STEP_MODE_CHOICES, StepMode, choose_step_mode

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from protocol.grammar_spec import GrammarSpec
    from text.tokenizer import Tokenizer

NONE, HALF, NONE_PLAIN = "none", "half", "none-plain"


def log(message: str) -> None:
    print(f"[grammar_step] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    config: str
    ran_as: str  # the step mode the timed steps ran in
    step_ms: float  # median wall ms per timed step
    min_running: int  # fewest requests running over the timed steps (== batch: none ended)


# ---- building the engine ----------------------------------------------------------------------

def load_tokenizer(folder: Path | None) -> Tokenizer:
    """From a folder with tokenizer.json (or tokenizer.json.gz) and tokenizer_config.json;
    None: the default model's (its GGUF file, where that package is installed)."""
    from text.tokenizer import Tokenizer

    if folder is None:
        from text.default_model import default_model_path
        from text.gguf_metadata import read_gguf_tokenizer_data
        return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))
    if (folder / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(folder)
    packed = folder / "tokenizer.json.gz"
    if not packed.exists():
        raise SystemExit(f"{folder} has neither tokenizer.json nor tokenizer.json.gz")
    with tempfile.TemporaryDirectory() as tmp:
        with gzip.open(packed, "rb") as source, open(Path(tmp) / "tokenizer.json", "wb") as out:
            shutil.copyfileobj(source, out)
        for extra in folder.iterdir():
            if extra.name != packed.name and extra.is_file():
                shutil.copy(extra, Path(tmp) / extra.name)
        return Tokenizer.from_hf_dir(Path(tmp))


def build_engine(args: argparse.Namespace, cuda: bool) -> tuple[LLMEngine, str]:
    """The engine (KV pool sized for the runs), and the model's name for the table."""
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine

    dtype = torch.bfloat16 if cuda else torch.float32
    max_len = args.prompt_tokens + max_tokens(args) + 1
    config = EngineConfig(num_kv_blocks=-(-max_len // 16) * args.batch + 64, block_size=16,
                          max_num_seqs=args.batch,
                          max_num_batched_tokens=args.max_batched_tokens, dtype=dtype,
                          device=args.device)
    if args.model_dir is not None:
        from engine.engine_builder import build_engine as build_from_dir
        return build_from_dir(str(args.model_dir), config, progress=log), args.model_dir.name
    from benchmarks.engine_gpu_model import build_random_model
    from testing.shapes import SHAPES

    tokenizer = load_tokenizer(args.tokenizer_from)
    model_config = dataclasses.replace(SHAPES[args.shape], vocab_size=tokenizer.vocab_size)
    model = build_random_model(model_config, seed=1, device=torch.device(args.device),
                               dtype=dtype)
    return LLMEngine.for_model(model, model_config, tokenizer, config), args.shape


def max_tokens(args: argparse.Namespace) -> int:
    """Enough that no row reaches it before it is aborted (prefill takes a few steps)."""
    prefill_steps = -(-args.batch * args.prompt_tokens // args.max_batched_tokens) + 1
    return prefill_steps + args.warm_steps + args.steps + 64


# ---- the runs ---------------------------------------------------------------------------------

def worker_mode(engine: LLMEngine, option: str) -> StepMode:
    """The step mode a worker's engine thread runs with `--pipelined-steps option`
    (engine/engine_thread.py: overlapped only with a runner that reads device tokens)."""
    mode = choose_step_mode(option, str(engine.config.device))
    if mode is StepMode.OVERLAPPED and not engine.runner.reads_device_tokens:
        mode = StepMode.PIPELINED
    return mode


def step_as_worker(engine: LLMEngine, mode: StepMode) -> StepMode:
    """One `LLMEngine.step` as the engine thread calls it in `mode`; returns the mode the
    step ran in (overlap is off while a grammar row is live: engine/grammar_rows.py)."""
    ran = mode
    if mode is StepMode.OVERLAPPED and engine.grammar_rows.any_live(
            engine.outputs.tracked.keys()):
        ran = StepMode.PLAIN
    early: list[object] = []
    engine.step(None, early.extend if mode is StepMode.PIPELINED else None,
                overlap=mode is StepMode.OVERLAPPED)
    if engine.step_timer is not None:
        engine.step_timer.drain()  # the engine thread drains it after every step
    return ran


def one_run(engine: LLMEngine, args: argparse.Namespace, config: str, mode: StepMode,
            spec: GrammarSpec, rng: random.Random, run_index: int) -> Run:
    from protocol.sampling_params import SamplingParams

    num_constrained = round(args.batch * args.constrained_fraction) if config == HALF else 0
    vocab = engine.model_config.vocab_size
    ids = [f"{config}-{run_index}-{i}" for i in range(args.batch)]
    for i, request_id in enumerate(ids):
        constrained = i < num_constrained
        params = SamplingParams(max_tokens=max_tokens(args), temperature=args.temperature,
                                ignore_eos=not constrained,
                                grammar=spec if constrained else None)
        prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(request_id, prompt, params)

    def all_decoding() -> bool:
        requests = [engine.scheduler.get_request(r) for r in ids]
        return all(r is not None and r.num_output_tokens >= 1 for r in requests)

    for _ in range(10_000):
        if all_decoding():
            break
        step_as_worker(engine, mode)
    else:
        raise RuntimeError("the requests never all reached decode")
    for _ in range(args.warm_steps):
        step_as_worker(engine, mode)
    times: list[float] = []
    ran_as: set[StepMode] = set()
    min_running = args.batch
    for _ in range(args.steps):
        started = time.perf_counter()
        ran_as.add(step_as_worker(engine, mode))
        times.append(time.perf_counter() - started)
        min_running = min(min_running, engine.num_running)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished():  # an overlapped step still in flight
        step_as_worker(engine, mode)
    names = sorted(m.name.lower() for m in ran_as)
    return Run(config, "+".join(names), 1e3 * statistics.median(times), min_running)


# ---- compile ----------------------------------------------------------------------------------

def compile_times(tokenizer: Tokenizer, vocab_size: int, spec: GrammarSpec,
                  repeats: int) -> tuple[float, float]:
    """(ms of a fresh worker's first compile, token table included; median ms of a cache
    miss once the table is built). A one-entry cache and another spec between repeats
    make each compile of `spec` a miss."""
    from protocol.grammar_spec import GrammarKind, GrammarSpec
    from text.grammar import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size, cache_size=1)
    started = time.perf_counter()
    compiler.compile(spec)
    first_ms = 1e3 * (time.perf_counter() - started)
    other = GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "object"}')
    misses = []
    for _ in range(max(1, repeats)):
        compiler.compile(other)  # evicts spec
        started = time.perf_counter()
        compiler.compile(spec)
        misses.append(1e3 * (time.perf_counter() - started))
    assert compiler.num_compiles == 1 + 2 * max(1, repeats), "a compile hit the cache"
    return first_ms, statistics.median(misses)


# ---- main -------------------------------------------------------------------------------------

def device_name(cuda: bool) -> str:
    if cuda:
        import torch
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", default="tiny",
                        help="random weights in this shape (testing/shapes.py: tiny, "
                        "smollm2-135m, llama3-1b, llama3-8b); default tiny")
    source.add_argument("--model-dir", type=Path,
                        help="load this model directory instead (e.g. one written by "
                        "testing/random_model.py), with its own tokenizer")
    parser.add_argument("--tokenizer-from", type=Path,
                        help="with --shape: a folder with tokenizer.json (or "
                        "tokenizer.json.gz) and tokenizer_config.json; default: the default "
                        "model's tokenizer (its GGUF package must be installed)")
    parser.add_argument("--device", default=None,
                        help="cuda or cpu (default: cuda where available)")
    parser.add_argument("--batch", type=int, default=64,
                        help="requests decoding together (default 64)")
    parser.add_argument("--constrained-fraction", type=float, default=0.5,
                        help="share of the rows under the json_schema grammar in the "
                        "constrained configuration (default 0.5)")
    parser.add_argument("--properties", type=int, default=200,
                        help="properties of the JSON schema (default 200)")
    parser.add_argument("--steps", type=int, default=200,
                        help="timed decode steps per run (default 200)")
    parser.add_argument("--warm-steps", type=int, default=20,
                        help="decode steps before timing, per run (default 20)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per configuration, in alternating order; also compile "
                        "repeats (default 3)")
    parser.add_argument("--prompt-tokens", type=int, default=32,
                        help="random prompt tokens per request (default 32)")
    parser.add_argument("--max-batched-tokens", type=int, default=512,
                        help="tokens per engine step, as a worker's --max-num-batched-tokens "
                        "(default 512)")
    parser.add_argument("--pipelined-steps", choices=STEP_MODE_CHOICES, default="auto",
                        help="the step mode option, as a worker's --pipelined-steps "
                        "(default auto: overlapped on CUDA, plain on the CPU)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default 0: greedy)")
    parser.add_argument("--seed", type=int, default=0, help="prompts' seed (default 0)")
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.repeats < 1 or args.prompt_tokens < 1:
        parser.error("--batch, --steps, --repeats and --prompt-tokens must be at least 1")
    if not 0.0 < args.constrained_fraction <= 1.0:
        parser.error("--constrained-fraction must be in (0, 1]")
    if args.model_dir is not None and args.tokenizer_from is not None:
        parser.error("--tokenizer-from goes with --shape (a model directory has its own)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python3 benchmarks/grammar_step.py " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    import torch

    from engine.step_timer import StepTimer
    from engine.warm_up import warm_up
    from protocol.grammar_spec import GrammarKind, GrammarSpec
    from telemetry.start_up_heap import freeze_start_up_heap

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    engine, name = build_engine(args, cuda)
    log(f"built {name} on {args.device} in {time.perf_counter() - started:.1f} s")
    if cuda:  # a worker warms up on CUDA (its --warm-up auto)
        report = warm_up(engine, log)
        log(f"warmed up in {report.seconds:.1f} s")
    mode = worker_mode(engine, args.pipelined_steps)
    if mode is StepMode.OVERLAPPED and cuda:
        engine.step_timer = StepTimer()  # as the engine thread sets it for overlapped steps
    freeze_start_up_heap()  # as a worker does before traffic

    schema = wide_schema(args.properties)
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    first_ms, miss_ms = compile_times(engine.tokenizer, engine.model_config.vocab_size, spec,
                                      args.repeats)
    log(f"compile: {first_ms:.1f} ms first (token table included), {miss_ms:.1f} ms a miss")
    engine.grammar_rows.compiler.compile(spec)  # a worker's compile_grammar, before adding

    rng = random.Random(args.seed)
    modes = {NONE: mode, HALF: mode, NONE_PLAIN: StepMode.PLAIN}
    configs = [NONE, HALF] + ([NONE_PLAIN] if mode is StepMode.OVERLAPPED else [])
    # One untimed run of each first: llguidance builds its lexer's states lazily, as rows
    # first reach them, and keeps them for the schema's later requests (a worker serving
    # the schema has them); the first constrained run's figure is printed apart.
    primed = {config: one_run(engine, args, config, modes[config], spec, rng, -1)
              for config in (NONE, HALF)}
    log(f"first runs: none {primed[NONE].step_ms:.2f} ms/step, half "
        f"{primed[HALF].step_ms:.2f} ms/step (untimed in the table)")
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for config in (configs if repeat % 2 == 0 else configs[::-1]):
            run = one_run(engine, args, config, modes[config], spec, rng, repeat)
            runs.append(run)
            log(f"{config} #{repeat + 1}: {run.step_ms:.2f} ms/step, ran as {run.ran_as}, "
                f"at least {run.min_running} of {args.batch} rows running")
    engine.close()

    def median_ms(config: str) -> float:
        return statistics.median(r.step_ms for r in runs if r.config == config)

    def ran_as(config: str) -> str:
        return "/".join(sorted({r.ran_as for r in runs if r.config == config}))

    num_constrained = round(args.batch * args.constrained_fraction)
    half_ms, none_ms = median_ms(HALF), median_ms(NONE)
    ended = [r for r in [*runs, *primed.values()] if r.min_running < args.batch]
    print(f"{device_name(cuda)}; {name}, vocabulary {engine.model_config.vocab_size}; batch "
          f"{args.batch}, {num_constrained} rows under a {args.properties}-property json_schema; "
          f"median step of {args.steps}, median of {args.repeats} runs")
    print()
    print("| device | shape | batch | configuration | ran as | ms/step | constrained ÷ this |")
    print("|---|---|---:|---|---|---:|---:|")
    labels = {NONE: "no row constrained (the worker's mode)",
              HALF: f"{num_constrained} of {args.batch} rows constrained",
              NONE_PLAIN: "no row constrained (the mode grammar rows force)"}
    for config in configs:
        ms = median_ms(config)
        print(f"| {device_name(cuda)} | {name} | {args.batch} | {labels[config]} | "
              f"{ran_as(config)} | {ms:.2f} | {half_ms / ms:.3f}x |")
    print()
    print(f"constrained / unconstrained: **{half_ms / none_ms:.3f}x** (target <= 1.10x)"
          + (f"; against the same mode: {half_ms / median_ms(NONE_PLAIN):.3f}x"
             if NONE_PLAIN in configs else ""))
    print(f"the schema's first constrained run, its lexer states built on the way: "
          f"{primed[HALF].step_ms:.2f} ms/step ({primed[HALF].step_ms / none_ms:.3f}x the "
          "unconstrained step)")
    print(f"compile of the {args.properties}-property schema: **{miss_ms:.1f} ms** "
          f"(cache miss, median of {args.repeats}); {first_ms:.1f} ms on a fresh worker "
          "(its vocabulary's token table built too)")
    if ended:
        print(f"warning: {len(ended)} run(s) had rows end while timed (fewer steps?)")
    print(f"command: `{command}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
