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
Run through benchmarks/engine_gpu.py (its `model_section`); the compiled child re-enters here
with `python -m benchmarks.engine_gpu_model --compiled-child ...` (from the repository root).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.config import Llama3RopeScaling, ModelConfig

BLOCK_SIZE = 16
DECODE_BATCHES = (1, 32, 128, 256)
CONTEXTS = (512, 2048)
PREFILLS = (1, 8)  # sequences of 2048 tokens
PREFILL_LEN = 2048

SHAPES = {
    "llama3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 8192)),
    # For a plumbing check on a CPU: same code, toy sizes.
    "tiny": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False),
}


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
    from engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(config, dtype=dtype, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def to_transformers(model, config: ModelConfig):
    """A transformers LlamaForCausalLM sharing our parameter tensors (no copy)."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights
    rope = dict(rope_type="default", rope_theta=config.rope_theta)
    max_positions = config.max_position_embeddings
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope = dict(rope_type="llama3", rope_theta=config.rope_theta, factor=s.factor,
                    low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
        # transformers requires the scaled length to exceed the original one; Llama-3.1
        # declares 16x (131072 for 8192). The cos/sin it computes do not depend on it.
        max_positions = max(max_positions, 16 * s.original_max_position_embeddings)
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        rope_parameters=rope)
    device = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    with torch.device(device), no_init_weights():
        hf = HFLlama(hf_config).to(dtype)
    hf.load_state_dict(model.state_dict(), assign=True)
    return hf.eval()


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


def decode_schedule(batch: int, context: int, blocks_per_seq: int):
    from engine.schedule_output import ScheduledChunk, ScheduleOutput

    # Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq); its newest
    # token sits at position context - 1, so the step attends to `context` positions.
    return ScheduleOutput(tuple(
        ScheduledChunk(f"d{i}", (1 + i % 1000,), context - 1,
                       tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)), True)
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


def run_transformers_eager(hf, config: ModelConfig, device: torch.device, results: ModelResults,
                           deadline: float, batches=DECODE_BATCHES, contexts=CONTEXTS,
                           prefills=PREFILLS) -> None:
    from transformers import DynamicCache

    dtype = next(hf.parameters()).dtype
    for batch in batches:
        for context in contexts:
            key = f"decode batch {batch} ctx {context}"
            if time.monotonic() > deadline:
                results.notes.append(f"transformers eager {key}: skipped (time budget)")
                continue

            def case(batch=batch, context=context, key=key) -> None:
                # The context is already cached (random K/V, as a prefill would leave it);
                # each timed step appends one token, as `generate` does.
                cache = DynamicCache(config=hf.config)
                shape = (batch, config.num_kv_heads, context - 1, config.head_dim)
                with torch.no_grad():
                    for layer in range(config.num_layers):
                        cache.update(torch.randn(shape, device=device, dtype=dtype),
                                     torch.randn(shape, device=device, dtype=dtype), layer)
                ids = torch.ones(batch, 1, dtype=torch.long, device=device)
                pos = [context - 1]

                def one_step() -> None:
                    with torch.no_grad():
                        hf(input_ids=ids, past_key_values=cache, use_cache=True,
                           position_ids=torch.full((batch, 1), pos[0], device=device))
                    pos[0] += 1

                results.hf_eager_ms[key] = time_ms(one_step, device, warmup=2, reps=8)
                log(f"transformers eager {key}: {results.hf_eager_ms[key]:8.2f} ms")
                del cache
            guarded(f"transformers eager {key}", results, case)
    for num_seqs in prefills:
        key = f"{num_seqs}x{PREFILL_LEN}"

        def case(num_seqs=num_seqs, key=key) -> None:
            ids = torch.randint(0, config.vocab_size, (num_seqs, PREFILL_LEN), device=device)
            with torch.no_grad():
                ms = time_ms(lambda: hf(input_ids=ids, use_cache=False, logits_to_keep=1),
                             device, warmup=1, reps=3)
            results.hf_eager_ms[key] = ms
            log(f"transformers eager prefill {key}: {ms:8.2f} ms")
        guarded(f"transformers eager prefill {key}", results, case)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_transformers_compiled(shape: str, seed: int, results: ModelResults, deadline: float,
                              cases=((1, 512), (32, 512))) -> None:
    """Each case in a child process with a hard timeout: a compile that overruns is killed,
    not waited for. Needs about 90 s per case (model build, compile, two generations)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for batch, context in cases:
        key = f"decode batch {batch} ctx {context}"
        left = deadline - time.monotonic()
        # On an H200 a case took ~40 s (build, compile, two generations); 75 s leaves slack.
        if left < 75:
            reason = f"skipped: {left:.0f} s of the time budget left, a case needs ~75 s"
            log(f"transformers compiled {key}: {reason}")
            results.notes.append(f"transformers static cache + torch.compile {key}: {reason}")
            continue
        cmd = [sys.executable, "-m", "benchmarks.engine_gpu_model", "--compiled-child", "--shape", shape, "--seed", str(seed),
               "--batch", str(batch), "--context", str(context)]
        log(f"transformers compiled {key}: child with timeout {left:.0f} s")
        try:
            proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            results.notes.append(f"transformers compiled {key}: killed at the time budget "
                                 f"({left:.0f} s)")
            log(f"transformers compiled {key}: timed out")
            continue
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPILED_RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stdout + proc.stderr)[-1500:]
            log(f"transformers compiled {key}: child failed (rc {proc.returncode}):\n{tail}")
            results.notes.append(f"transformers compiled {key}: failed (rc {proc.returncode})")
            continue
        found = json.loads(lines[-1].split(" ", 1)[1])
        results.hf_compiled_ms[key] = found["step_ms"]
        results.notes.append(f"transformers compiled {key}: compile + first generate took "
                             f"{found['first_generate_s']:.0f} s")
        log(f"transformers compiled {key}: {found['step_ms']:.2f} ms/step "
            f"(first generate {found['first_generate_s']:.0f} s)")


