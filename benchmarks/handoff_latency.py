"""What the prefill → decode handoff adds to a request's latency, side by side in one run.

`pdserve up` clusters on the same machine and model, one after the other, each answering
the same prompts one at a time (streamed completions, token-id prompts, greedy, EOS
ignored):

  colocated    two colocated workers (under CUDA MPS on one GPU): each request is
               prefilled and decoded by one worker, with no handoff;
  early        1 prefill + 1 decode worker (under MPS): the handoff as it runs, the prefill
               started beside the reservation (early prefill: the KV's destination
               follows), the transfer announced while the prompt computes and, between
               GPUs of one host, each layer copied as soon as it is computed.

(The reservation-first and after-step variants this compared once are gone from the
product: docs/benchmark_journal.md, "Layer-wise push and the handoff's added latency, H200"
and "The handoff on the H200 with early prefill".)

`--background-streams N` keeps N long decode streams running on the cluster meanwhile (a
decode worker with a batch to step, as in service; their tokens are not measured): a
reservation then waits for the decode worker's current step.

Per prompt length it reports the median time to token 1 (TTFT) and to token 2 (the first
token the decode worker computes, so it waits for the KV), and what each split mode adds
over colocated; and the time the cluster's engines spent in steps that prefilled (from
the workers' /metrics around each request), which tells slower prefill compute from time
spent outside the engines. The yardstick is one layer's copy for that prompt, timed in this process
on the GPU with the kernel the mapped transfer uses (engine/kernels/block_copy.py): the
target is added latency <= 1.2 x that + 1 ms. Every mode must produce the same tokens
for the same prompt (a wrong or late copy changes them): the run fails otherwise.

    python -m testing.random_model /tmp/m --shape llama3-8b
    PDSERVE_DTYPE=bfloat16 python -m benchmarks.handoff_latency --model /tmp/m \\
        --up-args "--device cuda" --prompt-tokens 512,2048,8188 --out out/handoff

Output: OUT/<mode>.log (each cluster's log), OUT/handoff.json (every sample), and the
markdown table on stdout. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drill.up_cluster import UpCluster

MODES: dict[str, tuple[str, dict[str, str]]] = {  # `pdserve up` options, the environment
    "colocated": ("--colocated --workers 2", {}),
    "early": ("--prefill 1 --decode 1", {}),
}
BACKGROUND_PROMPT_TOKENS = 16
BACKGROUND_MAX_TOKENS = 256
# Every prompt goes to the prefill pool (a split mode) and nowhere else: no local prefill.
TIERS = """default_tier = "bench"

[tiers.bench]
priority = 0
ttft_ms = 60000
tpot_ms = 10000
max_queued = 64
max_running = 64
max_wait_ms = 600000
local_prefill_max_tokens = 0
"""
REQUEST_TIMEOUT_S = 120.0
NUM_OUTPUT_TOKENS = 4


@dataclass
class Sample:
    prompt_tokens: int
    ttft_ms: float
    token2_ms: float
    text: str
    prefill_steps_ms: float = 0.0  # the cluster's engine steps that prefilled, this request


@dataclass
class ModeResult:
    mode: str
    samples: list[Sample] = field(default_factory=list)
    pushes: dict[str, float] = field(default_factory=dict)  # pdserve_kv_pushes_total by start

    def median(self, prompt_tokens: int, what: str) -> float:
        return statistics.median(getattr(s, what) for s in self.samples
                                 if s.prompt_tokens == prompt_tokens)

    def outside_median(self, prompt_tokens: int) -> float:
        """Median of TTFT less the prefill steps' time: what the request spent outside the
        engines (the gateway, the reservation, the messages)."""
        return statistics.median(s.ttft_ms - s.prefill_steps_ms for s in self.samples
                                 if s.prompt_tokens == prompt_tokens)


def prompts_for(lengths: list[int], num_requests: int, vocab_size: int,
                seed: int) -> dict[int, list[list[int]]]:
    """Distinct random token-id prompts (no two share a first block: no prefix hits)."""
    rng = random.Random(seed)
    return {n: [[rng.randrange(1000, vocab_size) for _ in range(n)]
                for _ in range(num_requests)] for n in lengths}


async def stream_one(session, url: str, token: str, model: str, prompt: list[int]) -> Sample:
    """One streamed completion; the times of its first two tokens' events."""
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_OUTPUT_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    times: list[float] = []
    text = ""
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {token}"}) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                if choice.get("text"):
                    times.append(time.perf_counter())
                    text += choice["text"]
    if len(times) < 2:
        raise RuntimeError(f"fewer than two token events in the stream: {text!r}")
    return Sample(len(prompt), (times[0] - started) * 1e3, (times[1] - started) * 1e3, text)


async def prefill_step_s(session, cluster: UpCluster) -> float:
    """Seconds the cluster's workers spent in engine steps that prefilled something so far
    (every step's time less the decode-only steps'): what splits a handoff's added TTFT
    into slower prefill compute and time outside the engines."""
    from telemetry.metrics import parse_samples

    total = 0.0
    for worker in cluster.workers():
        async with session.get(worker["control_url"] + "/metrics") as response:
            samples = parse_samples(await response.text())
        total += (samples.get("pdserve_step_seconds_sum", 0.0)
                  - samples.get("pdserve_decode_step_seconds_sum", 0.0))
    return total


