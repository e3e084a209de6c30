"""What the gateway adds: TTFT and CPU per relayed token, gateway vs the stub worker directly.

One run, side by side: a stub decode worker (testing/stub_worker.py) streams
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
`--limits solo shared` measures the admission limits' two paths: solo (one gateway
deciding locally, the default) and shared (`--replicas 2`: a Redis script per admission,
as every replica of several pays);
`--baseline DIR` adds the gateway of another checkout (e.g. `git worktree add DIR REV`),
run from DIR with this interpreter, as the row "baseline".

Peers, in the same run (`--peers`; default: proxy, and vllm-router when it is on the
PATH): the same streams relayed by a plain aiohttp pass-through proxy and by vllm-router
(Rust), both in front of an OpenAI-speaking stub (benchmarks/relay_peers.py) that sends
the same 64 " word" events; their "direct" is the client reading that stub itself, and
the CPU is the relay process's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

import aiohttp

from gateway.api.sse import SseDecoder
from launcher.redis_server import RedisServer
from protocol.messages import DecodeRequest, DecodeResponseFrame, TokenFrame
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient

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
    async for frame in client.stream(message, DecodeResponseFrame, 30, 30):
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
                  num_tokens: int, peer: bool = False) -> dict:
    """`peer`: the relay at `url` and the stub at `stub_url` speak OpenAI (relay_peers.py);
    else `url` is pdserve's gateway and `stub_url` the stub worker's control API."""
    direct, via = [], []
    cpu_s = 0.0
    connector = aiohttp.TCPConnector(limit=0)
    channels = ChannelPool(None)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = ControlClient(stub_url, channels)

        def one_direct() -> Awaitable[float]:
            return gateway_stream(session, stub_url, num_tokens) if peer else \
                direct_stream(client, num_tokens)

        await gateway_stream(session, url, num_tokens)  # warm the connection pools
        await one_direct()
        for _ in range(rounds):
            direct += await asyncio.gather(*(one_direct() for _ in range(concurrency)))
            before = cpu_seconds(gateway_pid)
            via += await asyncio.gather(*(gateway_stream(session, url, num_tokens)
                                          for _ in range(concurrency)))
            cpu_s += cpu_seconds(gateway_pid) - before
    await channels.aclose()
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
                 otlp_url: str | None = None, tree: Path = REPO,
                 extra: tuple[str, ...] = ()) -> list[dict]:
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    stub, stub_url = spawn(["testing.stub_worker", "--redis-url", redis_url,
                            "--namespace", namespace, "--num-tokens", str(args.num_tokens),
                            "--token-interval-ms", str(interval_ms),
                            "--tokenizer-model", args.tokenizer_model], "listening on")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as tiers:
        tiers.write(TIERS)
    gateway, url = spawn(["launcher.cli", "gateway", "--redis-url", redis_url, "--port", "0",
                          "--namespace", namespace, "--tiers", tiers.name,
                          "--log-level", "warning", "--model-name", "default",
                          "--tokenizer-model", args.tokenizer_model,
                          *(["--otlp-endpoint", otlp_url] if otlp_url else []), *extra],
                         "listening on",
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


def run_peer(peer: str, interval_ms: float, args: argparse.Namespace) -> list[dict]:
    """The same streams through a plain aiohttp proxy or vllm-router, against the
    OpenAI-speaking stub (benchmarks/relay_peers.py)."""
    stub, stub_url = spawn(["benchmarks.relay_peers", "stub", "--num-tokens",
                            str(args.num_tokens), "--token-interval-ms", str(interval_ms)],
                           "listening on")
    relay: subprocess.Popen | None = None
    try:
        if peer == "proxy":
            relay, url = spawn(["benchmarks.relay_peers", "proxy", "--upstream", stub_url],
                               "listening on")
        else:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            relay = subprocess.Popen(
                [args.vllm_router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                 stub_url, "--policy", "round_robin", "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while b'"data"' not in _get(url + "/v1/models"):
                if time.monotonic() > deadline or relay.poll() is not None:
                    raise RuntimeError("vllm-router did not start")
                time.sleep(0.2)
        return [asyncio.run(measure(url, stub_url, relay.pid, c, args.rounds, args.num_tokens,
                                    peer=True)) for c in args.concurrency]
    finally:
        for process in (relay, stub):
            if process is not None:
                process.terminate()
                stop(process)


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


def print_row(relay: str, pacing: str, row: dict) -> None:
    print(f"| {relay} | {pacing} | {row['concurrency']} | {row['direct_p50_ms']:.2f} | "
          f"{row['gateway_p50_ms']:.2f} | {row['added_p50_ms']:.2f} | {row['added_p99_ms']:.2f} "
          f"| {row['cpu_ms_per_1k_tokens']:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3,
                        help="measured rounds per setting; medians are reported (default 3)")
    parser.add_argument("--num-tokens", type=int, default=64,
                        help="tokens the stub worker streams per request (default 64)")
    parser.add_argument("--interval-ms", type=float, default=10.0,
                        help="the stub worker's gap between tokens when paced (default 10)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 100],
                        help="concurrent streams per run (default 1 16 100)")
    parser.add_argument("--pacings", nargs="+", choices=("back-to-back", "paced"),
                        default=["back-to-back", "paced"],
                        help="tokens back to back, and/or paced --interval-ms apart")
    parser.add_argument("--tracing", nargs="+", choices=("off", "on"), default=["off"],
                        help="measure with traces off, on (to a local OTLP sink), or both")
    parser.add_argument("--limits", nargs="+", choices=("solo", "shared"), default=["solo"],
                        help="admission limits: solo (one gateway, decided locally) and/or "
                             "shared (--replicas 2: one Redis script per admission)")
    parser.add_argument("--tokenizer-model", default="default",
                        help='the model whose tokenizer the gateway and the stub use: "default" '
                             "(the packaged GGUF) or a model path, e.g. an HF tokenizer folder")
    parser.add_argument("--baseline", type=Path,
                        help="also measure the gateway of this checkout (traces off)")
    parser.add_argument("--peers", nargs="*", choices=("proxy", "vllm-router"), default=None,
                        help="also relay the same streams through these (default: proxy, "
                             "and vllm-router when it is on the PATH); none: --peers alone")
    parser.add_argument("--vllm-router", default=shutil.which("vllm-router"),
                        help="the vllm-router binary (default: the one on the PATH)")
    args = parser.parse_args()
    if args.peers is None:
        args.peers = ["proxy", *(["vllm-router"] if args.vllm_router else [])]
    if "vllm-router" in args.peers and not args.vllm_router:
        parser.error("vllm-router is not on the PATH (pip install vllm-router), or give "
                     "--vllm-router PATH")
    print("| relay | pacing | streams | direct TTFT p50 ms | relayed TTFT p50 ms "
          "| added p50 ms | added p99 ms | relay CPU ms / 1k tokens |")
    print("|---|---|---|---|---|---|---|---|")
    sink = SpanSink() if "on" in args.tracing else None
    with RedisServer() as redis:
        pacings = {"back-to-back": ("back-to-back", 0.0),
                   "paced": (f"{args.interval_ms:g} ms", args.interval_ms)}
        for label, interval in (pacings[p] for p in args.pacings):
            configs = [(f"pdserve, tracing {t}, limits {lim}", REPO, t == "on",
                        ("--replicas", "2") if lim == "shared" else ())
                       for t in args.tracing for lim in args.limits]
            configs += [("pdserve baseline", args.baseline, False, ())] if args.baseline else []
            for name, tree, traced, extra in configs:
                otlp = sink.url if sink is not None and traced else None
                for row in run_scenario(redis.url, interval, args, otlp, tree, extra):
                    print_row(name, label, row)
            for peer in args.peers:
                for row in run_peer(peer, interval, args):
                    print_row(peer, label, row)
    if sink is not None:
        print(f"\nspans exported with tracing on: {sink.num_bytes} bytes of OTLP", flush=True)


if __name__ == "__main__":
    main()
