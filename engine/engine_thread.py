"""Runs one LLMEngine in one dedicated thread and bridges it to an asyncio event loop.

The engine is single-threaded (engine/llm_engine.py), so every call into it happens here:

    event loop                                     engine thread
    ----------                                     -------------
    call(fn) / submit(fn) --- command queue --->   fn(engine) between two steps
             future <---- call_soon_threadsafe ---  result or exception
    RequestStream.put   <-- call_soon_threadsafe -- step(): KVReady (mid-step, kv_ready.py),
                                                    a pipelined step's early outputs (the
                                                    last step's text, made mid-step while
                                                    the device computes: `step_mode`),
                                                    then outputs, cache events, stats
    on_step(StepReport) (metrics, prefix index)     (runs while engine.has_unfinished())

Lifecycle: start() -> RUNNING (steps while there is work, otherwise sleeps on a wake-up
event that every command sets) -> stop() -> STOPPED (pending commands fail with
EngineStopped, open streams end). A step that raises is fatal: every stream ends with the
error and the thread stops (`failure` is set), because the scheduler state may be torn;
then `on_failure` (the worker exits to be restarted: worker/runtime.py).

Invariants:
  * only the engine thread touches the engine; only the loop thread touches streams; the
    loop reads only what cannot change after construction (block size, KV layout and
    storage) and the `load` snapshot, and asks for everything else with a command;
  * every command resolves its future exactly once (result, error, or stopped); a failed
    `submit` (nobody waits for it) is logged and counted, never dropped silently;
  * `load` is a snapshot taken on the engine thread after the latest step or command.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from engine.block_pool import CacheEvent
from engine.engine_load import engine_load
from engine.expert_load import expert_load_of
from engine.host_kv_tier import HostTierStats
from engine.kv_ready import KVReady
from engine.kv_storage import KVLayout, KVStorage
from engine.llm_engine import LLMEngine, RequestOutput
from engine.request_stream import RequestStream
from engine.step_mode import StepMode
from engine.step_shape import QueueShape, StepShape, queue_shape, step_shape
from engine.step_timer import StepTimer, TimedStep
from protocol.grammar_spec import GrammarSpec
from protocol.worker_load import WorkerLoad

log = logging.getLogger(__name__)
T = TypeVar("T")


class InjectedEngineFault(RuntimeError):
    """What a step raises under the `fault_fail_steps` fault (drills: a device error)."""


class EngineStopped(RuntimeError):
    """The engine thread has stopped (shut down, or a step failed)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    outputs: list[RequestOutput]
    cache_events: list[CacheEvent]
    step_s: float  # 0.0 when the report follows a command rather than a step
    load: WorkerLoad  # the engine's counters after this step (no rates)
    shape: StepShape = StepShape()  # what the step computed (empty after a command)
    # outputs[:num_delivered] reached their streams mid-step (a pipelined step's early
    # outputs); the report still carries them for the counters.
    num_delivered: int = 0
    # Overlapped CUDA steps are timed on the device (engine/step_timer.py): the steps the
    # device finished since the last report; None where the wall time above is the step's.
    device_steps: tuple[TimedStep, ...] | None = None
    host_tier: HostTierStats | None = None  # the host KV tier's counters (None: no tier)
    host_reload_seconds: tuple[float, ...] = ()  # the tier's reloads done since the last report

    def timed_steps(self) -> tuple[TimedStep, ...]:
        """What each step cost, with its own shape: the device-timed steps where the engine
        times them, else this report's step (none after a command)."""
        if self.device_steps is not None:
            return self.device_steps
        return (TimedStep(self.shape, self.step_s),) if self.step_s > 0 else ()


def _checked_load(engine: LLMEngine) -> WorkerLoad:
    engine.check_invariants()
    return engine_load(engine)


# The queue's shape (tokens left to prefill, decoding sequences, their context) reads every
# live request: at most once per this period while steps run (it goes out with heartbeats,
# hundreds of milliseconds apart), at every report after a command or when work runs out.
QUEUE_SHAPE_PERIOD_S = 0.02