async def background_stream(session, url: str, token: str, model: str, prompt: list[int],
                            started: asyncio.Event) -> None:
    """Long decode streams, one after the other, until cancelled (load, not measured)."""
    body = {"model": model, "prompt": prompt, "max_tokens": BACKGROUND_MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    while True:
        async with session.post(f"{url}/v1/completions", json=body,
                                headers={"Authorization": f"Bearer {token}"}) as response:
            if response.status != 200:
                raise RuntimeError(f"background stream: HTTP {response.status}")
            async for _ in response.content:
                started.set()


async def run_mode(cluster: UpCluster, prompts: dict[int, list[list[int]]],
                   warm_up: int, num_background: int, vocab_size: int) -> list[Sample]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    background: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{cluster.url}/v1/models", headers={
                "Authorization": f"Bearer {cluster.token}"}) as response:
            model = (await response.json())["data"][0]["id"]
        rng = random.Random(1)
        for _ in range(num_background):
            started = asyncio.Event()
            prompt = [rng.randrange(1000, vocab_size) for _ in range(BACKGROUND_PROMPT_TOKENS)]
            background.append(asyncio.create_task(background_stream(
                session, cluster.url, cluster.token, model, prompt, started)))
            await asyncio.wait_for(started.wait(), REQUEST_TIMEOUT_S)
        try:
            return await measure(session, cluster, model, prompts, warm_up)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)


async def measure(session, cluster: UpCluster, model: str, prompts: dict[int, list[list[int]]],
                  warm_up: int) -> list[Sample]:
    """The prompts one at a time, each length's warm-up first."""
    samples = []
    for n, batch in prompts.items():
        for prompt in batch[:warm_up]:  # discarded: first use of this length's shapes
            await stream_one(session, cluster.url, cluster.token, model, prompt)
        for i, prompt in enumerate(batch[warm_up:]):
            before = await prefill_step_s(session, cluster)
            sample = await stream_one(session, cluster.url, cluster.token, model, prompt)
            sample.prefill_steps_ms = (await prefill_step_s(session, cluster) - before) * 1e3
            samples.append(sample)
            print(f"   {n} tokens, request {i + 1}: TTFT {sample.ttft_ms:.1f} ms, "
                  f"token 2 {sample.token2_ms:.1f} ms, prefill steps "
                  f"{sample.prefill_steps_ms:.1f} ms", file=sys.stderr)
    return samples


def push_counts(cluster: UpCluster) -> dict[str, float]:
    """The workers' completed KV pushes by how they started (proof of the path taken), and
    the sum and count of their durations (announce to the receiver's confirmation)."""
    import urllib.request

    from telemetry.metrics import parse_samples

    counts: dict[str, float] = {}
    for worker in cluster.workers():
        with urllib.request.urlopen(worker["control_url"] + "/metrics", timeout=5) as response:
            for name, value in parse_samples(response.read().decode()).items():
                if name.startswith("pdserve_kv_pushes_total{"):
                    start = name.split('"')[1]
                    counts[start] = counts.get(start, 0) + value
                elif name.startswith("pdserve_kv_transfer_seconds_") and 'sent' in name:
                    key = "transfer_s_" + name.split("{")[0].rsplit("_", 1)[1]  # sum, count
                    counts[key] = counts.get(key, 0) + value
    return counts


