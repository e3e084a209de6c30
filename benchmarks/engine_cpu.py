"""Engine throughput on the CPU: pdserve's engine vs `transformers.generate`, side by side.

Both run the same weights (the default model, loaded once by our loader and copied into a
transformers LlamaForCausalLM), the same prompts, greedy decoding with a fixed number of new
tokens, the same torch thread count, in one process, alternating so that machine load hits
both alike. Scenarios:

  single   one request at a time (batch 1)
  conc16   16 requests arriving together: our engine batches them continuously; transformers
           is measured twice: serving them one after another (what an unbatched server
           does), and as one statically padded batch of 16 (its best case: it needs all
           prompts up front and runs every row until the longest finishes).

Usage: python benchmarks/engine_cpu.py [--threads N] [--new-tokens 64] [--repeats 2]
                                       [--markdown out.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):\n    ",
    "List three colours: red,", "In 1969, the first person to walk on the Moon was",
    "Explain photosynthesis in one sentence.", "The quick brown fox", "Once upon a time,",
    "The three laws of thermodynamics are", "A good breakfast includes",
    "Translate to French: good morning", "The largest gas giant in the solar system is",
    "SELECT name FROM users WHERE", "My favourite book is", "Water boils at",
    "The best way to learn a language is",
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def transformers_twin(loaded) -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding exactly our loaded weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = loaded.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, bos_token_id=c.bos_token_id,
        eos_token_id=list(c.eos_token_ids) or None)
    model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """Greedy generate for a (left-padded) batch; returns generated tokens counted."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(prompts)


def ours_generate(engine, prompts: list[list[int]], new_tokens: int) -> int:
    from protocol.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in results)


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    num_tokens = fn()
    return time.perf_counter() - start, num_tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch CPU threads for both engines (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="greedy tokens generated per request (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed repetitions per measurement; the median is kept")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from engine.engine_builder import load_tokenizer
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.loader import load_model

    log("loading the default model")
    loaded = load_model("default")
    tokenizer = load_tokenizer(loaded.tokenizer_source)
    engine = LLMEngine.for_model(loaded.model, loaded.config, tokenizer,
                                 EngineConfig(num_kv_blocks=1024, max_num_seqs=32,
                                              max_num_batched_tokens=512))
    hf = transformers_twin(loaded)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    pad_id = tokenizer.eos_token_ids[0]
    n = args.new_tokens

    def unbatched_hf() -> int:
        return sum(hf_generate(hf, [p], n, pad_id) for p in prompts)

    cases = {
        "single (1 request)": {
            "pdserve engine": lambda: ours_generate(engine, prompts[:1], n),
            "transformers generate": lambda: hf_generate(hf, prompts[:1], n, pad_id),
        },
        "16 concurrent requests": {
            "pdserve engine (continuous batching)": lambda: ours_generate(engine, prompts, n),
            "transformers generate, one request at a time": unbatched_hf,
            "transformers generate, one padded batch of 16": lambda: hf_generate(hf, prompts, n, pad_id),
        },
    }
    log("warming up")
    ours_generate(engine, prompts[:2], 4)
    hf_generate(hf, prompts[:2], 4, pad_id)
    rows = []
    for case, runners in cases.items():
        samples: dict[str, list[float]] = {name: [] for name in runners}
        for repeat in range(args.repeats):
            for name, fn in runners.items():  # alternate, so load drifts hit every runner
                seconds, num_tokens = timed(fn)
                samples[name].append(num_tokens / seconds)
                log(f"{case} | {name} | run {repeat + 1}: {num_tokens / seconds:.1f} tokens/s")
        base = statistics.median(samples[next(iter(runners))])
        for name, values in samples.items():
            rate = statistics.median(values)
            rows.append((case, name, rate, base / rate))
    lines = [
        f"| scenario | system | tokens/s | pdserve ÷ this |",
        "|---|---|---:|---:|",
        *[f"| {case} | {name} | {rate:.1f} | {ratio:.2f}x |" for case, name, rate, ratio in rows],
    ]
    header = (f"threads={args.threads}, new tokens per request={n}, greedy, float32, "
              f"median of {args.repeats}, torch {torch.__version__}")
    table = header + "\n\n" + "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
