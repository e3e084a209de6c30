"""Model section of the GPU engine benchmark: our engine against the hardware floor and
against `transformers` on the same device with the same random weights.

    decode   one step (ModelRunner.execute, CUDA-graph replay, logits included, synced) at
             batch 1/32/128/256 with 512 and 2048 tokens of context already cached;
             floor = (weights read once + the batch's KV read) / measured copy rate
    prefill  one 1x2048 and one 8x2048 step; floor = matmul FLOPs / measured matmul rate
    transformers  eager forward with a DynamicCache holding the same context; and static
             cache + torch.compile through `generate` in a child process with a hard timeout
             (compilation takes about a minute per batch size), skipped with a printed reason
             when the time budget cannot hold it

Every case is timed inside its own try: a failing case prints its error and the run goes on.
Run through benchmarks/engine_gpu.py (its `model_section`); the transformers baseline is
benchmarks/engine_gpu_baseline.py.
"""

from __future__ import annotations

import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.config import ModelConfig

BLOCK_SIZE = 16
DECODE_BATCHES = (1, 32, 128, 256)
CONTEXTS = (512, 2048)
PREFILLS = (1, 8)  # sequences of 2048 tokens
PREFILL_LEN = 2048

def log(message: str) -> None:
    print(f"[model] {message}", flush=True)


