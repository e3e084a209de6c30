"""EngineThread bridging, with a scripted engine: commands between steps, outputs routed to
the right request's stream, a failing step ending every stream (not hanging it)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from engine.engine_thread import EngineStopped, EngineThread, InjectedEngineFault
from engine.kv_ready import KVReady
from engine.llm_engine import RequestOutput
from engine.request_stream import RequestStream, StreamEnd
from engine.step_mode import StepMode
from protocol.finish_reason import FinishReason

pytestmark = [pytest.mark.timeout(20)]


class ScriptedCache:
    """The KV cache's counters a worker's load reads: a table per scripted request."""

    num_used_blocks, num_blocks = 0, 8
    host_tier = None

    def __init__(self, requests: dict[str, list[int]]) -> None:
        self._requests = requests

    @property
    def num_tables(self) -> int:
        return len(self._requests)

    def drain_events(self) -> list:
        return []


class ScriptedEngine:
    """Emits one token per step for each added request until it has `n` of them."""

    def __init__(self, fail_at_step: int | None = None) -> None:
        self.requests: dict[str, list[int]] = {}
        self.num_steps = 0
        self.fail_at_step = fail_at_step
        self.kv_cache = ScriptedCache(self.requests)
        self.config = SimpleNamespace(block_size=16, max_num_batched_tokens=64, device="cpu")
        self.scheduler = SimpleNamespace(live_requests=lambda: ())
        self.live_requests = lambda: ()
        self.last_schedule = None
        self.step_timer = None  # a CPU engine: its steps' wall time is their cost
        self.kv_storage = SimpleNamespace(layout=SimpleNamespace(num_blocks=8, num_layers=2))
        self.invariant_broken = False
        self.kv_ready_for: set[str] = set()  # requests owed a KVReady at their next step

    def check_invariants(self) -> None:
        assert not self.invariant_broken, "scripted engine: invariant broken"

    num_waiting = 0

    @property
    def num_running(self) -> int:
        return len(self.requests)

    def add(self, rid: str, n: int) -> None:
        if rid in self.requests:
            raise ValueError("in use")
        self.requests[rid] = [n]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self, on_kv_ready=None, on_outputs=None, overlap=False) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps == self.fail_at_step:
            raise RuntimeError("kernel exploded")
        for rid in sorted(self.kv_ready_for & set(self.requests)):
            self.kv_ready_for.discard(rid)
            on_kv_ready(KVReady(rid, (0,), 3, None))
        outputs = []
        for rid, state in list(self.requests.items()):
            state.append(len(state))
            done = len(state) > state[0]
            outputs.append(RequestOutput(rid, [len(state)], "", [], FinishReason.LENGTH if done else None,
                                         3, len(state) - 1, 0))
            if done:
                del self.requests[rid]
        if on_outputs is not None:  # pipelined: the unfinished ones leave mid-step
            on_outputs([o for o in outputs if o.finish_reason is None])
            return [o for o in outputs if o.finish_reason is not None]
        return outputs


async def collect(stream) -> list:
    items = []
    while True:
        item = await stream.next(5.0)
        items.append(item)
        if isinstance(item, StreamEnd) or (isinstance(item, RequestOutput)
                                           and item.finish_reason):
            return items


def test_a_kv_ready_reaches_its_stream_before_the_output_of_its_step() -> None:
    async def run() -> None:
        engine = ScriptedEngine()
        engine.kv_ready_for.add("a")
        thread = EngineThread(engine, asyncio.get_running_loop(), lambda report: None)
        thread.start()
        a, b = thread.open_stream("a"), thread.open_stream("b")
        try:
            await thread.call(lambda e: (e.add("a", 2), e.add("b", 1)))
            items_a, items_b = await collect(a), await collect(b)
        finally:
            await thread.stop()
        assert isinstance(items_a[0], KVReady) and items_a[0].request_id == "a"
        assert [type(i) for i in items_a[1:]] == [RequestOutput, RequestOutput]
        assert not any(isinstance(i, KVReady) for i in items_b)

    asyncio.run(run())


def test_outputs_reach_their_own_stream_and_commands_return_results() -> None:
    async def run() -> None:
        reports = []
        thread = EngineThread(ScriptedEngine(), asyncio.get_running_loop(), reports.append)
        thread.start()
        a, b = thread.open_stream("a"), thread.open_stream("b")
        await thread.call(lambda e: e.add("a", 3))
        await thread.call(lambda e: e.add("b", 5))
        with pytest.raises(ValueError, match="in use"):
            await thread.call(lambda e: e.add("z", 1) or e.add("z", 1))  # error comes back
        await thread.call(lambda e: None)  # the thread lives on
        got_a, got_b = await asyncio.gather(collect(a), collect(b))
        assert [o.request_id for o in got_a] == ["a"] * 3 and got_a[-1].finish_reason
        assert [o.request_id for o in got_b] == ["b"] * 5
        assert reports and reports[-1].load.num_steps >= 5
        await thread.stop()
        with pytest.raises(EngineStopped):
            await thread.call(lambda e: None)

    asyncio.run(run())


def test_the_queue_shape_is_read_once_a_period_while_steps_run_and_at_the_end() -> None:
    """Reading every live request for the queue's shape is rate-limited between steps
    (engine_thread.QUEUE_SHAPE_PERIOD_S), but the report of the step after which no work is
    left reads it again: an idle worker's load is exact."""
    async def run() -> None:
        engine, reads, reports = ScriptedEngine(), [], []
        engine.live_requests = lambda: reads.append(len(engine.requests)) or ()
        thread = EngineThread(engine, asyncio.get_running_loop(), reports.append)
        thread.start()
        stream = thread.open_stream("a")
        try:
            await thread.call(lambda e: e.add("a", 300))
            await collect(stream)
            for _ in range(100):
                if reports and reports[-1].step_s > 0 and not engine.requests:
                    break
                await asyncio.sleep(0.01)
        finally:
            await thread.stop()
        steps = [r for r in reports if r.step_s > 0]
        assert len(steps) >= 300 and len(reads) < len(steps) / 2  # 300 steps in few periods
        assert reads[-1] == 0  # read again once the work ran out

    asyncio.run(run())


