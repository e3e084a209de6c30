"""`pdserve up`: a whole local cluster in one command.

    Redis-protocol server (unless --redis-url)  →  a CUDA MPS daemon when several workers
    share a GPU (launcher/mps.py)  →  the workers: --prefill N prefill workers and --decode
    M decode workers, or --workers K decode-worker processes with --roles R1,R2,...
    (--colocated --workers K is --roles colocated)  →  the gateway on --port (--gateways
    N: N replicas sharing the port and their limits)  →  progress
    until /ready answers 200 and every worker has registered  →  the URL, a curl
    example and where the admin token is (LOG_DIR/admin-token)  →  supervise (restart
    what exits) until Ctrl-C / SIGTERM  →  stop: the gateway (it drains its streams), the
    workers, the MPS daemon, Redis.

Children run in their own process groups with a parent-death signal (launcher/supervisor.py),
so neither Ctrl-C nor a killed `pdserve up` leaves orphans (but the MPS daemon, which
detaches itself and idles until told to quit). A child that exits before the cluster is
ready fails the command with its log's last lines; once it is up, a child that exits is
restarted (launcher/local_cluster.py, restart_policy.py); the cluster stops only on
Ctrl-C / SIGTERM or when the gateway or Redis cannot be kept up.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from launcher.local_cluster import LocalCluster

from launcher.memory_defaults import (CPU_KV_MEMORY_SHARE, GPU_MEMORY_SHARE, cpu_kv_cache_mb,
                                      gpu_memory_fractions, host_kv_cache_gb, mem_available_bytes)
from launcher.role_options import parse_sizes_by_role, worker_names, worker_roles
from protocol.messages import Role
from telemetry.log_format import LOG_FORMATS
from telemetry.options import REDIS_INSECURE_HELP, REDIS_PASSWORD_ENV, EnvOptions
from worker.options import KV_CACHE_DTYPES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    env = os.environ
    p = subparsers.add_parser(
        "up", help="start a local cluster: Redis, workers and the gateway",
        description="Start Redis (unless --redis-url), prefill and decode workers and the "
                    "gateway; print the URL once ready; Ctrl-C stops everything.")

    options = EnvOptions(p, env)
    opt = options.add

    opt("--model", "default", help='the model: "default", a .gguf file or an HF directory')
    opt("--port", "8000", type=int, help="gateway port (default 8000; 0 picks a free one)")
    opt("--host", "127.0.0.1", help="gateway address (default 127.0.0.1)")
    opt("--prefill", type=int, help="prefill workers (1 when only --decode is given; not with "
        "--roles, --colocated). Without any role option: the layout measured best on the "
        "host (docs/running.md)")
    opt("--decode", type=int, help="decode workers (1 when only --prefill is given; not with "
        "--roles, --colocated)")
    options.flag("--colocated",
                 help="run --workers colocated decode workers that prefill locally; the "
                      "same as --roles colocated")
    opt("--roles", metavar="ROLE[,ROLE...]",
        help="run --workers decode-worker processes with these roles (prefill, decode, both, "
             "colocated): one role for all of them (e.g. both), or one per worker (e.g. "
             "prefill,decode); at least one must decode")
    opt("--workers", type=int, help="how many workers with --roles or --colocated (default: "
                                   "as many as --roles lists, else 2)")
    opt("--gateways", "1", type=int,
        help="gateway replicas, all on --port (SO_REUSEPORT: the kernel spreads connections "
             "among them); they share tier limits and key rates through Redis (default 1)")
    options.flag("--no-agent",
                 help="do not start the operations agent (by default it ejects, restarts "
                      "and re-admits bad workers and rebalances roles; its options come "
                      "from their PDSERVE_* variables, its decisions go to "
                      "LOG_DIR/agent-audit.jsonl: docs/operations.md)")
    opt("--redis-url", help="use this Redis instead of starting one (by default pdserve "
                            "starts one with a generated password and a user per role); "
                            f"its password in the URL or in {REDIS_PASSWORD_ENV}")
    options.flag("--redis-insecure", help=REDIS_INSECURE_HELP)
    opt("--tiers", help="tiers TOML file for the gateway")
    opt("--device", "auto", help="auto (CUDA GPUs round-robin when present, else cpu), cpu, "
                                 "cuda")
    options.flag("--no-mps",
                 help="do not start CUDA MPS when several workers share a GPU (by default "
                      "pdserve starts its own MPS daemon when nvidia-cuda-mps-control is "
                      "on PATH)")
    opt("--sm-share", metavar="SPEC",
        help="under CUDA MPS, the percent of a GPU's SMs each worker of a role may use, e.g. "
             "prefill=60,decode=40; roles not listed split what is left (default: an equal "
             "split among the workers sharing the GPU); per GPU at most 100 in all")
    opt("--threads-per-worker", type=int, help="torch CPU threads per worker "
                                              "(default: cores / workers, at least 1)")
    opt("--kv-cache-mb", help="KV cache per worker, MiB (default on CPU: "
                              f"{CPU_KV_MEMORY_SHARE * 100:.0f}%% of the memory available at start, split "
                              "among the workers, 256 to 4096 each; on CUDA: "
                              f"{GPU_MEMORY_SHARE * 100:.0f}%% of each GPU split among "
                              "the workers on it, each sizing its pool from its share "
                              "after weights and activations)")
    opt("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="every worker's KV cache dtype; fp8_e4m3 holds about twice the tokens of bf16 "
             "(default: each worker's $PDSERVE_KV_CACHE_DTYPE, else auto: the model's dtype)")
    opt("--kv-host-cache-gb", type=float,
        help="host memory per worker for prefix blocks evicted from its KV cache, GiB; 0: "
             "off (default on CUDA: 25%% of the memory available at start, split among the "
             "workers, at most 64 each; on CPU: 0)")
    opt("--ep", help="expert parallelism in each worker, any role: a mixture-of-experts "
        "model's experts spread over this many processes per worker (the first also runs "
        "attention and holds the KV cache), hot experts copied as the load shifts; N for "
        "every worker, or sizes by role, e.g. prefill=2,decode=1 (a role not named: 1); --tp, "
        "if given, must equal it (default 1)")
    opt("--tp", type=int, help="tensor parallelism in each worker (colocated workers only): "
        "this many processes per worker, each holding 1/N of every layer (default 1)")
    opt("--namespace", "pdserve", help="Redis key namespace")
    opt("--log-dir", help="where the children's logs go (default: a new temporary folder)")
    opt("--log-level", "info", help="the children's log level")
    opt("--log-format", "text", choices=LOG_FORMATS, help="the children's log format")
    opt("--otlp-endpoint", help="traces of every process to this OTLP/HTTP base URL, e.g. "
        "http://127.0.0.1:4318 (default: $OTEL_EXPORTER_OTLP_ENDPOINT, else no traces)")
    opt("--ready-timeout-s", "600", type=float, help="give up if not ready by then")
    opt("--drain-timeout-s", "30", type=float,
        help="on Ctrl-C / SIGTERM, how long running streams may finish before they end "
             "with an error event (default 30)")
    p.set_defaults(func=run)


def _group_refusal(model: str, tp: int, ep_sizes: list[int]) -> str | None:
    """Why the model cannot be split as --tp / --ep ask (before any process starts)."""
    if tp == 1 and max(ep_sizes) == 1:
        return None
    from engine.loader import read_model_config
    from engine.tensor_parallel_sharding import check_shardable
    from text.errors import ModelLoadError

    try:
        config = read_model_config(model)
        for size in sorted(set(ep_sizes) - {1}):
            check_shardable(config, size, expert_parallel=True)
        check_shardable(config, tp)
    except (ValueError, ModelLoadError) as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    from launcher.local_cluster import LocalCluster, WorkerSpec
    from launcher.mps import MpsError, parse_sm_share
    from launcher.mps_plan import mps_setup, plan_mps
    from launcher.redis_server import RedisServerError, free_port

    try:
        roles = worker_roles(args.prefill, args.decode, args.colocated, args.workers,
                             args.roles, _default_roles(args))
        sm_share = parse_sm_share(args.sm_share)
    except ValueError as exc:
        return _fail(str(exc))
    if args.drain_timeout_s < 0:
        return _fail("--drain-timeout-s must be >= 0")
    try:
        ep_sizes = parse_sizes_by_role("--ep", args.ep, roles)
    except ValueError as exc:
        return _fail(str(exc))
    tp = args.tp or 1
    if tp > 1 and (odd := [ep for ep in ep_sizes if ep not in (1, tp)]):
        from engine.tensor_parallel_sharding import ep_with_tp

        return _fail(ep_with_tp(odd[0], tp))
    # --tp equal to a worker's --ep names the same processes: that worker is expert-parallel.
    if tp > 1 and any(role is not Role.COLOCATED
                      for role, ep in zip(roles, ep_sizes) if ep == 1):
        return _fail(f"--tp {args.tp} runs in colocated workers only (--colocated): its KV "
                     f"is split by head, and a KV handoff moves one pool (--ep keeps it whole)")
    if (refusal := _group_refusal(args.model, tp if 1 in ep_sizes else 1, ep_sizes)) is not None:
        return _fail(refusal)
    if args.gateways < 1:
        return _fail("--gateways must be >= 1")
    if args.redis_url:
        from state.redis_access import RedisAccessError, check_access, resolve_url

        try:
            for line in check_access(resolve_url(args.redis_url, os.environ),
                                     args.redis_insecure):
                _say(f"warning: {line}")
        except RedisAccessError as exc:
            return _fail(str(exc))
    devices = _devices(args.device, len(roles))
    sizes = [max(ep, tp) for ep in ep_sizes]  # each worker's processes (--ep / --tp)
    if (refusal := _gpus_refusal(devices, sizes)) is not None:
        return _fail(refusal)
    names = worker_names(roles)
    from kv_transfer.transport_choice import check_backend_for_device, ucx_available
    try:
        for device in set(devices):  # before any process starts
            check_backend_for_device("auto", device, ucx_available())
        mps_plan = None if args.no_mps else plan_mps(roles, names, devices, sm_share)
    except ValueError as exc:
        return _fail(str(exc))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    mps = None if mps_plan is None else mps_setup(mps_plan, log_dir)
    ranks = max(sizes)  # the most processes of a worker
    threads = args.threads_per_worker or max(1, (os.cpu_count() or 1) // (len(roles) * ranks))
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}"
    tag = secrets.token_hex(3)
    # Without --kv-cache-mb a CUDA worker sizes its pool from its share of the GPU.
    fractions = (gpu_memory_fractions(devices) if not args.kv_cache_mb and ranks == 1
                 else [None] * len(roles))  # a group sizes its pool from --kv-cache-mb
    specs = [WorkerSpec(role, device, f"{name}-{tag}",
                        env={**({} if mps is None else mps.worker_envs[i]),
                             **({} if fraction is None
                                else {"PDSERVE_GPU_MEMORY_FRACTION": str(fraction)}),
                             **({} if ep == 1 else {"PDSERVE_EP": str(ep)})})
             for i, (role, device, name, fraction, ep) in enumerate(
                 zip(roles, devices, names, fractions, ep_sizes))]
    counts: dict[str, int] = {}
    for role in roles:
        counts[role.value] = counts.get(role.value, 0) + 1
    common = ["--model", args.model, "--namespace", args.namespace, "--log-level",
              args.log_level, "--log-format", args.log_format, "--threads", str(threads)]
    kv_cache_mb = args.kv_cache_mb
    if not kv_cache_mb and all(d == "cpu" for d in devices):
        kv_cache_mb = cpu_kv_cache_mb(len(roles), mem_available_bytes())
    if kv_cache_mb:
        common += ["--kv-cache-mb", str(kv_cache_mb)]
    if args.kv_cache_dtype:
        common += ["--kv-cache-dtype", args.kv_cache_dtype]
    common += ["--tp", str(args.tp)] if args.tp else []
    host_gb = args.kv_host_cache_gb
    if host_gb is None:  # a tensor-parallel group has no host tier yet
        host_gb = 0 if tp > 1 and 1 in ep_sizes else host_kv_cache_gb(devices,
                                                                    mem_available_bytes())
    if host_gb:
        common += ["--kv-host-cache-gb", str(host_gb)]
    gateway_args = ["--host", args.host, "--port", str(port), "--namespace", args.namespace,
                    "--tokenizer-model", args.model, "--log-level", args.log_level,
                    "--log-format", args.log_format,
                    "--expect-workers", str(len(specs))]
    if args.tiers:
        gateway_args += ["--tiers", args.tiers]
    if args.otlp_endpoint:  # else the children read OTEL_EXPORTER_OTLP_ENDPOINT themselves
        common, gateway_args = (c + ["--otlp-endpoint", args.otlp_endpoint]
                                for c in (common, gateway_args))
    agent_args = None if args.no_agent else [
        "--namespace", args.namespace, "--restart", "local", "--host", "127.0.0.1",
        "--port", "0", "--log-level", args.log_level, "--log-format", args.log_format,
        "--audit-log", str(log_dir / "agent-audit.jsonl")]
    cluster = LocalCluster(specs, common, gateway_args, url, log_dir, args.redis_url, _say,
                           drain_timeout_s=args.drain_timeout_s,
                           mps=None if mps is None else mps.daemon, num_gateways=args.gateways,
                           agent_args=agent_args, namespace=args.namespace,
                           redis_insecure=args.redis_insecure)

    stopping = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            cluster.start()
        except (RedisServerError, MpsError, OSError) as exc:
            return _fail(str(exc))
        for line in [] if mps is None else mps.lines:
            _say(line)
        summary = ", ".join(f"{n} {r}" for r, n in counts.items())
        kv = f", KV cache {kv_cache_mb} MiB each" if kv_cache_mb else ""
        kv += f", host KV tier {host_gb:g} GiB each" if host_gb else ", no host KV tier"
        groups = sorted({(role.value, size, "expert" if ep > 1 else "tensor")
                         for role, size, ep in zip(roles, sizes, ep_sizes) if size > 1})
        kv += "".join(f", each {role} worker {size} processes ({kind} parallel)"
                      for role, size, kind in groups)
        gateways = "the gateway" if args.gateways == 1 else f"{args.gateways} gateways"
        gateways += "" if args.no_agent else " and the operations agent"
        _say(f"starting {summary} worker(s) on {_device_summary(devices)} "
             f"({threads} thread(s){kv}) and {gateways}; logs in {log_dir}")
        failure = _wait_ready(cluster, args.ready_timeout_s, lambda: stopping)
        if failure is not None:
            if not stopping:
                _fail(failure)
            return 0 if stopping else 1
        model = cluster.served_model()
        example = json.dumps({"model": model, "stream": True, "max_tokens": 64,
                              "messages": [{"role": "user", "content": "Tell me a joke."}]})
        admin = "$PDSERVE_ADMIN_TOKEN (yours)" if cluster.admin_token_path is None \
            else f"in {cluster.admin_token_path} (mode 0600)"
        _say(f"\npdserve is up: {url}   (model {model})\n\n"
             f"Try it:\n  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' "
             f"-d '{example}'\n\n"
             f"Cluster page: {url}/dashboard   Metrics: {url}/metrics   Logs: {log_dir}\n"
             f"Admin token (role changes, POST /admin/...): {admin}\n"
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
        cluster.answer_restarts(allow=False)
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


def _default_roles(args: argparse.Namespace) -> list[Role]:
    """The layout measured best for this host (launcher/default_layout.py)."""
    from launcher.default_layout import default_roles

    return default_roles(0 if args.device == "cpu" else _count_gpus())


def _devices(choice: str, num_workers: int) -> list[str]:
    if choice != "auto":
        return [choice] * num_workers
    num_gpus = _count_gpus()
    if num_gpus == 0:
        return ["cpu"] * num_workers
    return [f"cuda:{i % num_gpus}" for i in range(num_workers)]


def _gpus_refusal(devices: list[str], sizes: list[int]) -> str | None:
    """Why a worker's group of processes (one GPU per rank, from its device on) does not fit
    this host's GPUs, before any process starts."""
    needed = [(device, size, int(device.partition(":")[2] or 0) + size)
              for device, size in zip(devices, sizes)
              if size > 1 and device.startswith("cuda")]
    if not needed:
        return None
    num_gpus = _count_gpus()
    for device, size, last in needed:
        if last > num_gpus:
            return (f"a worker of {size} processes on {device} needs one GPU per process, up "
                    f"to cuda:{last - 1}; this host has {num_gpus}")
    return None


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
