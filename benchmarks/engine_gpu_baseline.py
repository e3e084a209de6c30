"""The baseline of the GPU engine benchmark's model section: `transformers` on the same
device with the same random weights (benchmarks/engine_gpu_model.py builds them).

    eager     forward with a DynamicCache holding the same context
    compiled  static cache + torch.compile through `generate`, in a child process with a
              hard timeout (`python -m benchmarks.engine_gpu_baseline --compiled-child ...`,
              from the repository root): compilation takes about a minute per batch size
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.engine_gpu_model import (CONTEXTS, DECODE_BATCHES, PREFILL_LEN, PREFILLS,
                                         ModelResults, build_random_model, guarded, log, sync,
                                         time_ms)
from engine.config import ModelConfig
from testing.shapes import SHAPES


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


def eager_decode_ms(hf, config: ModelConfig, batch: int, context: int, device: torch.device,
                    reps: int) -> float:
    """transformers' eager decode step at `batch` rows of `context` tokens: the context is
    already cached (random K/V, as a prefill would leave it); each timed step appends one
    token, as `generate` does."""
    from transformers import DynamicCache

    dtype = next(hf.parameters()).dtype
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

    return time_ms(one_step, device, warmup=2, reps=reps)


def run_transformers_eager(hf, config: ModelConfig, device: torch.device, results: ModelResults,
                           deadline: float, batches=DECODE_BATCHES, contexts=CONTEXTS,
                           prefills=PREFILLS) -> None:
    for batch in batches:
        for context in contexts:
            key = f"decode batch {batch} ctx {context}"
            if time.monotonic() > deadline:
                results.notes.append(f"transformers eager {key}: skipped (time budget)")
                continue

            def case(batch=batch, context=context, key=key) -> None:
                results.hf_eager_ms[key] = eager_decode_ms(hf, config, batch, context, device,
                                                           reps=8)
                log(f"transformers eager {key}: {results.hf_eager_ms[key]:8.2f} ms")
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
        cmd = [sys.executable, "-m", "benchmarks.engine_gpu_baseline", "--compiled-child", "--shape", shape, "--seed", str(seed),
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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled-child", action="store_true", required=True,
                        help="internal: run one compiled transformers measurement")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                        help="model shape (default llama3-8b)")
    parser.add_argument("--seed", type=int, required=True, help="random weights' seed")
    parser.add_argument("--batch", type=int, required=True, help="decode batch size")
    parser.add_argument("--context", type=int, required=True, help="context tokens per row")
    a = parser.parse_args()
    sys.exit(compiled_child(a.shape, a.seed, a.batch, a.context))
