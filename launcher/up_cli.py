"""`pdserve up`: a whole local cluster in one command.

    Redis-protocol server (unless --redis-url)  →  --prefill N prefill workers and
    --decode M decode workers (or --colocated --workers K colocated decode workers)
    →  the gateway on --port  →  progress until /ready answers 200 and every worker has
    registered  →  the URL and a curl example  →  wait for Ctrl-C / SIGTERM / a child dying
    →  stop: gateway, then workers (they drain), then Redis.

Children run in their own process groups with a parent-death signal (launcher/supervisor.py),
so neither Ctrl-C nor a killed `pdserve up` leaves orphans. A child that exits before the
cluster is ready fails the command with its log's last lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from launcher.redis_server import RedisServer, RedisServerError, free_port
    from launcher.supervisor import Supervisor

    roles = ([("decode", "colocated")] * args.workers if args.colocated else
             [("prefill", None)] * args.prefill + [("decode", "decode")] * args.decode)
    if not any(kind == "decode" for kind, _ in roles):
        return _fail("at least one decode worker is needed (--decode or --workers)")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    devices = _devices(args.device, len(roles))
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // len(roles))
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}"

    stopping = False

    def request_stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    redis = None
    supervisor = Supervisor(log_dir)
    workers, gateway = [], None
    code = 0
    try:
        redis_url = args.redis_url
        if redis_url is None:
            try:
                redis = RedisServer()
                redis.start()
            except RedisServerError as exc:
                return _fail(str(exc))
            redis_url = redis.url
            _say(f"redis: {redis_url} ({Path(redis.binary.path).name})")
        base = [sys.executable, "-m", "launcher.cli"]
        common = ["--model", args.model, "--redis-url", redis_url, "--namespace", args.namespace,
                  "--log-level", args.log_level]
        if args.kv_cache_mb:
            common += ["--kv-cache-mb", str(args.kv_cache_mb)]
        counts: dict[str, int] = {}
        for (kind, role), device in zip(roles, devices):
            index = counts.get(role or kind, 0)
            counts[role or kind] = index + 1
            argv = base + [f"{kind}-worker", *common, "--device", device, "--threads", str(threads)]
            if role is not None:
                argv += ["--role", role]
            workers.append(supervisor.start(f"{role or kind} worker {index}", argv))
        gateway_argv = base + ["gateway", "--redis-url", redis_url, "--host", args.host,
                               "--port", str(port), "--namespace", args.namespace,
                               "--tokenizer-model", args.model, "--log-level", args.log_level]
        if args.tiers:
            gateway_argv += ["--tiers", args.tiers]
        gateway = supervisor.start("gateway", gateway_argv)
        summary = ", ".join(f"{n} {r}" for r, n in counts.items())
        _say(f"starting {summary} worker(s) on {_device_summary(devices)} "
             f"({threads} thread(s) each) and the gateway; logs in {log_dir}")
        failure = _wait_ready(url, supervisor, len(workers), args.ready_timeout_s,
                              lambda: stopping)
        if failure is not None:
            code = 0 if stopping else 1
            if not stopping:
                _fail(failure)
            return code
        model = _served_model(url)
        _say(f"\npdserve is up: {url}   (model {model})\n\n"
             f"Try it:\n  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
             f"-d '{json.dumps({'model': model, 'stream': True, 'max_tokens': 64, 'messages': [{'role': 'user', 'content': 'Tell me a joke.'}]})}'\n\n"
             f"Workers: {url}/admin/workers   Metrics: {url}/metrics   Logs: {log_dir}\n"
             f"Ctrl-C stops everything.")
        while not stopping:
            dead = supervisor.poll_exited()
            if dead is not None:
                code = 1
                _fail(f"{dead.name} exited with code {dead.returncode()}; stopping the cluster. "
                      f"Last lines of {dead.log_path}:\n{dead.log_tail()}")
                break
            time.sleep(0.2)
        return code
    finally:
        _say("stopping...")
        if gateway is not None:
            supervisor.stop([gateway], timeout_s=10.0)
        supervisor.stop(workers, timeout_s=40.0)  # workers drain in-flight requests first
        if redis is not None:
            redis.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _say("stopped.")


def _wait_ready(url: str, supervisor, num_workers: int, timeout_s: float,
                stopping) -> str | None:
    """None once /ready is 200 and every worker registered; else why not."""
    started = time.monotonic()
    last_line, last_print = "", 0.0
    while not stopping():
        dead = supervisor.poll_exited()
        if dead is not None:
            return (f"{dead.name} exited with code {dead.returncode()} during start-up. "
                    f"Last lines of {dead.log_path}:\n{dead.log_tail()}")
        elapsed = time.monotonic() - started
        if elapsed > timeout_s:
            return f"the cluster was not ready after {timeout_s:.0f} s; see the logs in {supervisor.log_dir}"
        ready = _get_json(url + "/ready")
        workers = _get_json(url + "/admin/workers")
        num_registered = len(workers["workers"]) if workers and "workers" in workers else None
        if ready is not None and ready.get("ready") and num_registered in (None, num_workers):
            return None
        if ready is None:
            line = "waiting for the gateway"
        elif num_registered is None:
            line = f"decode workers ready: {ready.get('decode_workers', 0)}"
        else:
            line = f"workers ready: {num_registered}/{num_workers} (loading the model)"
        if line != last_line or time.monotonic() - last_print > 5:
            _say(f"[{elapsed:5.1f} s] {line}")
            last_line, last_print = line, time.monotonic()
        time.sleep(0.25)
    return "interrupted"


def _get_json(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read()) if exc.code == 503 else None
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def _served_model(url: str) -> str:
    models = _get_json(url + "/v1/models") or {}
    data = models.get("data") or [{"id": "default"}]
    return data[0]["id"]


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
