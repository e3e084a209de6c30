"""Prefill and decode worker processes on the default model, driven the way the gateway does.

Real processes (`python -m launcher.cli prefill-worker|decode-worker`, port 0, found through
the Redis registry), a real Redis-protocol server, real KV transfer on loopback (UCX for
one prefill/decode pair, TCP for the other). The TCP pair's prefill worker sleeps before
each layer of requests named "fault-*" (a FaultRequest, worker/faults.py: it is started
with PDSERVE_FAULT_INJECTION=1), so their transfers take ~9 s: long enough to stall past a
deadline or to kill the decode worker mid-transfer.

The Redis server is private to this module because one test stops it for 6 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import pytest
from raw_channel import greet

from launcher.redis_server import RedisServer
from protocol.agent_messages import FAULT_INJECTION_ENV, FaultRequest, FaultResponse
from protocol.messages import (AbortRequest, AbortResponse, DecodeDestination, DecodeRequest,
                               DestinationAck, DestinationNotice, ErrorCode, ErrorFrame, Message,
                               MessageDecoder, PrefillRequest, PrefillResponseFrame, PrefillResult,
                               ReserveRequest, ReserveResponse, TokenFrame, TransferResult,
                               TransferStatus, encode)
from protocol.sampling_params import SamplingParams
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import ControlError, RemoteError
from rpc.channel_wire import FrameSplitter
from rpc.channel_wire import frame as wire_frame
from state.redis_state import RedisState, connect
from telemetry.metrics import parse_samples

# Generous: the module fixture starts four model-loading processes on a shared host.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "handoff-test"
SHORT = "The capital of France is"
LONG = ("Here is a long story about a lighthouse keeper who lived alone on a small rocky "
        "island far from the coast. Every night he climbed the spiral stairs, trimmed the "
        "wick, polished the great lens and watched the beam sweep across the dark water. "
        "Ships passed in the distance, and sometimes a fishing boat came close enough that "
        "he could hear the crew singing. In winter the storms were fierce; waves crashed "
        "over the rocks and the whole tower trembled. ") * 2
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LAYER_DELAY_MS = 300  # x 30 layers: a 9 s transfer for "fault-*" requests on the TCP pair


@dataclass
class Worker:
    worker_id: str
    args: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # beside the test's own
    process: subprocess.Popen | None = None
    control_url: str = ""
    epoch: int = 0

    def start(self, redis_url: str) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", *self.args,
             "--worker-id", self.worker_id, "--namespace", NAMESPACE, "--threads", "1",
             "--kv-cache-mb", "48", "--log-level", "warning"],
            cwd=ROOT, stdout=log, stderr=log,  # the URL holds the password: in the environment
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PDSERVE_REDIS_URL": redis_url,
                 **self.env})

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Cluster:
    redis: RedisServer
    workers: dict[str, Worker]
    reference: dict[str, list[int]] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)


async def wait_registered(redis_url: str, workers: list[Worker], timeout_s: float) -> None:
    """Until every worker is in the registry and its /ready answers 200."""
    state = RedisState(connect(redis_url), NAMESPACE)
    deadline = time.monotonic() + timeout_s
    try:
        async with aiohttp.ClientSession() as session:
            pending = list(workers)
            while pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers not ready: {[w.worker_id for w in pending]}: "
                                       + " | ".join(w.log_path.read_text()[-2000:]
                                                    for w in pending))
                for w in pending:
                    assert w.process.poll() is None, w.log_path.read_text()[-3000:]
                with contextlib.suppress(Exception):
                    infos = await state.list_workers()
                    for w in list(pending):
                        info = infos.get(w.worker_id)
                        if info is None:
                            continue
                        async with session.get(info.control_url + "/ready") as response:
                            if response.status == 200:
                                w.control_url, w.epoch = info.control_url, info.epoch
                                pending.remove(w)
                await asyncio.sleep(0.3)
    finally:
        await state.aclose()


async def call(w: Worker, message: Message, answer_type: type[Message]) -> Message:
    pool = ChannelPool(None)
    try:
        return await ControlClient(w.control_url, pool).call(message, answer_type, 10.0)
    finally:
        await pool.aclose()


def reference_outputs(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    import torch

    from engine.engine_builder import build_engine
    from engine.llm_engine import EngineConfig
    torch.set_num_threads(1)
    engine = build_engine("default", EngineConfig(num_kv_blocks=64))
    params = GREEDY
    return {name: engine.generate([ids], params)[0].token_ids for name, ids in prompts.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    logs = tmp_path_factory.mktemp("workers")
    redis = RedisServer()
    redis.start()
    pair = ["--max-num-batched-tokens", "64"]  # chunked prefill of the long prompt
    # The ucx pair maps each other's pools (--kv-mapping on, the default: one host), so its
    # KV moves by mapped copies; the tcp pair keeps every byte on the TCP carrier.
    workers = {
        "p-ucx": Worker("p-ucx", ["prefill-worker", "--kv-transport", "ucx", *pair],
                        logs / "p-ucx.log"),
        "d-ucx": Worker("d-ucx", ["decode-worker", "--kv-transport", "ucx"], logs / "d-ucx.log"),
        "p-tcp": Worker("p-tcp", ["prefill-worker", "--kv-transport", "tcp", "--kv-mapping", "off"],
                        logs / "p-tcp.log", env={FAULT_INJECTION_ENV: "1"}),
        # Warmed up before it registers (the default on CUDA only): see the warm-up test.
        # The pair's 64-token step budget keeps its warm-up (every kind of step still) short:
        # the module's start-up waits for it.
        "d-tcp": Worker("d-tcp", ["decode-worker", "--kv-transport", "tcp", "--kv-mapping", "off",
                                  "--warm-up", "on", *pair], logs / "d-tcp.log"),
    }
    for w in workers.values():
        w.start(redis.url)
    try:
        from engine.engine_builder import load_tokenizer
        from engine.loader import load_model
        tokenizer = load_tokenizer(load_model("default").tokenizer_source)
        prompts = {"short": tokenizer.encode(SHORT), "long": tokenizer.encode(LONG)}
        assert 100 <= len(prompts["long"]) <= 300, len(prompts["long"])
        reference = reference_outputs(prompts)
        asyncio.run(wait_registered(redis.url, list(workers.values()), 150))
        slow = FaultRequest(transfer_layer_delay_ms=LAYER_DELAY_MS, request_prefix="fault-")
        assert asyncio.run(call(workers["p-tcp"], slow, FaultResponse)).transfer_layer_delay_ms
        yield Cluster(redis, workers, reference, prompts)
    finally:
        for w in workers.values():  # all at once: each drains and deregisters
            if w.process is not None and w.process.poll() is None:
                w.process.send_signal(signal.SIGTERM)
        for w in workers.values():
            w.stop()
        redis.stop()


# ------------------------------------------------------------------------- the gateway's part

@dataclass
class Handoff:
    reserve: ReserveResponse | None = None
    prefill: PrefillResult | None = None
    transfer: TransferResult | None = None
    tokens: list[int] = field(default_factory=list)
    decode_error: Exception | None = None
    prefill_error: Exception | None = None
    ack: DestinationAck | None = None
    elapsed_s: float = 0.0


async def run_handoff(p: Worker, d: Worker, rid: str, prompt: list[int],
                      sampling: SamplingParams = GREEDY, timeout_ms: int = 30_000,
                      start: str = "after-reserve") -> Handoff:
    """reserve on D -> prefill on P -> decode on D (sent right after the first token).
    start="early": the prefill starts at once with `destination_follows`, beside the
    reserve, whose destination then goes to P in a DestinationNotice (the gateway's early
    prefill); "notice-first": the notice reaches P before the PrefillRequest does."""
    early = start != "after-reserve"
    result = Handoff()
    started = time.monotonic()
    pool = ChannelPool(None)  # one channel per worker, as the gateway's
    pc, dc = ControlClient(p.control_url, pool), ControlClient(d.control_url, pool)
    reserve = ReserveRequest(request_id=rid, prompt_token_ids=prompt, timeout_ms=timeout_ms)

    async def reserve_and_forward() -> None:
        result.reserve = await dc.call(reserve, ReserveResponse, 5.0)
        if early:
            notice = DestinationNotice(request_id=rid, destination=result.reserve.destination)
            result.ack = await pc.call(notice, DestinationAck, 5.0)

    reserving = asyncio.create_task(reserve_and_forward())
    # The client waits past the request's own deadline: a worker's answer at its deadline
    # (a failed TransferResult) must reach the test, not race the client's own timeout.
    wait_s = timeout_ms / 1000 + 5.0
    try:
        if start != "early":
            await reserving
        decode_task = None
        try:
            async for frame in pc.stream(PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                    timeout_ms=timeout_ms, destination_follows=early,
                    destination=None if early else result.reserve.destination),
                    PrefillResponseFrame, wait_s, wait_s):
                if isinstance(frame, PrefillResult):
                    result.prefill = frame
                    result.tokens.append(frame.first_token_id)
                    decode_task = asyncio.create_task(_decode(dc, rid, prompt, sampling,
                                                              frame, result, timeout_ms,
                                                              reserving))
                elif isinstance(frame, TransferResult):
                    result.transfer = frame
        except ControlError as exc:  # a worker killed mid-stream: its channel is lost
            result.prefill_error = exc
            await dc.call(AbortRequest(request_id=rid), AbortResponse, 2.0)
        if decode_task is not None:
            await decode_task
    finally:
        await asyncio.gather(reserving, return_exceptions=True)
        await pool.aclose()
    result.elapsed_s = time.monotonic() - started
    return result


async def _decode(dc: ControlClient, rid: str, prompt: list[int], sampling: SamplingParams,
                  first: PrefillResult, result: Handoff, timeout_ms: int,
                  reserving: asyncio.Task[None]) -> None:
    await reserving
    try:
        async for frame in dc.stream(DecodeRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                timeout_ms=timeout_ms, first_token_id=first.first_token_id,
                epoch=result.reserve.destination.epoch), TokenFrame,
                timeout_ms / 1000 + 5.0, timeout_ms / 1000 + 5.0):
            result.tokens.extend(frame.token_ids)
    except ControlError as exc:
        result.decode_error = exc


async def worker_state(w: Worker) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(w.control_url + "/admin/state",
                               timeout=aiohttp.ClientTimeout(total=5)) as response:
            return await response.json()


async def metrics(w: Worker) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(w.control_url + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=5)) as response:
            return parse_samples(await response.text())


async def wait_no_blocks_held(w: Worker, timeout_s: float) -> dict:
    """Poll /admin/state until the worker holds no block; returns the last state."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = await worker_state(w)
        assert state["invariant_error"] is None, state
        if state["num_kv_blocks_used"] == 0 and state["num_held_tables"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{w.worker_id} still holds blocks: {state}")
        await asyncio.sleep(0.1)


def sent_bytes(samples: dict[str, float]) -> float:
    return samples.get('pdserve_kv_transfer_bytes_total{direction="sent"}', 0.0)


def received_bytes(samples: dict[str, float]) -> float:
    return samples.get('pdserve_kv_transfer_bytes_total{direction="received"}', 0.0)


# ------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("backend", ["ucx", "tcp"])
@pytest.mark.parametrize("start", ["after-reserve", "early"])
def test_handoff_is_token_identical_to_one_engine(cluster: Cluster, backend: str,
                                                  start: str) -> None:
    p, d = cluster.workers[f"p-{backend}"], cluster.workers[f"d-{backend}"]

    async def run() -> None:
        for name in ("short", "long"):
            result = await run_handoff(p, d, f"same-{backend}-{start}-{name}",
                                       cluster.prompts[name], start=start)
            assert result.prefill_error is None and result.decode_error is None, result
            assert result.transfer.status is TransferStatus.DONE
            assert result.tokens == cluster.reference[name], name
            # Its wait in the prefill worker's queue, less than the whole prefill took.
            assert result.prefill is not None and result.prefill.queue_ms is not None
            assert 0 <= result.prefill.queue_ms < result.elapsed_s * 1000
        path = "mapped" if backend == "ucx" else "carrier"  # see the cluster fixture
        samples = await metrics(p)
        assert samples.get(f'pdserve_kv_transfers_total{{direction="sent",path="{path}"}}', 0) >= 2
        # Layer-wise push is the default: announced mid-step (the host has no layer events).
        assert samples.get('pdserve_kv_pushes_total{start="mid_step"}', 0) >= 2
        await wait_no_blocks_held(p, 2.0)
        await wait_no_blocks_held(d, 2.0)

    asyncio.run(run())


def test_a_destination_notice_that_overtakes_its_prefill_request_is_used(cluster: Cluster) -> None:
    p, d = cluster.workers["p-ucx"], cluster.workers["d-ucx"]

    async def run() -> None:
        result = await run_handoff(p, d, "notice-first", cluster.prompts["long"],
                                   start="notice-first")
        assert result.ack is not None and result.ack.waiting is False  # held until it came
        assert result.transfer.status is TransferStatus.DONE
        assert result.tokens == cluster.reference["long"]
        await wait_no_blocks_held(p, 2.0)
        await wait_no_blocks_held(d, 2.0)

    asyncio.run(run())


def test_bad_destination_notices_get_a_clear_error_and_hold_nothing(cluster: Cluster) -> None:
    p = cluster.workers["p-ucx"]
    good = msgspec.msgpack.decode(encode(DestinationNotice(request_id="bad-notice", destination=(
        DecodeDestination(worker_id="d", epoch=1, kv_address="x", block_ids=[1, 2])))))
    no_destination = [good[0], {k: v for k, v in good[1].items() if k != "destination"}]
    too_many_held = [good[0], {**good[1], "destination": {**good[1]["destination"],
                                                          "num_prefix_blocks_held": 3}}]
    bodies = {"garbage": b"\xc1not msgpack", "no destination": msgspec.msgpack.encode(no_destination),
              "more blocks held than reserved": msgspec.msgpack.encode(too_many_held),
              "empty request id": msgspec.msgpack.encode([good[0], {**good[1], "request_id": ""}])}

    async def run() -> None:
        before = await worker_state(p)
        host, port = p.control_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:  # a channel, its frames written by hand: the bodies a typed client cannot send
            await greet(reader, writer, None, host, int(port))
            answers = FrameSplitter(1 << 20)
            for stream_id, (what, body) in enumerate(bodies.items(), start=1):
                writer.write(wire_frame(stream_id, body))
                got: list[tuple[int, bytes]] = []
                while not any(sid == stream_id and not b for sid, b in got):  # its end frame
                    data = await asyncio.wait_for(reader.read(1 << 16), 10)
                    assert data, f"the worker closed the channel after {what!r}"
                    got += [(sid, bytes(b)) for sid, b in answers.feed(data)]
                [error] = [b for sid, b in got if sid == stream_id and b]
                answer = MessageDecoder(ErrorFrame).decode(error)
                assert answer.code in (ErrorCode.BAD_REQUEST, ErrorCode.PROTOCOL_VERSION), what
                assert answer.message, what
        finally:
            writer.close()
        after = await worker_state(p)
        assert after["invariant_error"] is None, after
        assert after["num_held_destinations"] == before["num_held_destinations"]

    asyncio.run(run())


def test_a_destination_that_never_comes_ends_the_prefill_at_its_deadline(cluster: Cluster) -> None:
    # The first token still goes out at once; the push waits for the destination until the
    # request's deadline, then the stream ends with DEADLINE_EXCEEDED and the blocks are freed.
    p = cluster.workers["p-ucx"]

    async def run() -> None:
        pool = ChannelPool(None)
        pc = ControlClient(p.control_url, pool)
        frames: list[object] = []
        try:
            with pytest.raises(RemoteError) as failure:
                async for frame in pc.stream(PrefillRequest(
                        request_id="no-destination", prompt_token_ids=cluster.prompts["long"],
                        sampling=GREEDY, timeout_ms=4000, destination_follows=True),
                        PrefillResponseFrame, 30, 30):
                    frames.append(frame)
        finally:
            await pool.aclose()
        assert [type(f) for f in frames] == [PrefillResult]
        assert frames[0].first_token_id == cluster.reference["long"][0]
        assert failure.value.frame.code is ErrorCode.DEADLINE_EXCEEDED
        await wait_no_blocks_held(p, 5.0)

    asyncio.run(run())


def test_a_reservation_is_released_when_the_channel_that_made_it_closes(
        cluster: Cluster) -> None:
    # A gateway that dies between its reserve and its DecodeRequest: the reservation (a
    # 60 s deadline here) goes within a second of the channel closing, not at its deadline.
    d = cluster.workers["d-ucx"]

    async def run() -> None:
        pool = ChannelPool(None)
        reserve = ReserveRequest(request_id="orphan", prompt_token_ids=cluster.prompts["long"],
                                 timeout_ms=60_000)
        try:
            reply = await ControlClient(d.control_url, pool).call(reserve, ReserveResponse, 5.0)
            assert reply.destination.block_ids
            state = await worker_state(d)
            assert state["num_reservations"] == 1 and state["num_kv_blocks_used"] > 0
        finally:
            await pool.aclose()  # the caller is gone
        state = await wait_no_blocks_held(d, 1.0)
        assert state["num_reservations"] == 0
        assert (await metrics(d)).get('pdserve_handoff_failures_total{reason="caller_lost"}') \
            == 1.0

    asyncio.run(run())


def test_shared_prefix_sends_fewer_kv_bytes(cluster: Cluster) -> None:
    p, d = cluster.workers["p-ucx"], cluster.workers["d-ucx"]
    # A prefix no earlier request had (chained hashes differ from the first block on).
    long_ids = [11, 12, 13] + cluster.prompts["long"][40:]

    async def run() -> None:
        before = sent_bytes(await metrics(p)), received_bytes(await metrics(d))
        first = await run_handoff(p, d, "prefix-1", long_ids + [1, 2, 3])
        middle = sent_bytes(await metrics(p)), received_bytes(await metrics(d))
        second = await run_handoff(p, d, "prefix-2", long_ids + [4, 5, 6])
        after = sent_bytes(await metrics(p)), received_bytes(await metrics(d))
        assert first.transfer.status is second.transfer.status is TransferStatus.DONE
        assert second.reserve.destination.num_prefix_blocks_held >= 4
        first_sent, second_sent = middle[0] - before[0], after[0] - middle[0]
        assert first_sent == first.transfer.num_bytes_sent > 0
        assert first.transfer.num_blocks_sent == -(-len(long_ids + [1, 2, 3]) // 16)
        assert 0 < second_sent < first_sent / 2
        assert after[1] - middle[1] == second_sent  # both sides count the same bytes

    asyncio.run(run())


def test_a_worker_warms_up_with_progress_before_it_registers(cluster: Cluster) -> None:
    d = cluster.workers["d-tcp"]  # --warm-up on
    log = d.log_path.read_text()
    progress = [line for line in log.splitlines() if line.startswith("d-tcp: warming up: ")]
    assert len(progress) >= 5, log[-3000:]  # one line per kind of step, on stderr

    async def run() -> None:
        # The gauge is set before the worker registers: registered means warmed up.
        assert (await metrics(d))["pdserve_warmup_seconds"] > 0
        assert (await metrics(cluster.workers["d-ucx"]))["pdserve_warmup_seconds"] == 0.0
        await wait_no_blocks_held(d, 10)  # its requests left nothing held

    asyncio.run(run())


@pytest.mark.parametrize("aborts", ["own channel", "shared channel"])
def test_abort_stops_the_decode_stream_at_the_token_it_had_reached(cluster: Cluster,
                                                                   aborts: str) -> None:
    # Cause and effect, not a latency bound: the worker answers the abort with the number
    # of tokens its stream had sent when the abort arrived, and the client must receive
    # exactly those and then ABORTED; a worker that sent one more token fails. (Abort
    # latencies are measured by benchmarks/, not asserted here.) Most tokens leave from the
    # engine's delivery callback (worker/stream_frames.py), counted there. The abort comes
    # on the stream's own channel (as the gateway sends it) or on another one.
    d = cluster.workers["d-ucx"]
    rid = f"abort-me-{aborts.split()[0]}"

    async def run() -> None:
        pool = ChannelPool(None)
        client = ControlClient(d.control_url, pool)
        abort_pool = pool if aborts == "shared channel" else ChannelPool(None)
        frames: list[TokenFrame] = []
        ended: list[RemoteError] = []

        async def consume() -> None:
            try:
                async for frame in client.stream(DecodeRequest(
                        request_id=rid, prompt_token_ids=cluster.prompts["short"],
                        sampling=SamplingParams(max_tokens=500, temperature=0.0,
                                              ignore_eos=True),
                        timeout_ms=60_000), TokenFrame, 30.0, 30.0):
                    frames.append(frame)
            except RemoteError as exc:
                ended.append(exc)

        task = asyncio.create_task(consume())
        while sum(len(f.token_ids) for f in frames) < 3:
            await asyncio.sleep(0.01)
        abort_client = ControlClient(d.control_url, abort_pool)
        answer = await abort_client.call(AbortRequest(request_id=rid), AbortResponse, 5.0)
        await asyncio.wait_for(task, 10.0)
        assert pool.num_channels == 1  # the stream and (shared) the abort on one channel
        await pool.aclose()
        await abort_pool.aclose()
        assert answer.found
        assert answer.num_tokens_sent >= 3
        assert sum(len(f.token_ids) for f in frames) == answer.num_tokens_sent
        assert all(f.finish_reason is None for f in frames)
        assert ended and ended[0].frame.code is ErrorCode.ABORTED
        await wait_no_blocks_held(d, 5.0)
        again = ChannelPool(None)
        repeat = await ControlClient(d.control_url, again).call(AbortRequest(request_id=rid),
                                                                AbortResponse, 5.0)
        await again.aclose()
        assert not repeat.found and repeat.num_tokens_sent == 0

    asyncio.run(run())


def test_stalled_transfer_fails_within_its_deadline_and_frees_both_sides(
        cluster: Cluster) -> None:
    p, d = cluster.workers["p-tcp"], cluster.workers["d-tcp"]

    async def run() -> None:
        failures_before = sum(v for k, v in (await metrics(d)).items()
                              if k.startswith("pdserve_handoff_failures_total"))
        timeout_ms = 4000  # the push needs ~9 s: it stalls past the deadline
        result = await run_handoff(p, d, "fault-stall", cluster.prompts["long"],
                                   timeout_ms=timeout_ms)
        assert result.prefill is not None
        assert result.transfer.status is TransferStatus.FAILED, result.transfer
        assert isinstance(result.decode_error, RemoteError), result
        assert result.decode_error.frame.code in (ErrorCode.TRANSFER_FAILED,
                                                  ErrorCode.DEADLINE_EXCEEDED)
        assert result.elapsed_s < timeout_ms / 1000 + 2.0, result.elapsed_s
        await wait_no_blocks_held(p, 2.0)
        await wait_no_blocks_held(d, 2.0)
        failures_after = sum(v for k, v in (await metrics(d)).items()
                             if k.startswith("pdserve_handoff_failures_total"))
        assert failures_after > failures_before

    asyncio.run(run())


def test_killing_the_decode_worker_mid_transfer_fails_the_push(cluster: Cluster) -> None:
    p, d = cluster.workers["p-tcp"], cluster.workers["d-tcp"]

    async def run() -> None:
        rid, prompt = "fault-kill-decode", cluster.prompts["long"]
        pool = ChannelPool(None)
        dc, pc = ControlClient(d.control_url, pool), ControlClient(p.control_url, pool)
        reserve = await dc.call(ReserveRequest(
            request_id=rid, prompt_token_ids=prompt, timeout_ms=20_000),
            ReserveResponse, 5.0)
        frames = []
        killed_at = None
        async for frame in pc.stream(PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, timeout_ms=20_000,
                destination=reserve.destination), PrefillResponseFrame, 20.0, 20.0):
            frames.append(frame)
            if isinstance(frame, PrefillResult):
                await asyncio.sleep(1.0)  # ~3 of 30 layers sent
                d.kill()
                killed_at = time.monotonic()
        detected_s = time.monotonic() - killed_at
        await pool.aclose()
        assert isinstance(frames[-1], TransferResult)
        assert frames[-1].status is TransferStatus.FAILED, frames[-1]
        assert detected_s < 3.0, detected_s  # well before the 20 s deadline
        await wait_no_blocks_held(p, 2.0)
        samples = await metrics(p)
        assert any(k.startswith("pdserve_handoff_failures_total") for k in samples)

    asyncio.run(run())


def test_killing_the_prefill_worker_frees_the_reservation_and_restart_purges_index(
        cluster: Cluster) -> None:
    p, d = cluster.workers["p-ucx"], cluster.workers["d-ucx"]
    from protocol.block_hashes import block_hashes

    async def run() -> None:
        state = RedisState(connect(cluster.redis.url), NAMESPACE)
        long_hashes = block_hashes(cluster.prompts["long"], 16)
        holders = await state.query_prefix_holders(long_hashes[:4])
        old_epoch = p.epoch
        assert all(h.get(p.worker_id) == old_epoch for h in holders), holders

        timeout_ms = 2500
        prompt = [7, 8, 9] + cluster.prompts["long"]  # not cached: a real prefill
        task = asyncio.create_task(run_handoff(p, d, "kill-prefill", prompt,
                                               timeout_ms=timeout_ms))
        await asyncio.sleep(0.3)  # 4 chunks of 64 tokens take longer than this
        p.kill()
        killed_at = time.monotonic()
        result = await asyncio.wait_for(task, 10)
        assert result.prefill_error is not None, result
        assert result.prefill is None  # died before the first token
        assert time.monotonic() - killed_at < 2.0
        await wait_no_blocks_held(d, 2.0)

        p.start(cluster.redis.url)
        await wait_registered(cluster.redis.url, [p], 60)
        assert p.epoch > old_epoch
        holders = await state.query_prefix_holders(long_hashes[:4])
        for per_hash in holders:
            assert p.worker_id not in per_hash, holders  # the old epoch's entries are gone
        again = await run_handoff(p, d, "after-restart", cluster.prompts["short"])
        assert again.tokens == cluster.reference["short"]
        await state.aclose()

    asyncio.run(run())


def test_redis_outage_does_not_stop_a_running_decode(cluster: Cluster) -> None:
    d = cluster.workers["d-ucx"]
    outage_s = 6.0  # twice the registry lease (3 s), past the publisher's 2 s longest backoff

    async def run() -> None:
        pool = ChannelPool(None)
        client = ControlClient(d.control_url, pool)
        arrivals: list[tuple[float, int]] = []
        max_tokens = 150
        stopped_at = restarted_at = None
        frames = client.stream(DecodeRequest(
            request_id="through-outage", prompt_token_ids=cluster.prompts["short"],
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            timeout_ms=120_000), TokenFrame, 30.0, 30.0)
        last = None
        async for frame in frames:
            arrivals.append((time.monotonic(), len(frame.token_ids)))
            last = frame
            if stopped_at is None:
                cluster.redis.stop()
                stopped_at = time.monotonic()
            elif restarted_at is None and time.monotonic() - stopped_at >= outage_s:
                cluster.redis.start()
                restarted_at = time.monotonic()
        await pool.aclose()
        if restarted_at is None:
            await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - stopped_at)))
            cluster.redis.start()
        assert last.finish_reason is not None and last.usage.num_completion_tokens == max_tokens
        during = sum(n for t, n in arrivals if stopped_at + 1 < t < stopped_at + outage_s)
        assert during > 10, arrivals  # tokens kept flowing while Redis was down
        assert sum(n for _, n in arrivals) == max_tokens
        # The worker republishes itself once Redis is back.
        await wait_registered(cluster.redis.url, [d], 15)

    asyncio.run(run())


def test_sigterm_drains_deregisters_and_exits_zero(cluster: Cluster) -> None:
    d = cluster.workers["d-ucx"]

    async def run() -> None:
        state = RedisState(connect(cluster.redis.url), NAMESPACE)
        d.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        while d.process.poll() is None and time.monotonic() - started < 20:
            await asyncio.sleep(0.1)
        assert d.process.returncode == 0, d.log_path.read_text()[-2000:]
        assert d.worker_id not in await state.list_workers()
        await state.aclose()

    asyncio.run(run())
