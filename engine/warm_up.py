"""Warm start: run every kind of step a worker will meet once, before it takes traffic.

Triton compiles a kernel the first time it meets a new specialization (its integer
arguments are specialized on being 1 or a multiple of 16, its block shapes on the input
sizes), and cuBLAS picks an algorithm per new matrix shape: on a fresh worker the first
requests pay for that, up to a second each. Decode steps are captured as CUDA graphs at
start-up already (engine/cuda_graphs.py); `warm_up` covers the rest:

    prefills    lengths 1, 15, 16, 17, 100, 256, 511 and a full step's budget
                (max_num_batched_tokens), one request at a time and several in one step
    chunked     a prompt longer than one step (chunked prefill, attention over the KV of
                its own earlier chunks)
    prefix hit  the same prompt again: prefill over cached blocks
    mixed       prefills joining a running decode batch (prefill + decode rows in a step),
                twice: the decode rows in the prefill kernel, then split off to the decode
                kernel (what steps over long contexts do)
    sampling    greedy, temperature with top-p / top-k / min-p, penalties, seeded, with
                logprobs

Every step runs eagerly here, with the runner's mixed CUDA graphs off: those were compiled
and captured with the runner (engine/mixed_graphs.py), and the eager path still serves
what they do not hold (longer steps, more prefill chunks, steps that signal each layer).

What it leaves behind: nothing running, no block referenced (it checks), and no cache
event for the registry (they are drained: its prompts are not traffic). Its prompts stay
in the local prefix cache as free blocks, evicted first when blocks run short. The caller
reports `WarmUpReport.seconds` (the worker logs it and exports pdserve_warmup_seconds).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from protocol.sampling_params import SamplingParams

LENGTHS = (1, 15, 16, 17, 100, 256, 511)


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    seconds: float
    num_requests: int
    num_steps: int


def _samplings(max_tokens: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=40, min_p=0.05,
                       seed=7, ignore_eos=True),
        SamplingParams(max_tokens=max_tokens, temperature=1.0, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5,
                       ignore_eos=True),
    ]


def _mixed_steps(engine: LLMEngine, prompt: Callable[[int], list[int]], budget: int,
                 say: Callable[[str], None], what: str) -> int:
    """Decodes running while new prompts join them; returns the number of requests."""
    say(f"warming up: {what}")
    greedy = _samplings(2)[0]
    decoding = _samplings(24)
    for i, params in enumerate(decoding):
        engine.add_request(f"warm-up-decode-{i}", prompt(40 + 9 * i), params)
    arrivals = [prompt(n) for n in (60, 300, budget // 2)]
    while engine.has_unfinished():
        engine.step()
        if arrivals:
            engine.add_request(f"warm-up-join-{len(arrivals)}", arrivals.pop(), greedy)
    return len(decoding) + 3


def warm_up(engine: LLMEngine, progress: Callable[[str], None] | None = None,
            seed: int = 0) -> WarmUpReport:
    """Run the warm-up requests to completion on `engine` (not yet serving)."""
    if engine.has_unfinished():
        raise RuntimeError("warm up an engine before it serves, not while it does")
    say = progress or (lambda _: None)
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    budget = engine.config.max_num_batched_tokens
    pool_tokens = engine.config.num_kv_blocks * engine.config.block_size
    max_len = min(engine.model_config.max_position_embeddings - 8, pool_tokens // 4)
    started = time.perf_counter()
    steps_before = engine.num_steps

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(max(1, min(length, max_len)))]

    def run(prompts: list[list[int]], samplings: list[SamplingParams], what: str) -> int:
        say(f"warming up: {what}")
        engine.generate(prompts, samplings)
        return len(prompts)

    runner = engine.runner
    graphs_on = isinstance(runner, ModelRunner) and runner.use_mixed_graphs
    if isinstance(runner, ModelRunner):
        runner.use_mixed_graphs = False
    try:
        num_requests = _warm_steps(engine, prompt, run, budget, say)
    finally:
        if isinstance(runner, ModelRunner):
            runner.use_mixed_graphs = graphs_on
    engine.kv_cache.drain_events()  # its prompts are not traffic: nothing for the index
    if engine.kv_cache.num_used_blocks:
        raise AssertionError(f"warm-up left {engine.kv_cache.num_used_blocks} block(s) held")
    return WarmUpReport(seconds=time.perf_counter() - started, num_requests=num_requests,
                        num_steps=engine.num_steps - steps_before)


def _warm_steps(engine: LLMEngine, prompt: Callable[[int], list[int]],
                run: Callable[[list[list[int]], list[SamplingParams], str], int],
                budget: int, say: Callable[[str], None]) -> int:
    """Every kind of step once (the module docstring's list); returns the requests run."""
    num_requests = 0
    greedy, sampled, penalized = _samplings(2)
    lengths = sorted({*[n for n in LENGTHS if n < budget], budget})
    for index, length in enumerate(lengths):
        num_requests += run([prompt(length)], [(greedy, sampled, penalized)[index % 3]],
                            f"prefill of {length} token(s) ({index + 1}/{len(lengths)})")
    num_requests += run([prompt(n) for n in (7, 33, 64, 130)],
                        [greedy, sampled, penalized, greedy], "several prefills in one step")
    long_prompt = prompt(2 * budget + 37)
    num_requests += run([long_prompt], [greedy],
                        f"a chunked prefill of {len(long_prompt)} tokens")
    num_requests += run([long_prompt + prompt(20)], [sampled],
                        "a prefill over cached prefix blocks")
    # Mixed steps: decodes running while new prompts arrive; then the same with the decode
    # rows split off to the decode kernel, as steps over long contexts are (attention.py).
    num_requests += _mixed_steps(engine, prompt, budget, say, "prefills joining running decodes")
    runner = engine.runner
    if isinstance(runner, ModelRunner):
        threshold, runner.mixed_split_min_tokens = runner.mixed_split_min_tokens, 1
        try:
            num_requests += _mixed_steps(engine, prompt, budget, say,
                                         "prefills joining running decodes, split")
        finally:
            runner.mixed_split_min_tokens = threshold
    return num_requests
