"""What every worker process runs around its role: control server, engine thread, registry.

The role gate (worker/role_gate.py, over the prefill and decode halves) plugs in through
the `RoleWorker` protocol, its routes on this runtime's control app (worker/main.py wires
them); this module owns the rest of the process: the control server (the channel for
calls, HTTP for /health, /ready, /metrics and GET /admin/state), the engine thread, the
registry.

Lifecycle of a worker process:

    start control server (GET /health = 200, /ready = 503)
      -> load the model (in a thread), start the engine thread, role.attach()
      -> register in Redis (new epoch), /ready = 200                           SERVING
      -> SIGTERM/SIGINT: mark draining in the registry (route nothing new),    DRAINING
         wait until role.num_in_flight == 0 (<= drain_timeout_s)
      -> role.close(), stop the engine thread, deregister, stop the server      STOPPED

Invariants: every background task (publisher, role tasks) is stopped before the loop ends;
/ready answers 200 only while registered and not draining.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
from aiohttp import web

from engine.block_pool import CacheEventKind
from engine.engine_thread import EngineThread, StepReport
from engine.llm_engine import LLMEngine
from engine.step_mode import StepMode
from kv_transfer.layout import transfer_bytes
from protocol.agent_messages import (EXIT_CODE_ENGINE_FAILED, EXIT_CODE_RESTART,
                                     FAULT_INJECTION_ENV, ExitRequest, ExitResponse,
                                     FaultRequest, FaultResponse, HealthRequest)
from protocol.cluster_secret import KeyPurpose, derive_optional_key
from protocol.messages import ErrorCode, Message, Role, WorkerInfo
from protocol.worker_load import StepModel, WorkerLoad
from rpc.control_server import ControlServer, RequestRejected, add_call, make_app
from rpc.fault_proxy import FaultProxy
from state.redis_state import RedisState, connect
from telemetry.metrics import MetricsRegistry
from telemetry.tracing import NO_TRACING, Tracing
from worker.faults import BadFault, Faults
from worker.metrics import WorkerMetrics
from worker.publisher import WorkerPublisher
from worker.step_fit import StepFit

log = logging.getLogger(__name__)

STEP_MODEL_HAND_S = 0.5  # how often, at most, the engine's scheduler gets a refitted model
ENGINE_FAILED_EXIT_DELAY_S = 0.5  # for the streams' error frames to reach the gateway


def exit_refusal(request: ExitRequest, own_epochs: set[int]) -> str | None:
    """Why this process must not take an exit request, or None. Side-effect free."""
    if request.epoch is None or request.epoch in own_epochs:
        return None
    return (f"the exit is for epoch {request.epoch}; this process registered "
            f"{sorted(own_epochs) or 'none yet'} (it replaced that one)")


class RoleWorker(Protocol):
    """What a role (prefill, decode, colocated) plugs into the worker process."""

    @property
    def num_in_flight(self) -> int:
        """Requests and reservations this role still serves (the drain waits for 0)."""
        ...

    @property
    def kv_address(self) -> str | None:
        """Where KV senders connect (a decode worker's receiver); None for senders."""
        ...

    async def attach(self, engine_thread: EngineThread) -> None:
        """The engine is loaded and running: start serving (e.g. open the KV receiver)."""
        ...

    def state(self) -> dict[str, object]:
        """JSON-ready counters and ids for GET /admin/state."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError naming a broken invariant of the role."""
        ...

    async def close(self) -> None:
        """Stop: end what is in flight and release every resource; called exactly once."""
        ...


class WorkerRuntime:
    def __init__(self, worker_id: str, role: Role, model_name: str, device: str,
                 host: str, port: int, token: str | None, redis_url: str, namespace: str,
                 drain_timeout_s: float, sm_share_percent: int = 0,
                 tracing: Tracing = NO_TRACING,
                 step_mode: StepMode = StepMode.PLAIN) -> None:
        """`sm_share_percent`: the CUDA MPS share the launcher gave this process (0: none);
        `tracing`: where the role's request spans go (owned by the caller);
        `step_mode`: how the engine thread steps the engine (engine/step_mode.py)."""
        self.worker_id = worker_id
        self.step_mode = step_mode
        self.tracing = tracing
        self.sm_share_percent = sm_share_percent
        self.role = role
        self.model_name = model_name
        self.device = device
        self.redis_url = redis_url
        self.namespace = namespace
        self.drain_timeout_s = drain_timeout_s
        self.registry = MetricsRegistry()
        self.metrics = WorkerMetrics(self.registry)
        self.app = make_app(token)
        fault_injection = os.environ.get(FAULT_INJECTION_ENV) == "1"
        # With fault injection on, callers reach the control server through a proxy that
        # can degrade its network (rpc/fault_proxy.py); it takes the port asked for.
        self.fault_proxy = FaultProxy(host) if fault_injection else None
        self._port = port
        self.server = ControlServer(self.app, host, 0 if fault_injection else port, token)
        # Binds this worker's registry entry to the cluster's secret (the gateway and the
        # agent trust no other): protocol/cluster_secret.py.
        self.entry_key = derive_optional_key(token, KeyPurpose.REGISTRY)
        self.engine_thread: EngineThread | None = None
        self.publisher: WorkerPublisher | None = None
        self.step_fit = StepFit()
        # The step model last handed to the engine's scheduler, which budgets prompt tokens
        # by it under hold_tpot (engine/step_budget.py), and when (monotonic seconds).
        self._engine_step_model: StepModel | None = None
        self._engine_step_model_at = 0.0
        self.own_epochs: set[int] = set()  # every epoch this process registered
        self.faults = Faults()  # all off unless a test asks (worker/faults.py)
        self.ready = False
        self.draining = False
        self._worker: RoleWorker | None = None
        self._stop = asyncio.Event()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/ready", self._ready)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/admin/state", self._state)
        add_call(self.app, ExitRequest, self._exit)
        add_call(self.app, HealthRequest, self._health_report)
        if fault_injection:
            add_call(self.app, FaultRequest, self._fault)

    @property
    def epoch(self) -> int:
        return self.publisher.epoch if self.publisher is not None else 0

    # ---------------------------------------------------------------- lifecycle

    async def serve(self, worker: RoleWorker, load_engine: Callable[[], LLMEngine],
                    on_ready: Callable[[str], Awaitable[None] | None] | None = None) -> int:
        """Run the whole process lifecycle; returns the exit code."""
        self._worker = worker  # its routes are on self.app already (worker/main.py)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        url = await self.server.start()
        if self.fault_proxy is not None:
            assert self.server.port is not None
            url = self.server.advertise(await self.fault_proxy.start(self._port,
                                                                     self.server.port))
        log.info("%s control server on %s; loading the model", self.worker_id, url)
        try:
            engine = await asyncio.to_thread(load_engine)
            self.engine_thread = EngineThread(engine, loop, self._on_step,
                                              step_mode=self.step_mode)
            self.engine_thread.fault_step_delay_s = self.faults.step_delay_s
            self.engine_thread.on_failure = self._engine_failed
            self.engine_thread.start()
            await worker.attach(self.engine_thread)
            await self._register(self.engine_thread, url, worker.kv_address)
            self.ready = True
            log.info("%s ready (epoch %d) on %s; steps %s", self.worker_id,
                     self.epoch, url, self.engine_thread.step_mode.name.lower())
            if on_ready is not None:
                result = on_ready(url)
                if result is not None:
                    await result
            await self._stop.wait()
            await self._drain(worker)
            return 0
        finally:
            await self._shutdown(worker)

    async def _register(self, engine: EngineThread, url: str, kv_address: str | None) -> None:
        layout = engine.kv_layout
        info = WorkerInfo(worker_id=self.worker_id, role=self.role, model=self.model_name,
                          control_url=url, kv_address=kv_address, device=self.device,
                          num_kv_blocks=engine.num_kv_blocks, block_size=engine.block_size,
                          max_num_batched_tokens=engine.max_num_batched_tokens,
                          pid=os.getpid(), sm_share_percent=self.sm_share_percent,
                          kv_bytes_per_token=transfer_bytes(layout, 1, layout.num_layers)
                          // engine.block_size, kv_dtype=layout.dtype)
        state = RedisState(connect(self.redis_url), self.namespace, entry_key=self.entry_key)
        self.publisher = WorkerPublisher(state, info, self._load)
        # Redis may be starting too: registration retries until this deadline.
        self.own_epochs.add(await self.publisher.start(timeout_s=30.0))

    async def change_role(self, role: Role, kv_address: str | None) -> int:
        """Publish a new role under a new epoch (the role worker drained first); returns it."""
        if self.publisher is None:
            raise RuntimeError("not registered yet")
        epoch = await self.publisher.change_role(role, kv_address)
        self.own_epochs.add(epoch)
        self.role = role
        self.metrics.role_changes.inc(role=role.value)
        log.info("%s is now %s (epoch %d)", self.worker_id, role.value, epoch)
        return epoch

    async def _drain(self, worker: RoleWorker) -> None:
        self.draining = True
        self.ready = False
        if self.publisher is not None:
            await self.publisher.set_draining()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout_s
        while worker.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if worker.num_in_flight:
            log.warning("%s: %d requests still in flight after the %.1f s drain timeout",
                        self.worker_id, worker.num_in_flight, self.drain_timeout_s)

    async def _shutdown(self, worker: RoleWorker) -> None:
        self.ready = False
        await worker.close()
        if self.engine_thread is not None:
            await self.engine_thread.stop()
        if self.publisher is not None:
            await self.publisher.stop(deregister=True)
            await self.publisher.state.aclose()
        await self.server.stop()
        if self.fault_proxy is not None:
            await self.fault_proxy.stop()

    # ---------------------------------------------------------------- engine feedback

    def _on_step(self, report: StepReport) -> None:
        self.metrics.on_step(report)
        for step in report.timed_steps():
            self.step_fit.observe(step.shape, step.seconds)
        self._hand_step_model()
        if self.publisher is None or not report.cache_events:
            return
        # Keep the order of events: a hash may be evicted and inserted again in one step.
        for event in report.cache_events:
            if event.kind is CacheEventKind.INSERTED:
                self.publisher.record_inserted((event.block_hash,))
            else:
                self.publisher.record_evicted((event.block_hash,))

    def _hand_step_model(self) -> None:
        """Give the engine's scheduler the refitted step model, at most every
        STEP_MODEL_HAND_S (a fit per step would cost the event loop more than it gains),
        on the engine thread (the scheduler is that thread's alone)."""
        thread = self.engine_thread
        now = time.monotonic()
        if (thread is None or not thread.holds_tpot
                or now - self._engine_step_model_at < STEP_MODEL_HAND_S):
            return
        self._engine_step_model_at = now
        model = self.step_fit.model()
        if model is not None and model is not self._engine_step_model:
            self._engine_step_model = model
            thread.submit(lambda engine: setattr(engine.scheduler, "step_model", model),
                          "hand the step model")

    def _load(self) -> WorkerLoad:
        load = self.engine_thread.load if self.engine_thread is not None else WorkerLoad()
        prefill_tps, decode_tps = self.metrics.tokens_per_s()
        return msgspec.structs.replace(load, prefill_tokens_per_s=prefill_tps,
                                       decode_tokens_per_s=decode_tps,
                                       step_model=self.step_fit.model(),
                                       kv_send_bytes_per_s=self.metrics.kv_send_bytes_per_s)

    # ---------------------------------------------------------------- HTTP

    async def _health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while the process can serve again; 503 once its engine failed (it
        is about to exit: `_engine_failed`)."""
        if self.engine_thread is not None and self.engine_thread.failure is not None:
            return web.json_response({"status": "engine failed", "worker_id": self.worker_id},
                                     status=503)
        return web.json_response({"status": "alive", "worker_id": self.worker_id})

    async def _ready(self, request: web.Request) -> web.Response:
        ok = self.ready and self.engine_thread is not None and self.engine_thread.is_alive
        return web.json_response({"ready": ok, "epoch": self.epoch}, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.registry.render(),
                            headers={"Content-Type": self.registry.content_type})

    async def _state(self, request: web.Request) -> web.Response:
        body: dict[str, object] = {"worker_id": self.worker_id, "role": self.role.value,
                                "epoch": self.epoch, "ready": self.ready,
                                "draining": self.draining}
        if self.engine_thread is not None:
            body["invariant_error"] = await self._check_invariants()
            body.update(msgspec.structs.asdict(self.engine_thread.load))
        if self._worker is not None:
            body.update(self._worker.state())
        if self.publisher is not None:
            body["redis_connected"] = self.publisher.connected
        return web.json_response(body)

    async def _health_report(self, request: HealthRequest) -> Message:
        return self.metrics.health(self.epoch, self._load())

    async def _exit(self, request: ExitRequest) -> Message:
        """The operations agent restarts this worker (its orchestrator starts a new one)."""
        refusal = exit_refusal(request, self.own_epochs)
        if refusal is not None:
            raise RequestRejected(ErrorCode.STALE_EPOCH, refusal)
        log.warning("%s: exiting at once to be restarted (%s)", self.worker_id,
                    request.reason or "no reason given")
        asyncio.get_running_loop().call_later(0.1, os._exit, EXIT_CODE_RESTART)
        return ExitResponse(pid=os.getpid())

    def _engine_failed(self, error: BaseException) -> None:
        """The engine thread stopped on a failed step (its streams ended with the error, so
        the gateway retries or migrates them): this process cannot serve again, so it
        exits, once the error frames are out, for its supervisor or orchestrator to start a
        fresh one, rather than stay up answering /health while refusing requests."""
        self.ready = False
        log.critical("%s: the engine failed (%s); exiting with code %d to be restarted",
                     self.worker_id, error, EXIT_CODE_ENGINE_FAILED)
        asyncio.get_running_loop().call_later(ENGINE_FAILED_EXIT_DELAY_S, os._exit,
                                              EXIT_CODE_ENGINE_FAILED)

    async def _fault(self, request: FaultRequest) -> Message:
        faults = self.faults
        try:
            faults.set(request, time.monotonic())
        except BadFault as exc:
            raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from None
        assert self.fault_proxy is not None  # the route exists only with fault injection on
        self.fault_proxy.fault = faults.net
        if self.engine_thread is not None:
            self.engine_thread.fault_step_delay_s = faults.step_delay_s
            self.engine_thread.fault_fail_steps = faults.fail_steps
        log.warning("%s: fault injection: %s", self.worker_id, faults.describe())
        return FaultResponse(step_delay_ms=request.step_delay_ms,
                             transfer_layer_delay_ms=request.transfer_layer_delay_ms,
                             fail_steps=request.fail_steps,
                             net_fault_ms=request.net_fault_ms if faults.net.is_set else 0)

    async def _check_invariants(self) -> str | None:
        assert self.engine_thread is not None and self._worker is not None
        try:
            await self.engine_thread.check_invariants()  # also refreshes its load snapshot
            self._worker.check_invariants()
        except AssertionError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

