"""`pdserve up`: a whole local cluster in one command.

    Redis-protocol server (unless --redis-url)  →  --prefill N prefill workers and
    --decode M decode workers (or --colocated --workers K colocated decode workers)
    →  the gateway on --port  →  progress until /ready answers 200 and every worker has
    registered  →  the URL and a curl example  →  supervise (restart what exits) until
    Ctrl-C / SIGTERM  →  stop: the gateway (it drains its streams), the workers, Redis.

Children run in their own process groups with a parent-death signal (launcher/supervisor.py),
so neither Ctrl-C nor a killed `pdserve up` leaves orphans. A child that exits before the
cluster is ready fails the command with its log's last lines; once it is up, a child that
exits is restarted (launcher/local_cluster.py, launcher/restart_policy.py), and the cluster
stops only on Ctrl-C / SIGTERM or when the gateway or Redis cannot be kept up.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.local_cluster import LocalCluster

from common.contract.option_env import env_default, env_flag


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    env = os.environ
    p = subparsers.add_parser(
        "up", help="start a local cluster: Redis, workers and the gateway",
        description="Start Redis (unless --redis-url), prefill and decode workers and the "
                    "gateway; print the URL once ready; Ctrl-C stops everything.")

    def opt(name: str, default: str | None = None, **kwargs) -> None:
        p.add_argument(name, default=env_default(env, name, default), **kwargs)

    opt("--model", "default", help='model for the workers: "default", a .gguf file or an '
                                   "HF directory")
    opt("--port", "8000", type=int, help="gateway port (default 8000; 0 picks a free one)")
    opt("--host", "127.0.0.1", help="gateway address (default 127.0.0.1)")
    opt("--prefill", "1", type=int, help="prefill workers (default 1)")
    opt("--decode", "1", type=int, help="decode workers (default 1)")
    p.add_argument("--colocated", action="store_true", default=env_flag(env, "--colocated"),
                   help="run --workers colocated decode workers that prefill locally "
                        "[env PDSERVE_COLOCATED=1]")
    opt("--workers", "2", type=int, help="colocated workers with --colocated (default 2)")
    opt("--redis-url", help="use this Redis instead of starting one")
    opt("--tiers", help="tiers TOML file for the gateway")
    opt("--device", "auto", help="auto (CUDA GPUs round-robin when present, else cpu), cpu, "
                                 "cuda")
    opt("--threads-per-worker", type=int, help="torch CPU threads per worker "
                                              "(default: cores / workers, at least 1)")
    opt("--kv-cache-mb", help="KV cache per worker, MiB (default: the worker's)")
    opt("--namespace", "pdserve", help="Redis key namespace")
    opt("--log-dir", help="where the children's logs go (default: a new temporary folder)")
    opt("--log-level", "info", help="the children's log level")
    opt("--ready-timeout-s", "600", type=float, help="give up if not ready by then")
    opt("--drain-timeout-s", "30", type=float,
        help="on Ctrl-C / SIGTERM, how long running streams may finish before they end "
             "with an error event (default 30)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from launcher.local_cluster import LocalCluster, WorkerSpec
    from launcher.redis_server import RedisServerError, free_port

    roles = ([("decode", "colocated")] * args.workers if args.colocated else
             [("prefill", None)] * args.prefill + [("decode", "decode")] * args.decode)
    if not any(kind == "decode" for kind, _ in roles):
        return _fail("at least one decode worker is needed (--decode or --workers)")
    if args.drain_timeout_s < 0:
        return _fail("--drain-timeout-s must be >= 0")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    devices = _devices(args.device, len(roles))
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // len(roles))
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}"
    tag = secrets.token_hex(3)
    specs, counts = [], {}
    for (kind, role), device in zip(roles, devices):
        label = role or kind
        index = counts.get(label, 0)
        counts[label] = index + 1
        specs.append(WorkerSpec(kind, role, device, f"{label}-{index}-{tag}"))
    common = ["--model", args.model, "--namespace", args.namespace, "--log-level",
              args.log_level, "--threads", str(threads)]
    if args.kv_cache_mb:
        common += ["--kv-cache-mb", str(args.kv_cache_mb)]
    gateway_args = ["--host", args.host, "--port", str(port), "--namespace", args.namespace,
                    "--tokenizer-model", args.model, "--log-level", args.log_level]
    if args.tiers:
        gateway_args += ["--tiers", args.tiers]
    cluster = LocalCluster(specs, common, gateway_args, url, log_dir, args.redis_url, _say,
                           drain_timeout_s=args.drain_timeout_s)

    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start()
        except RedisServerError as exc:
            return _fail(str(exc))
        summary = ", ".join(f"{n} {r}" for r, n in counts.items())
        _say(f"starting {summary} worker(s) on {_device_summary(devices)} "
             f"({threads} thread(s) each) and the gateway; logs in {log_dir}")
        failure = _wait_ready(cluster, args.ready_timeout_s, lambda: stopping)
        if failure is not None:
            if not stopping:
                _fail(failure)
            return 0 if stopping else 1
        model = cluster.served_model()
        example = json.dumps({"model": model, "stream": True, "max_tokens": 64,
                              "messages": [{"role": "user", "content": "Tell me a joke."}]})
        _say(f"\npdserve is up: {url}   (model {model})\n\n"
             f"Try it:\n  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
             f"-d '{example}'\n\n"
             f"Workers: {url}/admin/workers   Metrics: {url}/metrics   Logs: {log_dir}\n"
             f"A worker that exits is restarted; Ctrl-C stops everything.")
        while not stopping:
            cluster.supervise()
            if cluster.failure is not None:
                return _fail(cluster.failure)
            time.sleep(0.2)
        return 0
    finally:
        _say("stopping (the gateway finishes its streams first)...")
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _say("stopped.")


def _wait_ready(cluster: LocalCluster, timeout_s: float, stopping: Callable[[], bool]
                ) -> str | None:
    """None once the gateway and every worker started are ready; else why not."""
    started = time.monotonic()
    last_line, last_print = "", 0.0
    while not stopping():
        dead = cluster.first_exit()
        if dead is not None:
            return (f"{dead.name} exited with code {dead.returncode()} during start-up. "
                    f"Last lines of {dead.log_path}:\n{dead.log_tail()}")
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            return (f"the cluster was not ready after {timeout_s:.0f} s; see the logs in "
                    f"{cluster.supervisor.log_dir}")
        line = cluster.ready_line()
        if line is None:
            return None
        if line != last_line or time.monotonic() - last_print > 5:
            _say(f"[{elapsed:5.1f} s] {line}")
            last_line, last_print = line, time.monotonic()
        time.sleep(0.25)
    return "interrupted"


def _devices(choice: str, num_workers: int) -> list[str]:
    if choice != "auto":
        return [choice] * num_workers
    num_gpus = _count_gpus()
    if num_gpus == 0:
        return ["cpu"] * num_workers
    return [f"cuda:{i % num_gpus}" for i in range(num_workers)]


def _count_gpus() -> int:
    # nvidia-smi instead of torch: importing torch here would slow `up` by seconds.
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _device_summary(devices: list[str]) -> str:
    unique = sorted(set(devices))
    return ", ".join(unique)


def _say(message: str) -> None:
    print(message, flush=True)


def _fail(message: str) -> int:
    print(f"pdserve up: error: {message}", file=sys.stderr, flush=True)
    return 1
