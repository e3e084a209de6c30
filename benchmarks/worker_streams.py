"""What a worker's event loop spends per streamed token.

A decode worker's event loop carries every token from the engine thread to the gateway's
channel while the engine thread runs the next step, and the two share one interpreter
lock: each microsecond of the loop's per-token work is taken from the steps once batches
are large. This starts `pdserve up --colocated --workers 1` on a model (a tiny random one
makes the steps cheap, so tokens come fast), opens `--streams` concurrent decode streams
straight to the worker over the channel (local prefill, greedy, EOS ignored) and reads,
from /proc, the CPU time of the worker's main thread (the event loop) and of the whole
process over the rounds after a warm-up.

With `--baseline-tree DIR` the same runs also start `pdserve up` from another checkout
(a `git worktree` of an older commit), alternating with this tree run by run, in one call.

    python -m testing.random_model /tmp/tiny --shape tiny
    python -m benchmarks.worker_streams --model /tmp/tiny --streams 1,32,128 \\
        [--baseline-tree /tmp/base] [--repeats 3]

Output: a markdown table on stdout (medians over the repeats); progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from drill.up_cluster import UpCluster
from protocol.messages import DecodeRequest, TokenFrame
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient

FRAME_TIMEOUT_S = 60.0
PROMPT_IDS = list(range(100, 132))  # 32 tokens; the tiny model's ids are all valid


@dataclass(frozen=True)
class Run:
    tokens: int
    seconds: float
    loop_cpu_s: float  # the worker's main thread: its event loop
    process_cpu_s: float

    @property
    def loop_us_per_token(self) -> float:
        return self.loop_cpu_s / self.tokens * 1e6

    @property
    def process_us_per_token(self) -> float:
        return self.process_cpu_s / self.tokens * 1e6


def _cpu_seconds(stat_path: str) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one_stream(client: ControlClient, rid: str, max_tokens: int) -> int:
    request = DecodeRequest(request_id=rid, prompt_token_ids=PROMPT_IDS,
                            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                    ignore_eos=True),
                            timeout_ms=600_000)
    tokens = 0
    async for frame in client.stream(request, TokenFrame, FRAME_TIMEOUT_S, FRAME_TIMEOUT_S):
        assert isinstance(frame, TokenFrame)
        tokens += len(frame.token_ids)
    if tokens != max_tokens:
        raise RuntimeError(f"{rid}: {tokens} tokens, asked for {max_tokens}")
    return tokens


async def _round(client: ControlClient, tag: str, streams: int, max_tokens: int) -> int:
    counts = await asyncio.gather(*(_one_stream(client, f"{tag}-{i}", max_tokens)
                                    for i in range(streams)))
    return sum(counts)


async def _measure(url: str, token: str, pid: int, streams: int, max_tokens: int,
                   rounds: int) -> Run:
    pool = ChannelPool(token)
    client = ControlClient(url, pool)
    try:
        await _round(client, "warm", streams, max_tokens)
        loop0 = _cpu_seconds(f"/proc/{pid}/task/{pid}/stat")
        proc0 = _cpu_seconds(f"/proc/{pid}/stat")
        start = time.perf_counter()
        tokens = 0
        for r in range(rounds):
            tokens += await _round(client, f"r{r}", streams, max_tokens)
        seconds = time.perf_counter() - start
        loop_cpu = _cpu_seconds(f"/proc/{pid}/task/{pid}/stat") - loop0
        proc_cpu = _cpu_seconds(f"/proc/{pid}/stat") - proc0
    finally:
        await client.aclose()
        await pool.aclose()
    return Run(tokens, seconds, loop_cpu, proc_cpu)


def tree_name(tree: Path | None) -> str:
    return "base" if tree else "this"


def run_tree(tree: Path | None, model: str, streams: int, max_tokens: int, rounds: int,
             log_dir: Path) -> Run:
    """One fresh cluster (from `tree`, default this checkout), one measurement."""
    name = tree_name(tree)
    up_args = f"--colocated --workers 1 --model {model} --device cpu --no-agent " \
              f"--threads-per-worker 1"
    cluster = UpCluster(up_args, log_dir / f"up-{name}-{streams}.log", cwd=tree)
    with cluster:
        cluster.wait_ready()
        (worker,) = cluster.workers()
        return asyncio.run(_measure(worker["control_url"], cluster.token, int(worker["pid"]),
                                    streams, max_tokens, rounds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True,
                        help="model directory or .gguf (a tiny random one: "
                             "python -m testing.random_model DIR --shape tiny)")
    parser.add_argument("--streams", default="1,32,128",
                        help="concurrent streams per run, comma-separated (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=128,
                        help="tokens per stream (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measured rounds of --streams streams after one warm-up round "
                             "(default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="fresh clusters per tree and stream count; medians are reported "
                             "(default %(default)s)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="another checkout to measure alternately (e.g. a git worktree)")
    args = parser.parse_args(argv)
    try:
        stream_counts = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams: comma-separated integers, not {args.streams!r}")
    if min(stream_counts) < 1 or min(args.tokens, args.rounds, args.repeats) < 1:
        parser.error("--streams, --tokens, --rounds and --repeats must be at least 1")
    trees: list[Path | None] = [None] + ([args.baseline_tree] if args.baseline_tree else [])
    results: dict[tuple[str, int], list[Run]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-ws-") as tmp:
        for streams in stream_counts:
            for rep in range(args.repeats):
                for tree in (trees if rep % 2 == 0 else trees[::-1]):
                    name = tree_name(tree)
                    run = run_tree(tree, args.model, streams, args.tokens, args.rounds,
                                   Path(tmp))
                    results.setdefault((name, streams), []).append(run)
                    print(f"{name} streams={streams} rep={rep}: {run.tokens} tokens in "
                          f"{run.seconds:.2f} s, loop {run.loop_us_per_token:.1f} us/token, "
                          f"process {run.process_us_per_token:.1f} us/token",
                          file=sys.stderr, flush=True)
    print("| tree | streams | tokens/s | event-loop CPU µs / token | process CPU µs / token |")
    print("|---|---:|---:|---:|---:|")
    for streams in stream_counts:
        for tree in trees:
            name = tree_name(tree)
            runs = results[(name, streams)]
            rate = statistics.median(r.tokens / r.seconds for r in runs)
            loop = statistics.median(r.loop_us_per_token for r in runs)
            proc = statistics.median(r.process_us_per_token for r in runs)
            print(f"| {name} | {streams} | {rate:,.0f} | {loop:.1f} | {proc:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