def layer_copy_ms(model_dir: Path, lengths: list[int], block_size: int,
                  dtype_name: str) -> dict[int, float]:
    """One layer's K and V for an n-token prompt copied between two pools of this GPU with
    the mapped transfer's kernel (median of 50, CUDA events); {} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    from engine.hf_reader import read_config
    from engine.kernels.block_copy import copy_blocks_triton

    config = read_config(model_dir)
    dtype = getattr(torch, dtype_name)
    out = {}
    for n in lengths:
        num_blocks = math.ceil(n / block_size)
        shape = (1, 2, 2 * num_blocks, block_size, config.num_kv_heads, config.head_dim)
        src = torch.randn(shape, device="cuda").to(dtype)
        dst = torch.zeros_like(src)
        ids = torch.randperm(2 * num_blocks, device="cuda", dtype=torch.int32)
        src_ids, dst_ids = ids[:num_blocks].contiguous(), ids[num_blocks:].contiguous()
        times = []
        for _ in range(60):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_blocks_triton(src, dst, src_ids, dst_ids, range(0, 1))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        if not torch.equal(dst[:, :, dst_ids.long()], src[:, :, src_ids.long()]):
            raise RuntimeError("the layer copy did not copy")
        out[n] = statistics.median(times[10:])
        del src, dst
    torch.cuda.empty_cache()
    return out


def table(results: dict[str, ModeResult], lengths: list[int],
          layer_ms: dict[int, float]) -> str:
    rows = ["| prompt tokens | one layer's copy | target (1.2 x copy + 1 ms) | mode | TTFT p50 "
            "| token 2 p50 | added TTFT | added to token 2 | prefill steps p50 | added in "
            "prefill steps | outside the engines p50 | added outside |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = results.get("colocated")
    for n in lengths:
        copy = layer_ms.get(n)
        target = None if copy is None else 1.2 * copy + 1.0
        for mode, result in results.items():
            ttft, t2 = result.median(n, "ttft_ms"), result.median(n, "token2_ms")
            added = ("" if base is None or mode == "colocated" else
                     f"{ttft - base.median(n, 'ttft_ms'):+.2f} ms")
            added2 = ("" if base is None or mode == "colocated" else
                      f"{t2 - base.median(n, 'token2_ms'):+.2f} ms")
            steps = result.median(n, "prefill_steps_ms")
            added3 = ("" if base is None or mode == "colocated" else
                      f"{steps - base.median(n, 'prefill_steps_ms'):+.2f} ms")
            outside = result.outside_median(n)
            added4 = ("" if base is None or mode == "colocated" else
                      f"{outside - base.outside_median(n):+.2f} ms")
            rows.append(f"| {n} | {'' if copy is None else f'{copy * 1e3:.0f} µs'} | "
                        f"{'' if target is None else f'{target:.2f} ms'} | {mode} | "
                        f"{ttft:.2f} ms | {t2:.2f} ms | {added} | {added2} | "
                        f"{steps:.2f} ms | {added3} | {outside:.2f} ms | {added4} |")
    return "\n".join(rows)


def check_same_tokens(results: dict[str, ModeResult]) -> None:
    """Greedy, same prompts: every mode's text must be the colocated one's."""
    modes = list(results)
    for mode in modes[1:]:
        for a, b in zip(results[modes[0]].samples, results[mode].samples, strict=True):
            if a.text != b.text:
                raise SystemExit(f"{mode} answered {b.text!r} where {modes[0]} answered "
                                 f"{a.text!r} ({a.prompt_tokens}-token prompt)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (random_model.py)")
    parser.add_argument("--prompt-tokens", default="512,2048,8188",
                        help="comma-separated prompt lengths (default %(default)s)")
    parser.add_argument("--requests", type=int, default=6,
                        help="measured requests per length and mode (default %(default)s)")
    parser.add_argument("--warm-up", type=int, default=2,
                        help="discarded requests per length before those (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, from {', '.join(MODES)} (default: all)")
    parser.add_argument("--up-args", default="", help="extra `pdserve up` options for every "
                        "mode, e.g. \"--device cuda\"")
    parser.add_argument("--block-size", type=int, default=16,
                        help="the workers' KV block size (default %(default)s)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="KV dtype of the layer-copy yardstick (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument("--background-streams", type=int, default=0,
                        help="long decode streams kept running during the measurements "
                             f"({BACKGROUND_PROMPT_TOKENS}-token prompts, "
                             f"{BACKGROUND_MAX_TOKENS} tokens each, restarted; default 0)")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0,
                        help="how long a cluster may take to come up (default %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/handoff"),
                        help="where logs and handoff.json go (default %(default)s)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or not lengths or min(lengths) < 1 or args.requests < 1 or args.warm_up < 0 \
            or args.background_streams < 0:
        parser.error(f"bad --modes {unknown}, --prompt-tokens, --requests, --warm-up or "
                     "--background-streams")
    from engine.hf_reader import read_config

    vocab_size = read_config(Path(args.model)).vocab_size
    args.out.mkdir(parents=True, exist_ok=True)
    tiers = args.out / "tiers.toml"
    tiers.write_text(TIERS)
    print(">> timing one layer's copy per prompt length", file=sys.stderr)
    layer_ms = layer_copy_ms(Path(args.model), lengths, args.block_size, args.dtype)
    prompts = prompts_for(lengths, args.warm_up + args.requests, vocab_size, args.seed)
    results: dict[str, ModeResult] = {}
    for mode in modes:
        up_args, env = MODES[mode]
        cluster = UpCluster(f"{up_args} --model {args.model} --tiers {tiers} {args.up_args}",
                            args.out / f"{mode}.log", env=env,
                            ready_timeout_s=args.ready_timeout_s)
        print(f">> {mode}", file=sys.stderr)
        with cluster:
            cluster.wait_ready()
            results[mode] = ModeResult(mode, asyncio.run(run_mode(
                cluster, prompts, args.warm_up, args.background_streams, vocab_size)))
            results[mode].pushes = push_counts(cluster)
            print(f"   pushes by start: {results[mode].pushes}", file=sys.stderr)
    (args.out / "handoff.json").write_text(json.dumps(
        {"layer_copy_ms": layer_ms,
         "modes": {m: {"samples": [asdict(s) for s in r.samples], "pushes": r.pushes}
                   for m, r in results.items()}}, indent=1))
    print(table(results, lengths, layer_ms))
    check_same_tokens(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
