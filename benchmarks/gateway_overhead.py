"""What the gateway adds: TTFT and CPU per relayed token, gateway vs the stub worker directly.

One run, side by side: a stub decode worker (benchmarks/gateway_stub_worker.py) streams
`--num-tokens` tokens per request, one frame per token, back to back or paced
`--interval-ms` apart; the same streams are read

    direct:   client ── DecodeRequest ──▶ stub            (first frame = first token)
    gateway:  client ── /v1/completions stream ──▶ pdserve gateway ──▶ stub

at 1, 16 and 100 concurrent streams. Reported: added TTFT p50/p99 (gateway minus direct),
and the gateway process's CPU time (all threads, /proc/<pid>/task/*/schedstat) per 1,000
relayed tokens. Every gateway stream is checked: exactly `num_tokens` events in
order, then [DONE] (no event merged, dropped or reordered).

    .venv/bin/python -m benchmarks.gateway_overhead [--rounds 3] [--num-tokens 64]
        [--tracing off on]

`--tracing off on` measures the gateway with traces off and on (exported over OTLP/HTTP
to a sink in this process that counts the bytes it receives), side by side;
`--baseline DIR` adds the gateway of another checkout (e.g. `git worktree add DIR REV`),
run from DIR with this interpreter, as the row "baseline".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from common.contract.control_client import ControlClient
from common.contract.protocol import DecodeRequest, DecodeResponseFrame, TokenFrame
from common.contract.sampling_params import SamplingParams
from gateway.sse import SseDecoder
from launcher.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[1]
TIERS = "[tiers.standard]\nlocal_prefill_max_tokens = 1000000\n"


def cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads: schedstat's nanoseconds where the kernel has
    them (/proc/<pid>/stat counts clock ticks, 10 ms here: too coarse for a 1-stream round)."""
    try:
        return sum(int(path.read_text().split()[0])
                   for path in Path(f"/proc/{pid}/task").glob("*/schedstat")) / 1e9
    except (FileNotFoundError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(argv: list[str], marker: str, cwd: Path = REPO) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", *argv], cwd=cwd, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = process.stdout.readline()
    if marker not in line:
        process.kill()
        raise RuntimeError(f"{argv[0]} did not start: {line!r}")
    return process, line.rsplit(" ", 1)[-1].strip()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def direct_stream(client: ControlClient, num_tokens: int) -> float:
    started = time.perf_counter()
    ttft = None
    message = DecodeRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 2, 3],
                            sampling=SamplingParams(max_tokens=num_tokens), timeout_ms=60_000)
    count = 0
    async for frame in client.stream("/internal/decode", message, DecodeResponseFrame, 30, 30):
        assert isinstance(frame, TokenFrame)
        if ttft is None:
            ttft = time.perf_counter() - started
        count += len(frame.token_ids)
    assert count == num_tokens, f"direct stream had {count} tokens"
    return ttft


async def gateway_stream(session: aiohttp.ClientSession, url: str, num_tokens: int) -> float:
    # Token ids, as the direct path sends: the relay is measured, not the tokenizer.
    body = {"model": "default", "prompt": [1, 2, 3], "max_tokens": num_tokens, "stream": True}
    started = time.perf_counter()
    ttft = None
    decoder, events = SseDecoder(), []
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for chunk in response.content.iter_any():
            for event in decoder.feed(chunk):
                if ttft is None:
                    ttft = time.perf_counter() - started
                events.append(event)
    assert events[-1] == b"[DONE]", "stream did not end with [DONE]"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    # One event per token, each " word" in order (the stub's reply).
    assert len(texts) == num_tokens, f"{len(texts)} events for {num_tokens} tokens"
    assert all(t == " word" or (i == 0 and t == "word") for i, t in enumerate(texts)), texts[:5]
    return ttft