def compiled_child(shape: str, seed: int, batch: int, context: int) -> int:
    """Static cache + torch.compile (transformers' auto-compile in `generate`): per-step
    time is the median gap between streamed tokens of a second, warm generation."""
    from transformers.generation.streamers import BaseStreamer

    on_cuda = torch.cuda.is_available()  # CPU: a plumbing check only (nothing compiles)
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    config = SHAPES[shape]
    hf = to_transformers(build_random_model(config, seed, device, dtype), config)

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            sync(device)
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    prompt = torch.randint(0, config.vocab_size, (batch, context - 1), device=device)
    kwargs = dict(attention_mask=torch.ones_like(prompt), pad_token_id=0,
                  max_new_tokens=64, min_new_tokens=64, do_sample=False,
                  cache_implementation="static")
    start = time.perf_counter()
    hf.generate(prompt, **kwargs)
    first = time.perf_counter() - start
    clock = StepClock()
    hf.generate(prompt, streamer=clock, **kwargs)
    gaps = [1000 * (b - a) for a, b in zip(clock.times[2:], clock.times[3:])]
    print("COMPILED_RESULT " + json.dumps({"step_ms": statistics.median(gaps),
                                           "first_generate_s": first}), flush=True)
    return 0


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


def model_section(shape: str, seed: int, copy_rate: float, matmul_rate: float,
                  time_budget_s: float, device_name: str) -> list[str]:
    """Run every part inside the time budget; returns markdown lines (never raises)."""
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
        return [f"### Model", "", f"- model construction failed: {exc}"]
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled-child", action="store_true", required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--context", type=int, required=True)
    a = parser.parse_args()
    sys.exit(compiled_child(a.shape, a.seed, a.batch, a.context))