def test_a_pipelined_step_delivers_early_outputs_once_and_counts_them_in_its_report() -> None:
    async def run() -> None:
        reports = []
        thread = EngineThread(ScriptedEngine(), asyncio.get_running_loop(), reports.append,
                              step_mode=StepMode.PIPELINED)
        assert thread.step_mode is StepMode.PIPELINED
        thread.start()
        a = thread.open_stream("a")
        await thread.call(lambda e: e.add("a", 4))
        got = await collect(a)
        await thread.stop()
        assert [o.new_token_ids for o in got] == [[2], [3], [4], [5]]  # once each, in order
        assert got[-1].finish_reason and not any(o.finish_reason for o in got[:-1])
        assert a.take_ready() == [StreamEnd("engine stopped")]  # nothing delivered twice
        counted = [o for r in reports for o in r.outputs]
        assert [o.new_token_ids for o in counted] == [[2], [3], [4], [5]]
        assert [r.num_delivered for r in reports if r.outputs] == [1, 1, 1, 0]

    asyncio.run(run())


class RecordingStream(RequestStream):
    """A consumer's own stream (as the decode half opens one): records each put() as it
    happens, and checks it runs on the event loop's thread."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.put_log: list[object] = []
        self.loop_thread = threading.get_ident()

    def put(self, item) -> None:
        assert threading.get_ident() == self.loop_thread, "put() off the event loop"
        self.put_log.append(item)
        super().put(item)


def test_a_consumers_own_stream_gets_each_item_put_on_the_loop_in_order() -> None:
    async def run() -> None:
        thread = EngineThread(ScriptedEngine(), asyncio.get_running_loop(), lambda r: None)
        thread.start()
        own = RecordingStream("a")
        assert thread.open_stream("a", own) is own
        with pytest.raises(ValueError, match="already has a stream"):
            thread.open_stream("a", RecordingStream("a"))
        await thread.call(lambda e: e.add("a", 3))
        got = await collect(own)
        await thread.stop()
        assert [o.new_token_ids for o in got] == [[2], [3], [4]]
        assert own.put_log[:3] == got, "an item reached the queue without put()"

    asyncio.run(run())


def test_a_failing_step_ends_every_stream_with_the_error() -> None:
    async def run() -> None:
        thread = EngineThread(ScriptedEngine(fail_at_step=2), asyncio.get_running_loop(),
                              lambda r: None)
        thread.start()
        stream = thread.open_stream("a")
        await thread.call(lambda e: e.add("a", 10))
        items = await collect(stream)
        assert isinstance(items[-1], StreamEnd) and "exploded" in str(items[-1].error)
        assert not thread.is_alive
        late = RecordingStream("b")  # opened after the failure: ended at once, not hung
        thread.open_stream("b", late)
        assert len(late.put_log) == 1 and isinstance(late.put_log[0], StreamEnd)
        assert "exploded" in str(late.put_log[0].error)
        await thread.stop()

    asyncio.run(run())


def _started_with_failures() -> tuple[EngineThread, list[BaseException]]:
    """A started thread over a scripted engine, and the failures its owner is told of."""
    thread = EngineThread(ScriptedEngine(), asyncio.get_running_loop(), lambda r: None)
    failures: list[BaseException] = []
    thread.on_failure = failures.append
    thread.start()
    return thread, failures


def test_the_failing_steps_fault_ends_the_streams_and_tells_the_owner_once() -> None:
    async def run() -> None:
        thread, failures = _started_with_failures()
        stream = thread.open_stream("a")
        thread.fault_fail_steps = True
        await thread.call(lambda e: e.add("a", 10))
        items = await collect(stream)
        assert isinstance(items[-1], StreamEnd)
        assert isinstance(items[-1].error, InjectedEngineFault)
        assert not thread.is_alive
        assert len(failures) == 1 and isinstance(failures[0], InjectedEngineFault)
        await thread.stop()

    asyncio.run(run())


def test_a_failed_engine_is_seen_failed_before_the_loop_hears_of_it() -> None:
    # /health (failure) and /ready (is_alive) read these on the loop: in the moment between
    # the thread's end and the loop's on_failure, neither may take the engine for a live one.
    async def run() -> None:
        thread, failures = _started_with_failures()
        thread.fault_fail_steps = True
        thread.submit(lambda e: e.add("a", 10), "add a")
        thread._thread.join(timeout=10)  # the loop is blocked: on_failure cannot run yet
        assert not failures
        assert isinstance(thread.failure, InjectedEngineFault) and not thread.is_alive
        late = RecordingStream("b")
        thread.open_stream("b", late)
        await asyncio.sleep(0.05)  # now on_failure runs: the late stream still ends once
        assert len(failures) == 1
        assert [type(item) for item in late.put_log] == [StreamEnd]
        await thread.stop()

    asyncio.run(run())


def test_constants_are_read_without_a_command_and_failed_submits_are_counted(caplog) -> None:
    async def run() -> None:
        engine = ScriptedEngine()
        thread = EngineThread(engine, asyncio.get_running_loop(), lambda r: None)
        assert (thread.block_size, thread.num_layers, thread.num_kv_blocks,
                thread.max_num_batched_tokens) == (16, 2, 8, 64)
        thread.start()
        thread.submit(lambda e: e.add("x", 1), "add x")
        thread.submit(lambda e: e.add("x", 1), "add x again")  # raises on the engine thread
        await thread.call(lambda e: None)  # both commands ran before this one
        await asyncio.sleep(0)  # the failure callback runs on the loop
        assert thread.num_failed_commands == 1
        assert "add x again" in caplog.text and "in use" in caplog.text
        await thread.check_invariants()
        engine.invariant_broken = True
        with pytest.raises(AssertionError, match="invariant broken"):
            await thread.check_invariants()
        await thread.stop()
        thread.submit(lambda e: None, "after stop")  # refused quietly: nothing to act on
        await asyncio.sleep(0)
        assert thread.num_failed_commands == 1

    asyncio.run(run())


@pytest.mark.parametrize("reads_device_tokens, expected", [
    (True, StepMode.OVERLAPPED), (False, StepMode.PIPELINED)])
def test_overlapped_steps_need_a_runner_that_reads_device_tokens(reads_device_tokens,
                                                                 expected) -> None:
    async def run() -> StepMode:
        engine = ScriptedEngine()
        engine.runner = SimpleNamespace(reads_device_tokens=reads_device_tokens)
        thread = EngineThread(engine, asyncio.get_running_loop(), lambda report: None,
                              step_mode=StepMode.OVERLAPPED)
        return thread.step_mode

    assert asyncio.run(run()) is expected


@pytest.mark.parametrize("device, mode, timed", [
    ("cuda", StepMode.OVERLAPPED, True), ("cuda:1", StepMode.OVERLAPPED, True),
    ("cuda", StepMode.PIPELINED, False), ("cpu", StepMode.OVERLAPPED, False)])
def test_overlapped_cuda_steps_are_timed_on_the_device(device, mode, timed) -> None:
    """Only there is a step's wall time not its cost (engine/step_timer.py)."""
    async def run() -> bool:
        engine = ScriptedEngine()
        engine.config.device = device
        engine.runner = SimpleNamespace(reads_device_tokens=True)
        EngineThread(engine, asyncio.get_running_loop(), lambda report: None, step_mode=mode)
        return engine.step_timer is not None

    assert asyncio.run(run()) is timed
