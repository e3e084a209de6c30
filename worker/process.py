"""A worker process's entry: logging, threads, the event loop, exit codes.

`run_worker(args, build_role)` validates the options, sets torch's thread count,
then runs `WorkerRuntime.serve` on uvloop (when installed). Heavy imports happen here, at
run time, so `pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.options import WorkerOptions
    from worker.runtime import RoleWorker, WorkerRuntime

BuildRole = Callable[["WorkerOptions", "WorkerRuntime"], "RoleWorker"]


def run_worker(args: argparse.Namespace, build_role: BuildRole) -> int:
    """`build_role(options, runtime)` returns the role's worker; returns the exit code.
    Errors are printed under `args.prog` (the subcommand's name)."""
    from worker.options import options_from_args

    prog = getattr(args, "prog", "pdserve worker")
    try:
        options = options_from_args(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    from telemetry.log_format import configure_logging

    configure_logging(options.log_level, options.log_format, options.worker_id,
                      f"%(asctime)s {options.worker_id} %(levelname)s %(name)s: %(message)s")
    from state.redis_access import RedisAccessError, check_access

    try:  # before the model loads: a refused Redis is a configuration error
        for line in check_access(options.redis_url, options.redis_insecure):
            logging.getLogger(__name__).warning("%s", line)
    except RedisAccessError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(options.threads)
    # The engine thread and the event loop share one interpreter lock; see --gil-switch-ms.
    sys.setswitchinterval(options.gil_switch_ms / 1e3)
    runner: Callable[[Coroutine[object, object, int]], int]
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(_serve(options, build_role))
    except Exception as exc:  # a clear line for the launcher, the traceback in the log
        logging.getLogger(__name__).exception("worker failed")
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


async def _serve(options: WorkerOptions, build_role: BuildRole) -> int:
    import torch

    from engine.dtype_choice import resolve_dtype
    from engine.engine_builder import build_engine
    from engine.lane_streams import lane_sms
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_runner import ModelRunner
    from engine.step_budget import holds_tpot
    from engine.group_engine import group_engine
    from telemetry.start_up_heap import freeze_start_up_heap
    from telemetry.tracing import start_tracing
    from worker.options import kv_cache_dtype, lane_is_shared, parse_lane_option
    from worker.runtime import WorkerRuntime

    tracing = start_tracing(f"pdserve-{options.role.value}", options.otlp_endpoint,
                            options.worker_id)
    runtime = WorkerRuntime(options.worker_id, options.role, options.model, options.device,
                            options.host, options.port, options.internal_token,
                            options.redis_url, options.namespace, options.drain_timeout_s,
                            options.sm_share_percent, tracing, options.step_mode)
    dtype, why = resolve_dtype(options.dtype, options.device)
    logging.getLogger(__name__).info("dtype %s (%s); KV cache %s", dtype, why,
                                     dtype if options.kv_cache_dtype == "auto"
                                     else options.kv_cache_dtype)
    config = EngineConfig(block_size=options.block_size, max_num_seqs=options.max_num_seqs,
                          max_num_batched_tokens=options.max_num_batched_tokens,
                          dtype=getattr(torch, dtype), device=options.device,
                          kv_dtype=kv_cache_dtype(options.kv_cache_dtype),
                          hold_tpot=holds_tpot(options.step_budget, options.device),
                          kv_host_cache_bytes=int(options.kv_host_cache_gb * (1 << 30)),
                          prefill_lane_sms=lane_sms(parse_lane_option(options.prefill_lane),
                                                    options.device),
                          prefill_lane_shared=lane_is_shared(options.prefill_lane),
                          gpu_memory_fraction=(options.gpu_memory_fraction or None
                                               if options.device.startswith("cuda") else None))

    groups = contextlib.ExitStack()  # a tensor-parallel engine's follower ranks

    def load() -> LLMEngine:
        engine = (build_engine(options.model, config, kv_cache_bytes=options.kv_cache_mb << 20)
                  if options.tp_size == 1 else groups.enter_context(group_engine(
                      options.model, config, options.tp_size, options.kv_cache_mb << 20,
                      options.threads, expert_parallel=options.ep > 1,
                      rebalance_every=options.expert_rebalance_steps)))
        log = logging.getLogger(__name__)
        tier = engine.kv_cache.host_tier
        log.info("host KV tier: %s", f"{tier.num_host_blocks} blocks "
                 f"({tier.num_host_blocks * tier.block_bytes / (1 << 30):.2f} GiB)"
                 if tier is not None else "off")
        runner = engine.runner
        if isinstance(runner, ModelRunner) and (runner.graphs or runner.mixed_graphs):
            runtime.metrics.graph_capture_seconds.set(runner.capture_seconds)
            log.info("captured %d decode and %d mixed-step CUDA graphs in %.1f s",
                     len(runner.graphs.batch_sizes) if runner.graphs else 0,
                     len(runner.mixed_graphs.shapes) if runner.mixed_graphs else 0,
                     runner.capture_seconds)
        if options.warms_up:
            from engine.warm_up import warm_up

            report = warm_up(engine, lambda line: print(f"{options.worker_id}: {line}",
                                                        file=sys.stderr, flush=True))
            runtime.metrics.warmup_seconds.set(report.seconds)
            log.info("warmed up in %.1f s (%d requests, %d steps)", report.seconds,
                     report.num_requests, report.num_steps)
        heap = freeze_start_up_heap()  # the engine loop's collections skip start-up's objects
        log.info("froze %d start-up objects out of the cyclic collector in %.2f s",
                 heap.num_objects, heap.seconds)
        return engine

    try:
        with groups:  # the followers stop after the engine (closed by the runtime)
            return await runtime.serve(build_role(options, runtime), load)
    finally:
        await tracing.shutdown()  # exports the spans still queued