class EngineThread:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[StepReport], None], idle_wait_s: float = 0.5,
                 step_mode: StepMode = StepMode.PLAIN) -> None:
        """`step_mode`: plain, pipelined or overlapped steps (engine/step_mode.py; a worker's
        `--pipelined-steps`). Overlapped needs a runner that reads tokens on the device;
        without one the thread runs pipelined steps and says so."""
        self._engine = engine
        if step_mode is StepMode.OVERLAPPED and not engine.runner.reads_device_tokens:
            log.warning("overlapped steps need a runner that reads tokens on the device "
                        "(not tensor parallelism): running pipelined steps")
            step_mode = StepMode.PIPELINED
        self.step_mode = step_mode
        if step_mode is StepMode.OVERLAPPED and str(engine.config.device).startswith("cuda"):
            # An overlapped step's wall time is not its cost (engine/step_timer.py).
            engine.step_timer = StepTimer()
        self.loop = loop
        self.on_step = on_step  # called on the loop thread
        self.idle_wait_s = idle_wait_s
        self.load = engine_load(engine)
        # A MoE model's expert load (an expert-parallel group's, from its rebalancer).
        self._experts = expert_load_of(getattr(engine, "runner", None))
        self._queued, self._queued_until = QueueShape(), 0.0  # the last shape, its expiry
        self.failure: BaseException | None = None
        self.num_failed_commands = 0  # submit()ted commands that raised (each one logged)
        self.fault_step_delay_s = 0.0  # fault injection only (worker/faults.py): a slow worker
        self.fault_fail_steps = False  # fault injection only: every step raises (a GPU fault)
        # Called on the loop thread once the engine failed, after every stream ended.
        self.on_failure: Callable[[BaseException], None] | None = None
        # Fixed at construction, so the loop may read them without a command.
        self._block_size = engine.config.block_size
        self._max_num_batched_tokens = engine.config.max_num_batched_tokens
        self._kv_storage = engine.kv_storage
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], object],
                                                asyncio.Future[object]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---------------------------------------------------------------- loop side: constants

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_blocks(self) -> int:
        return self._kv_storage.layout.num_blocks

    @property
    def num_layers(self) -> int:
        return self._kv_storage.layout.num_layers

    @property
    def max_num_batched_tokens(self) -> int:
        return self._max_num_batched_tokens

    @property
    def kv_layout(self) -> KVLayout:
        return self._kv_storage.layout

    @property
    def kv_storage(self) -> KVStorage:
        """The paged KV pool's memory, which KV transfers read and write directly. Which
        blocks they may touch is the engine's to say: ask it with a command."""
        return self._kv_storage

    # ---------------------------------------------------------------- loop side: commands

    def start(self) -> None:
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    @property
    def holds_tpot(self) -> bool:
        """Whether its scheduler budgets prompt tokens by the decodes' TPOT targets (and so
        wants the worker's step model as its `step_model`)."""
        return self._engine.scheduler.config.hold_tpot

    def submit(self, fn: Callable[[LLMEngine], object], what: str) -> None:
        """Run fn(engine) on the engine thread before its next step; never blocks.

        Nobody waits for the result: a failure is logged (naming `what`) and counted in
        `num_failed_commands`. Use `call` to wait for a result or an error."""
        future = self._enqueue(fn)
        future.add_done_callback(lambda f: self._report_failure(f, what))

    async def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0) -> T:
        """Run fn(engine) on the engine thread and return its result (bounded: a step of a
        large batch may take a while). Raises what fn raised, EngineStopped or TimeoutError."""
        future: asyncio.Future[T] = self._enqueue(fn)  # type: ignore[assignment]
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except BaseException:
            # Nobody will read it now (timed out, cancelled): a late error must not be
            # reported as "Future exception was never retrieved".
            future.add_done_callback(_retrieve)
            raise

    async def compile_grammar(self, spec: GrammarSpec, timeout_s: float = 10.0) -> None:
        """Compile a request's grammar into the engine's cache on a helper thread (not the
        engine's, whose steps it would stall; not the loop's), so adding the request finds
        it compiled. Raises GrammarError (a ValueError) or TimeoutError."""
        compiler = self._engine.grammar_rows.compiler  # thread-safe (text/grammar.py)
        await asyncio.wait_for(asyncio.to_thread(compiler.compile, spec), timeout_s)

    async def check_invariants(self, timeout_s: float = 5.0) -> None:
        """Check the engine's invariants on its thread and refresh `load`; raises
        AssertionError naming the broken one."""
        self.load = await self.call(_checked_load, timeout_s)

    def _enqueue(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future[object]:
        future: asyncio.Future[object] = self.loop.create_future()
        if self._stopping.is_set():
            future.set_exception(EngineStopped("the engine thread has stopped"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def _report_failure(self, future: asyncio.Future[object], what: str) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is None or isinstance(error, EngineStopped):
            return  # stopping: the command had nothing left to act on
        self.num_failed_commands += 1
        log.error("engine command %r failed", what, exc_info=error)

    def open_stream(self, request_id: str, stream: RequestStream | None = None) -> RequestStream:
        """Subscribe before adding the request, so no output can be missed; `stream`: the
        consumer's own (a subclass acting on items as they are delivered), else a plain one."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} already has a stream")
        if stream is None:
            stream = RequestStream(request_id)
        if self.failure is not None:
            stream.end("engine failed", self.failure)  # once: not registered for _on_failure
        else:
            self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stream(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake.set()
        await asyncio.to_thread(self._thread.join, timeout_s)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.1f s (a long step?)", timeout_s)
        self._fail_pending(EngineStopped("the engine thread stopped"))
        for stream in list(self._streams.values()):
            stream.end("engine stopped")

    def _deliver(self, report: StepReport) -> None:
        self.load = report.load
        self._deliver_outputs(report.outputs[report.num_delivered:])
        try:
            self.on_step(report)
        except Exception:  # metrics or publishing must never stop token delivery
            log.exception("on_step callback failed")

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _deliver_kv_ready(self, ready: KVReady) -> None:
        stream = self._streams.get(ready.request_id)
        if stream is not None:
            stream.put(ready)

    def _post_kv_ready(self, ready: KVReady) -> None:
        """Engine thread, mid-step: hand a KVReady to the loop before the step ends."""
        self.loop.call_soon_threadsafe(self._deliver_kv_ready, ready)

    def _on_failure(self, error: BaseException) -> None:  # `failure` is set by then
        for stream in list(self._streams.values()):
            stream.end("engine failed", error)
        if self.on_failure is not None:
            self.on_failure(error)

    # ---------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self._engine
        try:
            while not self._stopping.is_set():
                ran_commands = self._run_commands()
                if engine.has_unfinished():
                    started = time.perf_counter()
                    if self.fault_fail_steps:
                        raise InjectedEngineFault("injected fault: the engine step failed, "
                                                  "as on a device error")
                    early: list[RequestOutput] = []
                    mode = self.step_mode
                    outputs = engine.step(
                        self._post_kv_ready,
                        self._early_sink(early) if mode is StepMode.PIPELINED else None,
                        overlap=mode is StepMode.OVERLAPPED)
                    if self.fault_step_delay_s:
                        time.sleep(self.fault_step_delay_s)
                    self._post(early + outputs, time.perf_counter() - started, len(early))
                    continue
                if ran_commands:
                    self._post([], 0.0)
                    continue
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter, then stop
            log.exception("engine step failed; stopping the engine thread")
            self.failure = exc  # before the thread ends: /health must not outlive the engine
            self._stopping.set()
            self.loop.call_soon_threadsafe(self._on_failure, exc)
        self._drain_commands(EngineStopped("the engine thread stopped"))

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            try:
                result = fn(self._engine)
            except Exception as exc:  # returned to the caller, the engine stays usable
                self.loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, future, result, None)

    def _early_sink(self, early: list[RequestOutput]) -> Callable[[list[RequestOutput]], None]:
        """A pipelined step's `on_outputs`: to the streams now, into the report later."""
        def sink(outputs: list[RequestOutput]) -> None:
            early.extend(outputs)
            self.loop.call_soon_threadsafe(self._deliver_outputs, outputs)
        return sink

    def _post(self, outputs: list[RequestOutput], step_s: float, num_delivered: int = 0) -> None:
        timer = self._engine.step_timer
        shape, device_steps = StepShape(), None
        if timer is not None:
            # Each step's shape comes with its timing. After a command nothing is drained:
            # its report is no step's.
            device_steps = tuple(timer.drain()) if step_s > 0 else ()
        elif step_s > 0:
            shape = step_shape(self._engine.last_schedule)
        now = time.monotonic()
        if step_s <= 0 or now >= self._queued_until or not self._engine.has_unfinished():
            self._queued = queue_shape(self._engine.live_requests())
            self._queued_until = now + QUEUE_SHAPE_PERIOD_S
        if self._experts is not None and step_s > 0:
            self._experts.refresh()
        tier = self._engine.kv_cache.host_tier
        report = StepReport(outputs, self._engine.kv_cache.drain_events(), step_s,
                            engine_load(self._engine, self._queued, self._experts), shape,
                            num_delivered, device_steps, tier.stats() if tier is not None else None,
                            tier.drain_reload_seconds() if tier is not None else ())
        self.loop.call_soon_threadsafe(self._deliver, report)

    def _drain_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                self.loop.call_soon_threadsafe(_settle, future, None, error)
            except RuntimeError:
                return  # the loop is closed: nobody waits any more

    def _fail_pending(self, error: BaseException) -> None:
        self._drain_commands(error)


def _retrieve(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[object], result: object, error: BaseException | None) -> None:
    if future.done():
        return  # the caller gave up (cancelled); the command still ran
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
