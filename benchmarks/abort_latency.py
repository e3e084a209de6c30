"""How fast an abort takes effect on a real cluster, measured in the decode worker's own steps.

Starts `pdserve up` (default: the default model, 1 prefill + 1 decode worker) and repeats
two measurements `--rounds` times:

  abort       a decode stream straight to the decode worker (its internal API), aborted
              after 3 tokens: the abort's round trip, and the time until the stream ends
              (ABORTED), each divided by the stream's median gap between tokens (one step);
  disconnect  a completion streamed through the gateway, the client hanging up after 3
              tokens: the time until neither worker holds anything for the request (seen
              by polling both workers' /admin/state), in the same step units.

Results in steps are comparable across machines; the milliseconds it prints are this
machine's. The tests check the cause and effect (no token after the abort); this measures.

    python -m benchmarks.abort_latency [--rounds 10] [--up-args "..."]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from drill.up_cluster import UpCluster
from protocol.messages import AbortRequest, AbortResponse, DecodeRequest, ErrorCode, TokenFrame
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import RemoteError

PROMPT = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 20)
HTTP_TIMEOUT_S = 30.0


async def abort_round(decode_url: str, token: str, prompt_ids: list[int], i: int
                      ) -> tuple[float, float, float]:
    """(abort round trip, abort sent -> stream ended, median token gap), in seconds."""
    # Two channels, as the gateway's stream and its abort would not share a stream.
    streams, aborts = ChannelPool(token), ChannelPool(token)
    client = ControlClient(decode_url, streams)
    aborter = ControlClient(decode_url, aborts)
    arrivals: list[float] = []
    ended_at: list[float] = []

    async def consume() -> None:
        try:
            async for frame in client.stream(DecodeRequest(
                    request_id=f"bench-abort-{i}", prompt_token_ids=prompt_ids,
                    sampling=SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True),
                    timeout_ms=120_000), TokenFrame, HTTP_TIMEOUT_S, HTTP_TIMEOUT_S):
                arrivals.extend(time.perf_counter() for _ in frame.token_ids)
        except RemoteError as exc:
            if exc.frame.code is not ErrorCode.ABORTED:
                raise
            ended_at.append(time.perf_counter())

    try:
        task = asyncio.create_task(consume())
        while len(arrivals) < 8:  # a few gaps to measure a step by
            if task.done():
                task.result()
                raise RuntimeError("the stream ended before the abort")
            await asyncio.sleep(0.005)
        sent = time.perf_counter()
        answer = await aborter.call(AbortRequest(request_id=f"bench-abort-{i}"), AbortResponse,
                                    HTTP_TIMEOUT_S)
        answered = time.perf_counter()
        await asyncio.wait_for(task, HTTP_TIMEOUT_S)
    finally:
        await streams.aclose()
        await aborts.aclose()
    if not answer.found or not ended_at:
        raise RuntimeError(f"abort {i}: found={answer.found}, stream ended={bool(ended_at)}")
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
    return answered - sent, ended_at[0] - sent, statistics.median(gaps)


def _held(state_urls: list[str], token: str) -> int:
    held = 0
    for url in state_urls:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            state = json.loads(response.read())
        held += state["num_held_tables"] + state["num_running"] + state["num_waiting"]
    return held


async def disconnect_round(gateway_url: str, model: str, state_urls: list[str], token: str
                           ) -> tuple[float, float]:
    """(client hang-up -> nothing held on either worker, median token gap), in seconds."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    arrivals: list[float] = []
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S * 4, sock_read=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{gateway_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data: {"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) >= 8:
                        break
            response.close()  # hang up
    gone = time.perf_counter()
    deadline = gone + HTTP_TIMEOUT_S
    while await asyncio.to_thread(_held, state_urls, token):
        if time.perf_counter() > deadline:
            raise RuntimeError("KV still held 30 s after the client hung up")
    freed = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals[1:], arrivals[2:])]
    return freed - gone, statistics.median(gaps)


def _summary(name: str, seconds: list[float], steps: list[float]) -> str:
    return (f"{name:<34} steps p50 {statistics.median(steps):5.2f}  max {max(steps):5.2f}   "
            f"(ms on this machine: p50 {statistics.median(seconds) * 1000:7.1f}, "
            f"max {max(seconds) * 1000:7.1f})")


async def measure(cluster: UpCluster, rounds: int) -> list[str]:
    workers = cluster.workers()
    decode = next(w for w in workers if w["role"] in ("decode", "both", "colocated"))
    state_urls = [w["control_url"] + "/admin/state" for w in workers]
    model = cluster.get_json("/v1/models")["data"][0]["id"]
    from engine.engine_builder import load_tokenizer
    from engine.loader import load_model

    prompt_ids = load_tokenizer(load_model("default").tokenizer_source).encode(PROMPT)
    answered, ended, ended_steps, answered_steps = [], [], [], []
    freed, freed_steps = [], []
    for i in range(rounds):
        rtt, end, step = await abort_round(decode["control_url"], cluster.token, prompt_ids, i)
        answered.append(rtt)
        ended.append(end)
        answered_steps.append(rtt / step)
        ended_steps.append(end / step)
        gone, step = await disconnect_round(cluster.url, model, state_urls, cluster.token)
        freed.append(gone)
        freed_steps.append(gone / step)
        print(f"round {i + 1}/{rounds}: abort answered {rtt * 1000:.1f} ms, stream ended "
              f"{end * 1000:.1f} ms, hang-up freed {gone * 1000:.1f} ms", file=sys.stderr)
    return [_summary("abort answered", answered, answered_steps),
            _summary("abort sent -> stream ended", ended, ended_steps),
            _summary("client hang-up -> KV freed (both)", freed, freed_steps)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.abort_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10,
                        help="measurements of each kind (default: %(default)s)")
    parser.add_argument("--up-args", default="--threads-per-worker 1",
                        help="arguments for `pdserve up` (default: %(default)r)")
    parser.add_argument("--log", type=Path, default=None,
                        help="the cluster's log file (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    log = args.log or Path(tempfile.mkdtemp(prefix="pdserve-abort-")) / "up.log"
    with UpCluster(args.up_args, log) as cluster:
        cluster.wait_ready()
        lines = asyncio.run(measure(cluster, args.rounds))
    print(f"{args.rounds} rounds, `pdserve up {args.up_args}`; 1 step = the stream's median "
          f"gap between tokens")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
