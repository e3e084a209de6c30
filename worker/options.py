"""Command-line options shared by `pdserve prefill-worker` and `pdserve decode-worker`.

Every option can also come from the environment as PDSERVE_<OPTION_IN_UPPER_SNAKE>
(--redis-url <-> PDSERVE_REDIS_URL); the command line wins. The environment is read when
the parser is built (at run time), never at import.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.step_budget import STEP_BUDGET_CHOICES
from engine.step_mode import STEP_MODE_CHOICES, StepMode, choose_step_mode
from protocol.messages import RESERVED_WORKER_IDS, Role, is_worker_id
from telemetry.log_format import LOG_FORMATS
from telemetry.options import REDIS_INSECURE_HELP, REDIS_URL_HELP, EnvOptions, env_name
from telemetry.tracing import ENDPOINT_ENV

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRANSPORTS = ("auto", "ucx", "tcp")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8_e4m3")
LOG_LEVELS = ("debug", "info", "warning", "error")
# --max-num-seqs 0 (auto): on one H100 at 48 req/s of `mixed` on the 8B shape about 130
# requests were live; with 64 seats the rest waited seconds for one (docs/performance.md).
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    role: Role
    model: str
    redis_url: str
    host: str
    port: int
    worker_id: str
    device: str
    dtype: str
    threads: int
    kv_cache_mb: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_transport: str
    kv_shared_memory: bool
    namespace: str
    log_level: str
    drain_timeout_s: float
    internal_token: str | None
    sm_share_percent: int = 0  # CUDA MPS SM share given by the launcher (0: none)
    log_format: str = "text"
    otlp_endpoint: str | None = None  # traces to this OTLP/HTTP base URL (None: off)
    warm_up: str = "auto"  # auto | on | off (engine/warm_up.py)
    pipelined_steps: str = "auto"  # auto | on | off | overlap (engine/step_mode.py)
    step_budget: str = "auto"  # auto | tpot | fixed (engine/step_budget.py)
    gil_switch_ms: float = 0.5  # the interpreter's thread switch interval (sys.setswitchinterval)
    kv_mapping: bool = True  # map KV peers' pools on this host (kv_transfer/pool_mapping.py)
    redis_insecure: bool = False  # accept a Redis that answers without a password
    kv_host_cache_gb: float = 0.0  # host KV tier (engine/host_kv_tier.py); 0: off
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES; auto: --dtype's
    prefill_lane: str = "off"  # off | auto | SMs (engine/prefill_lane.py, lane_streams.py)
    gpu_memory_fraction: float = 0.0  # CUDA: KV pool from this share of the GPU; 0: kv_cache_mb
    tp: int = 1  # tensor-parallel ranks (engine/tensor_parallel_group.py); colocated only
    ep: int = 1  # expert-parallel ranks (engine/expert_exchange.py); any role
    expert_rebalance_steps: int = 64  # with --ep: steps between replication plans

    @property
    def tp_size(self) -> int:
        """The engine's processes: --tp's or --ep's (never both above 1)."""
        return max(self.tp, self.ep)

    @property
    def warms_up(self) -> bool:
        """Run the warm-up before registering? auto: on CUDA devices only."""
        return self.warm_up == "on" or (self.warm_up == "auto" and
                                        self.device.startswith("cuda"))

    @property
    def step_mode(self) -> StepMode:
        """Plain, pipelined or overlapped steps (engine/step_mode.py's policy)."""
        return choose_step_mode(self.pipelined_steps, self.device)

    def __post_init__(self) -> None:
        for name in ("threads", "kv_cache_mb", "block_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.drain_timeout_s < 0:
            raise ValueError("--drain-timeout-s must be >= 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_host_cache_gb < 0:
            raise ValueError(f"--kv-host-cache-gb must be >= 0, got {self.kv_host_cache_gb}")
        parse_lane_option(self.prefill_lane)
        if not 0.0 <= self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"--gpu-memory-fraction must be in [0, 1], "
                             f"got {self.gpu_memory_fraction}")
        if not 0.05 <= self.gil_switch_ms <= 100:
            raise ValueError(f"--gil-switch-ms must be in [0.05, 100], got {self.gil_switch_ms}")
        self._check_parallel()

    def _check_parallel(self) -> None:
        """--tp splits the KV pool by head over its processes, and a KV handoff moves one
        process's pool, so a tensor-parallel group serves only requests it prefills itself.
        --ep keeps the pool whole on its first process: any role."""
        if self.tp < 1 or self.ep < 1 or self.expert_rebalance_steps < 1:
            raise ValueError("--tp, --ep and --expert-rebalance-steps must be at least 1")
        if self.ep > 1 and self.tp not in (1, self.ep):
            from engine.tensor_parallel_sharding import ep_with_tp

            raise ValueError(ep_with_tp(self.ep, self.tp))
        if self.tp_size == 1:
            return
        what = f"--{'ep' if self.ep > 1 else 'tp'} {self.tp_size}"
        if self.ep == 1 and self.role is not Role.COLOCATED:
            raise ValueError(f"{what} needs --role colocated (got {self.role.value}): its KV "
                             f"is split over {self.tp_size} processes by head, and a KV "
                             f"handoff moves one process's pool (--ep keeps it whole)")
        for given, name in ((self.kv_host_cache_gb and self.ep == 1, "--kv-host-cache-gb"),
                            (self.prefill_lane != "off", "--prefill-lane"),
                            (self.gpu_memory_fraction, "--gpu-memory-fraction (size the "
                                                       "pool with --kv-cache-mb)")):
            if given:
                raise ValueError(f"{what} does not support {name} yet")


def add_worker_options(parser: argparse.ArgumentParser, role: Role,
                       env: Mapping[str, str] | None = None) -> None:
    """Register the options of a worker that starts as `role` unless --role says else."""
    options = EnvOptions(parser, env)

    def add(option: str, default: object, help_text: str, secret: bool = False,
            **kwargs: object) -> None:
        options.add(option, default, help=help_text, secret=secret, show_default=True, **kwargs)

    add("--model", "default", "model directory, .gguf file, or 'default'")
    options.add("--redis-url", help=REDIS_URL_HELP)
    options.flag("--redis-insecure", help=REDIS_INSECURE_HELP)
    add("--host", "127.0.0.1", "address of the control HTTP server (a non-loopback address "
        "needs PDSERVE_INTERNAL_TOKEN)")
    add("--port", 0, "control HTTP port; 0 picks a free one", type=int)
    add("--worker-id", None, "registry id (default: ROLE-HOSTNAME-PID)")
    add("--device", "cpu", "cpu, cuda or cuda:N")
    add("--dtype", "auto", "weights and KV-cache precision; auto: bfloat16 on CUDA, on a "
        "CPU bfloat16 only where a bf16 matmul measures at least 1.2x as fast as float32 "
        "at start-up (CPUs with AVX-512 BF16 or AMX), else float32", choices=DTYPES)
    add("--kv-cache-dtype", "auto", "the KV cache's precision: auto: --dtype's; fp8_e4m3: "
        "FP8 values with a float32 scale per token and KV head, computed when the token is "
        "written (about half of bf16's bytes: ~1.9x the blocks in the same memory; attention "
        "still computes in --dtype). A prefill and a decode worker must agree on it: a "
        "handoff between different ones is refused and the router never pairs them",
        choices=KV_CACHE_DTYPES)
    add("--threads", max(1, (os.cpu_count() or 2) // 2), "torch CPU threads", type=int)
    add("--kv-cache-mb", 256, "memory for the paged KV cache in MiB", type=int)
    add("--gpu-memory-fraction", 0.0, "CUDA: this share of the GPU's memory is the worker's "
        "budget, and its KV pool is what is left of it after the weights, the measured "
        "activations and the CUDA graphs (pdserve up gives each worker 0.9 / the workers on "
        "its GPU); 0: the pool is --kv-cache-mb", type=float)
    add("--kv-host-cache-gb", 0.0, "host memory for prefix blocks evicted from the KV cache, "
        "GiB (pinned on CUDA): a later prompt with that prefix gets them copied back instead "
        "of recomputed; 0: off", type=float)
    add("--block-size", 16, "tokens per KV block", type=int)
    add("--max-num-seqs", 0, "most requests in one batch; 0: auto, "
        f"{GPU_MAX_NUM_SEQS} on CUDA (a GPU's decode step costs little more for more rows, "
        f"and the decode CUDA graphs go up to it, at most 1024), {CPU_MAX_NUM_SEQS} elsewhere",
        type=int)
    add("--max-num-batched-tokens", 512, "most tokens in one step (prefill chunk budget); "
        "on CUDA steps of up to 4096 tokens are replayed from CUDA graphs", type=int)
    add("--kv-transport", "auto", "KV transfer backend (auto: ucx when importable, else tcp)",
        choices=TRANSPORTS)
    options.flag(
        "--kv-shared-memory",
        help="UCX only: move KV over shared memory / cuda_ipc between workers of one host "
             "(faster; UCX then cannot report a dead peer, and a prefill worker killed in the "
             "middle of a copy can abort the decode worker; every worker of the cluster must "
             "agree)")
    add("--kv-mapping", "on", "between workers of one host, the prefill worker copies KV "
        "straight into the decode worker's pool, mapped from its memfd (host) or by CUDA IPC "
        "(GPU), in one pass and with no data messages; off: always through --kv-transport "
        "(every worker of the cluster should agree)", choices=("on", "off"))
    add("--warm-up", "auto", "before registering, run every kind of step once (prefill "
        "lengths, chunked and cached prefills, mixed steps, each sampler) so that kernels "
        "compile before the first request, not during it; auto: on CUDA only",
        choices=("auto", "on", "off"))
    add("--pipelined-steps", "auto", "on: make the text of a step's tokens (detokenizer, "
        "stop strings aside, output records) during the next step, while the device "
        "computes it, instead of between the two; overlap: also plan and queue the next "
        "step before this step's tokens reach the host (its decode inputs read them on the "
        "device; not with tensor parallelism, which falls back to on); auto: overlap for "
        "CUDA, off elsewhere (on the CPU the model runs on the same cores, so "
        "nothing would overlap)", choices=STEP_MODE_CHOICES)
    add("--step-budget", "auto", "tpot: a step that decodes takes only the prompt tokens "
        "that its decoding requests' tightest time-per-output-token target leaves, by this "
        "worker's own step model, up to --max-num-batched-tokens (decodes hold their target, "
        "prefill takes the rest; raise --max-num-batched-tokens with it); fixed: every step "
        "may take --max-num-batched-tokens; auto: fixed (tpot has not beaten it on a GPU "
        "yet: docs/performance.md)",
        choices=STEP_BUDGET_CHOICES)
    add("--prefill-lane", "off", "compute prompts beside the decode steps rather than in "
        "them: a second scheduler and runner over this worker's one KV pool and one copy of "
        "the weights, on CUDA on a share of the SMs (a green context; the decode steps on the "
        "rest), so a decode step never waits for a prompt chunk; a prompt's blocks become "
        "its decode's in place. N: that many SMs for prompts; auto: half the GPU's SMs on "
        "CUDA, off elsewhere (on the CPU a lane only takes turns with the decode steps); "
        "shared: on CUDA, no SM split: the lane and the decode steps share every SM, the "
        "decode steps' stream at the higher priority (off elsewhere); off: prompts are computed in the decode steps (chunked prefill)")
    add("--gil-switch-ms", 0.5, "how long the event loop (streams, KV transfers) may wait "
        "for the interpreter lock while the engine thread holds it: Python's thread switch "
        "interval (default 5 ms there). An overlapped engine step rarely waits for the "
        "device, so without a short interval every stream and KV handshake of a busy "
        "worker waits up to 5 ms per hand-over", type=float)
    add("--tp", 1, "tensor parallelism: this many processes on this host each hold 1/N of "
        "every layer (rank r on cuda:r on CUDA; gloo on the CPU); colocated workers only",
        type=int)
    add("--ep", 1, "expert parallelism for a mixture-of-experts model: the experts are "
        "spread over this many processes (whole experts each; hot experts get extra copies "
        "as the load shifts), the first of which also runs attention and holds the whole KV "
        "cache, so any role may use it and hand KV to a worker of any --ep; --tp, if given, "
        "must equal it",
        type=int)
    add("--expert-rebalance-steps", 64, "with --ep: every this many steps, plan the expert "
        "copies from the tokens each expert took meanwhile", type=int)
    add("--namespace", "pdserve", "Redis key namespace")
    add("--log-level", "info", "logging level", choices=LOG_LEVELS)
    add("--log-format", "text", "text lines, or json: one object per line with the request "
        "id where there is one", choices=LOG_FORMATS)
    parser.add_argument(
        "--otlp-endpoint",
        default=options.env.get(env_name("--otlp-endpoint")) or options.env.get(ENDPOINT_ENV),
        help="OpenTelemetry traces: OTLP/HTTP base URL to export spans to, e.g. "
             "http://127.0.0.1:4318 (needs the tracing extra); unset: no traces [env "
             f"{env_name('--otlp-endpoint')} or {ENDPOINT_ENV}; default: unset]")
    add("--drain-timeout-s", 30.0, "on SIGTERM, how long in-flight requests may finish",
        type=float)
    add("--internal-token", None, "shared token for the control API (prefer the "
        "PDSERVE_INTERNAL_TOKEN environment variable)", secret=True)
    add("--role", role.value, "the role the worker starts in: prefill (prefills for other "
        "workers and pushes the KV), decode (receives KV from prefill workers, prefills "
        "locally too), colocated (prefills every request itself, takes no KV) or both "
        "(all of it); it can change at run time (the gateway's POST "
        "/admin/workers/ID/role)", choices=tuple(r.value for r in Role))


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """Validate parsed arguments; raises ValueError with a message for the user."""
    if not args.redis_url:
        raise ValueError(f"--redis-url (or {env_name('--redis-url')}) is required: workers "
                         "find each other only through the Redis registry")
    from state.redis_access import resolve_url

    from kv_transfer.transport_choice import check_backend_for_device, ucx_available
    check_backend_for_device(args.kv_transport, args.device, ucx_available())
    role = Role(args.role)
    worker_id = args.worker_id or f"{role.value}-{socket.gethostname()}-{os.getpid()}"
    if not is_worker_id(worker_id):
        raise ValueError(f"--worker-id {worker_id!r} cannot be a worker id: up to 128 of "
                         f"A-Z a-z 0-9 _ . -, and none of {', '.join(RESERVED_WORKER_IDS)} "
                         f"(the names of a cluster's other processes)")
    return WorkerOptions(
        role=role, model=args.model, redis_url=resolve_url(args.redis_url, os.environ),
        host=args.host, port=int(args.port), worker_id=worker_id, device=args.device,
        dtype=args.dtype,
        threads=int(args.threads), kv_cache_mb=int(args.kv_cache_mb),
        block_size=int(args.block_size),
        max_num_seqs=resolve_max_num_seqs(int(args.max_num_seqs), args.device),
        max_num_batched_tokens=int(args.max_num_batched_tokens),
        kv_transport=args.kv_transport, kv_shared_memory=bool(args.kv_shared_memory),
        namespace=args.namespace, log_level=args.log_level,
        drain_timeout_s=float(args.drain_timeout_s),
        internal_token=args.internal_token or None,
        sm_share_percent=_mps_share(os.environ),
        log_format=getattr(args, "log_format", "text"),
        otlp_endpoint=getattr(args, "otlp_endpoint", None) or None,
        warm_up=getattr(args, "warm_up", "auto"),
        pipelined_steps=getattr(args, "pipelined_steps", "auto"),
        step_budget=getattr(args, "step_budget", "auto"),
        gil_switch_ms=float(getattr(args, "gil_switch_ms", 0.5)),
        kv_mapping=getattr(args, "kv_mapping", "on") == "on",
        redis_insecure=bool(getattr(args, "redis_insecure", False)),
        kv_host_cache_gb=float(getattr(args, "kv_host_cache_gb", 0.0)),
        kv_cache_dtype=str(getattr(args, "kv_cache_dtype", "auto")),
        prefill_lane=str(getattr(args, "prefill_lane", "off")),
        gpu_memory_fraction=float(getattr(args, "gpu_memory_fraction", 0.0)),
        tp=int(getattr(args, "tp", 1)), ep=int(getattr(args, "ep", 1)),
        expert_rebalance_steps=int(getattr(args, "expert_rebalance_steps", 64)))


def kv_cache_dtype(option: str) -> "torch.dtype | None":
    """--kv-cache-dtype as `EngineConfig.kv_dtype`: None for auto (the model's dtype)."""
    import torch

    return {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8_e4m3": torch.float8_e4m3fn}[option]


def resolve_max_num_seqs(asked: int, device: str) -> int:
    """--max-num-seqs: `asked`, or for 0 (auto) the device's default; ValueError below 0."""
    if asked < 0:
        raise ValueError(f"--max-num-seqs must be at least 1 (or 0: auto), got {asked}")
    if asked:
        return asked
    return GPU_MAX_NUM_SEQS if device.startswith("cuda") else CPU_MAX_NUM_SEQS


def parse_lane_option(value: str) -> int | None:
    """--prefill-lane as SMs: 0 for off, None for auto or shared (where a lane runs, every
    SM is shared: `lane_is_shared`), else N >= 1; ValueError otherwise."""
    if value in ("off", "auto", "shared"):
        return 0 if value == "off" else None
    try:
        sms = int(value)
    except ValueError:
        sms = 0
    if sms < 1:
        raise ValueError(f"--prefill-lane must be off, auto, shared or a number of SMs >= 1, "
                         f"got {value!r}")
    return sms


def lane_is_shared(value: str) -> bool:
    """--prefill-lane shared: the lane's stream shares every SM with the decode steps'."""
    return value == "shared"


def _mps_share(environ: Mapping[str, str]) -> int:
    """The SM share CUDA MPS gives this process (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), 0: none."""
    try:
        return max(0, min(100, int(float(environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "0")))))
    except ValueError:
        return 0