@dataclass
class ModelResults:
    rows: list[tuple] = field(default_factory=list)  # (kind, case, ours_ms, floor_ms, ...)
    hf_eager_ms: dict[str, float] = field(default_factory=dict)
    hf_compiled_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def build_random_model(config: ModelConfig, seed: int, device: torch.device, dtype: torch.dtype):
    """Our model with random weights drawn on the device; the same seed gives the same
    weights on the same device (the compiled child rebuilds them this way)."""
    from engine.models.families import model_class

    model = model_class(config.architecture)(config, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() with a device sync after each call (what a step costs the
    engine loop, which syncs every step to sample)."""
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(1000 * (time.perf_counter() - start))
    return statistics.median(samples)


def weight_bytes_per_step(model) -> int:
    """Bytes a forward pass must read: every parameter except the embedding table (only a
    few rows of it are touched)."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total - embed.numel() * embed.element_size()


def kv_bytes(config: ModelConfig, num_tokens: int, element_size: int) -> int:
    return 2 * config.num_layers * num_tokens * config.num_kv_heads * config.head_dim * element_size


def prefill_flops(model, config: ModelConfig, num_seqs: int, length: int) -> float:
    """Matmul FLOPs of a prefill: projections and MLP per token, the vocabulary projection
    for the last token of each sequence, and causal attention (QK^T and PV)."""
    head = config.vocab_size * config.hidden_size
    body = weight_bytes_per_step(model) // model.model.embed_tokens.weight.element_size() - head
    pairs = num_seqs * length * (length + 1) / 2
    attention = 4 * pairs * config.num_heads * config.head_dim * config.num_layers
    return 2 * body * num_seqs * length + 2 * head * num_seqs + attention


def decode_schedule(batch: int, context: int, blocks_per_seq: int, num_blocks: int = 0):
    from engine.schedule_output import ScheduledChunk, ScheduleOutput

    # Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq), taken round a
    # pool of `num_blocks` where it is smaller (0: large enough); its newest token sits at
    # position context - 1, so the step attends to `context` positions.
    wrap = num_blocks or batch * blocks_per_seq
    return ScheduleOutput(tuple(
        ScheduledChunk(f"d{i}", (1 + i % 1000,), context - 1,
                       tuple((i * blocks_per_seq + j) % wrap for j in range(blocks_per_seq)),
                       True)
        for i in range(batch)))


def prefill_schedule(num_seqs: int, length: int, vocab_size: int):
    from engine.schedule_output import ScheduledChunk, ScheduleOutput

    per_seq = -(-length // BLOCK_SIZE)
    return ScheduleOutput(tuple(
        ScheduledChunk(f"p{i}", tuple((7 * j + i) % vocab_size for j in range(length)), 0,
                       tuple(range(i * per_seq, (i + 1) * per_seq)), True)
        for i in range(num_seqs)))


def guarded(name: str, results: ModelResults, fn: Callable[[], None]) -> None:
    """Run one case; a failure is printed and noted, never fatal to the run."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the benchmark reports and goes on
        traceback.print_exc()
        log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        results.notes.append(f"{name} failed: {type(exc).__name__}: {str(exc)[:200]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_ours(model, config: ModelConfig, device: torch.device, dtype: torch.dtype,
             copy_rate: float, matmul_rate: float, results: ModelResults,
             batches=DECODE_BATCHES, contexts=CONTEXTS, prefills=PREFILLS) -> None:
    from engine.kv_storage import KVStorage
    from engine.memory_plan import kv_block_bytes, plan_for_model
    from engine.model_runner import ModelRunner

    max_tokens = max(max(batches) * max(contexts), max(prefills) * PREFILL_LEN)
    needed_blocks = max_tokens // BLOCK_SIZE + 1
    num_blocks = needed_blocks
    if device.type == "cuda":
        plan = plan_for_model(model, BLOCK_SIZE, dtype, 0.9, max(prefills) * PREFILL_LEN,
                              max(batches))
        log(plan.report())
        results.notes.append(plan.report())
        num_blocks = min(plan.num_kv_blocks, needed_blocks)
    log(f"KV pool: {num_blocks} blocks "
        f"({num_blocks * kv_block_bytes(config, BLOCK_SIZE, dtype) / 2**30:.1f} GiB)")
    kv = KVStorage.for_model(config, num_blocks, BLOCK_SIZE, dtype, device)
    start = time.perf_counter()
    runner = ModelRunner(model, kv, BLOCK_SIZE,
                         cuda_graph_batch_sizes=tuple(batches) if device.type == "cuda" else ())
    capture_s = time.perf_counter() - start
    graph_gib = runner.graphs.pool_bytes / 2**30 if runner.graphs is not None else 0.0
    log(f"runner ready in {capture_s:.1f} s (kernel path: {runner.use_kernels}, "
        f"graphs {batches if runner.graphs else 'none'}, graph pool {graph_gib:.2f} GiB)")
    if runner.graphs is not None:
        results.notes.append(f"start-up: kernel prep + graph capture for batch sizes "
                             f"{list(batches)} took {capture_s:.1f} s, graph pool "
                             f"{graph_gib:.2f} GiB")
    weights = weight_bytes_per_step(model)
    elt = torch.empty((), dtype=dtype).element_size()
    for batch in batches:
        for context in contexts:
            def case(batch=batch, context=context) -> None:
                schedule = decode_schedule(batch, context, -(-context // BLOCK_SIZE))
                ms = time_ms(lambda: runner.execute(schedule), device, warmup=3, reps=20)
                floor = 1000 * (weights + kv_bytes(config, batch * context, elt)) / copy_rate
                results.rows.append(("decode", f"batch {batch} ctx {context}", ms, floor,
                                     "memory", batch / ms * 1000))
                log(f"decode batch {batch:3d} ctx {context:4d}: {ms:8.2f} ms  floor "
                    f"{floor:7.2f} ms ({100 * floor / ms:5.1f}%)  {batch / ms * 1000:9.0f} tok/s")
            guarded(f"ours decode b{batch} c{context}", results, case)
    for num_seqs in prefills:
        def case(num_seqs=num_seqs) -> None:
            schedule = prefill_schedule(num_seqs, PREFILL_LEN, config.vocab_size)
            ms = time_ms(lambda: runner.execute(schedule), device, warmup=2, reps=5)
            floor = 1000 * prefill_flops(model, config, num_seqs, PREFILL_LEN) / matmul_rate
            results.rows.append(("prefill", f"{num_seqs}x{PREFILL_LEN}", ms, floor, "matmul",
                                 num_seqs * PREFILL_LEN / ms * 1000))
            log(f"prefill {num_seqs}x{PREFILL_LEN}: {ms:8.2f} ms  floor {floor:7.2f} ms "
                f"({100 * floor / ms:5.1f}%)")
        guarded(f"ours prefill {num_seqs}x{PREFILL_LEN}", results, case)
    if device.type == "cuda":
        guarded("decode step breakdown", results,
                lambda: decode_breakdown(model, kv, results, batch=1, context=512))
    del runner, kv
    if device.type == "cuda":
        torch.cuda.empty_cache()


def decode_breakdown(model, kv, results: ModelResults, batch: int, context: int) -> None:
    """Device time of every kernel of one decode step, summed by kernel name (profiled on
    an eager step: the same kernels a graph replays, without the host in the way). The
    step's graph time minus this sum is what launches and tails between kernels cost."""
    from torch.profiler import ProfilerActivity, profile

    from engine.model_runner import ModelRunner

    eager = ModelRunner(model, kv, BLOCK_SIZE, cuda_graph_batch_sizes=())
    schedule = decode_schedule(batch, context, -(-context // BLOCK_SIZE))
    for _ in range(3):
        eager.execute(schedule)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager.execute(schedule)
        torch.cuda.synchronize()
    totals: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        count, us = totals.get(event.name, (0, 0.0))
        totals[event.name] = (count + 1, us + event.device_time)
    total_us = sum(us for _, us in totals.values())
    lines = [f"decode step breakdown, batch {batch} ctx {context} (eager, device time "
             f"per step; kernels sum to {total_us / 1000:.2f} ms):"]
    for name, (count, us) in sorted(totals.items(), key=lambda kv_: -kv_[1][1])[:14]:
        lines.append(f"  {us:8.1f} us  {count:4d}x  {name[:90]}")
    log("\n".join(lines))
    results.notes.append("<br>".join(lines))


def render(results: ModelResults, device_name: str) -> list[str]:
    lines = ["### Model: decode and prefill steps", "",
             "Ours: `ModelRunner.execute` (CUDA-graph replay for decode, logits included), "
             "synced each step. Floor: decode = (weights except the embedding table + KV of the "
             "batch) / measured copy rate; prefill = matmul FLOPs / measured bf16 matmul rate. "
             "transformers: same weights, same device; eager = forward with a DynamicCache "
             "holding the context; compiled = `generate` with a static cache "
             "(auto torch.compile).", "",
             "| step | case | ours (ms) | floor (ms) | % of floor | ours tok/s | "
             "transformers eager (ms) | transformers compiled (ms) | vs eager | vs compiled |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, case, ms, floor, _, tps in results.rows:
        key = case if kind == "decode" else case
        eager = results.hf_eager_ms.get(f"decode {case}" if kind == "decode" else key)
        compiled = results.hf_compiled_ms.get(f"decode {case}" if kind == "decode" else key)
        cell = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        ratio = lambda v: f"{v / ms:.1f}x" if v is not None else "-"  # noqa: E731
        lines.append(f"| {kind} | {case} | {ms:.2f} | {floor:.2f} | {100 * floor / ms:.0f}% | "
                     f"{tps:.0f} | {cell(eager)} | {cell(compiled)} | {ratio(eager)} | "
                     f"{ratio(compiled)} |")
    if results.notes:
        lines += [""] + [f"- {n}" for n in results.notes]
    return lines