async def measure(url: str, stub_url: str, gateway_pid: int, concurrency: int, rounds: int,
                  num_tokens: int) -> dict:
    direct, via = [], []
    cpu_s = 0.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = ControlClient(stub_url, session=session)
        await gateway_stream(session, url, num_tokens)  # warm the connection pools
        await direct_stream(client, num_tokens)
        for _ in range(rounds):
            direct += await asyncio.gather(*(direct_stream(client, num_tokens)
                                             for _ in range(concurrency)))
            before = cpu_seconds(gateway_pid)
            via += await asyncio.gather(*(gateway_stream(session, url, num_tokens)
                                          for _ in range(concurrency)))
            cpu_s += cpu_seconds(gateway_pid) - before
    num_relayed = rounds * concurrency * num_tokens
    return {"concurrency": concurrency,
            "direct_p50_ms": 1000 * statistics.median(direct),
            "gateway_p50_ms": 1000 * statistics.median(via),
            "added_p50_ms": 1000 * (statistics.median(via) - statistics.median(direct)),
            "added_p99_ms": 1000 * (percentile(via, 0.99) - percentile(direct, 0.99)),
            "cpu_ms_per_1k_tokens": 1000 * cpu_s / num_relayed * 1000}


class SpanSink:
    """An OTLP/HTTP endpoint that takes every export (200) and counts the bytes."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.num_bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                sink.num_bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def run_scenario(redis_url: str, interval_ms: float, args: argparse.Namespace,
                 otlp_url: str | None = None, tree: Path = REPO) -> list[dict]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    stub, stub_url = spawn(["benchmarks.gateway_stub_worker", "--redis-url", redis_url,
                            "--namespace", namespace, "--num-tokens", str(args.num_tokens),
                            "--token-interval-ms", str(interval_ms)], "listening on")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as tiers:
        tiers.write(TIERS)
    gateway, url = spawn(["launcher.cli", "gateway", "--redis-url", redis_url, "--port", "0",
                          "--namespace", namespace, "--tiers", tiers.name,
                          "--log-level", "warning",
                          *(["--otlp-endpoint", otlp_url] if otlp_url else [])], "listening on",
                         cwd=tree)
    try:
        deadline = time.monotonic() + 20
        while b'"ready": true' not in _get(url + "/ready"):
            if time.monotonic() > deadline:
                raise RuntimeError("gateway not ready")
            time.sleep(0.1)
        return [asyncio.run(measure(url, stub_url, gateway.pid, c, args.rounds, args.num_tokens))
                for c in args.concurrency]
    finally:
        for process in (gateway, stub):
            process.terminate()
        for process in (gateway, stub):
            stop(process)
        os.unlink(tiers.name)


def stop(process: subprocess.Popen) -> None:
    """Wait for a terminated process; kill it when it takes too long (a loaded host)."""
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        print(f"pid {process.pid} ignored SIGTERM for 20 s; killing it", file=sys.stderr)
        process.kill()
        process.wait(10)


def _get(url: str) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read()
    except urllib.error.HTTPError as exc:
        return exc.read()
    except OSError:
        return b""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 100])
    parser.add_argument("--tracing", nargs="+", choices=("off", "on"), default=["off"],
                        help="measure with traces off, on (to a local OTLP sink), or both")
    parser.add_argument("--baseline", type=Path,
                        help="also measure the gateway of this checkout (traces off)")
    args = parser.parse_args()
    print("| tracing | pacing | streams | direct TTFT p50 ms | gateway TTFT p50 ms "
          "| added p50 ms | added p99 ms | gateway CPU ms / 1k tokens |")
    print("|---|---|---|---|---|---|---|---|")
    sink = SpanSink() if "on" in args.tracing else None
    with RedisServer() as redis:
        for label, interval in (("back-to-back", 0.0), (f"{args.interval_ms:g} ms", args.interval_ms)):
            configs = [(t, REPO) for t in args.tracing]
            configs += [("baseline", args.baseline)] if args.baseline else []
            for tracing, tree in configs:
                otlp = sink.url if sink is not None and tracing == "on" else None
                for row in run_scenario(redis.url, interval, args, otlp, tree):
                    print(f"| {tracing} | {label} | {row['concurrency']} | "
                          f"{row['direct_p50_ms']:.2f} | {row['gateway_p50_ms']:.2f} | "
                          f"{row['added_p50_ms']:.2f} | {row['added_p99_ms']:.2f} | "
                          f"{row['cpu_ms_per_1k_tokens']:.1f} |", flush=True)
    if sink is not None:
        print(f"\nspans exported with tracing on: {sink.num_bytes} bytes of OTLP", flush=True)


if __name__ == "__main__":
    main()
