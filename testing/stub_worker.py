"""A stub prefill/decode worker speaking the control API, for gateway tests and benchmarks.

It registers in Redis like a real worker (WorkerPublisher) and answers /internal/reserve,
/internal/prefill, /internal/destination, /internal/decode and /internal/abort with
protocol messages, and the operations agent's HealthRequest (each prefill and each token
counts as an engine step), but it computes nothing: every request's output is the scripted `reply`
(token id, text) list, one TokenFrame per token, paced `token_interval_s` apart (0: back to
back).

    reserve: ReserveResponse (after `reserve_gate` is set; refused when `fail_reserve`)
    prefill: PrefillResult(reply[0]) after prefill_delay_s (and after `prefill_gate` is
             set; the stream dies instead when `prefill_cut`), then TransferResult after
             transfer_delay_s (FAILED when fail_transfer); a request sent with
             `destination_follows` first waits for its DestinationNotice
    role change: recorded in `role_changes` and answered (the stub keeps its role)
    decode:  with first_token_id: checks it is reply[0], streams reply[1:]
             without (local prefill): streams reply[0:]
             last frame: finish_reason (length when max_tokens cut the reply) + usage

`decode_gate` (a threading.Event, or None) holds every decode stream before its
`decode_hold_after`-th token until it is set, so a test can check what happens while the
decode worker is busy (token 1 reaching the client first; an abort arriving before the next
token); `tokens_sent` counts the tokens each decode stream produced.

With `token` (the cluster's internal token), the stub is a worker of a cluster that has one:
its control API proves the token in every channel's greeting and takes only callers that
prove it, and its registry entry is bound to the token, as a real worker's
(protocol/cluster_secret.py); without, it is a worker of a cluster without a token.

`held` is what a real worker would hold KV for (reservations, prefills in flight, decodes);
abort, a dropped stream or the end of a request removes the id and records when
(time.monotonic, comparable across processes on one Linux host), so tests can check that
the gateway frees everything, and how fast. Run standalone:
    python -m testing.stub_worker --redis-url URL --role decode
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from aiohttp import web

from protocol.agent_messages import HealthReport, HealthRequest
from protocol.cluster_secret import KeyPurpose, derive_optional_key
from protocol.messages import (AbortRequest, AbortResponse, DecodeDestination, DecodeRequest,
                               DestinationAck, DestinationNotice, ErrorCode, FinishReason,
                               PrefillRequest, PrefillResult, ReserveRequest, ReserveResponse, Role,
                               RoleChangeRequest, RoleChangeResponse, TokenFrame, TransferResult,
                               TransferStatus, Usage, WorkerInfo)
from protocol.worker_load import WorkerLoad
from rpc.control_server import (ControlServer, FrameWriter, RequestRejected, add_call, add_stream,
                                make_app)
from state.redis_state import RedisState, connect
from telemetry.options import INTERNAL_TOKEN_ENV
from worker.publisher import WorkerPublisher

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 4096


@dataclass
class DecodeCut:
    after: int | None = None  # tokens into the next decode stream; None: no cut


class StubWorker:
    def __init__(self, redis_url: str, role: Role, worker_id: str,
                 reply: Sequence[tuple[int, str]], namespace: str = "pdserve",
                 token_interval_s: float = 0.0, prefill_delay_s: float = 0.0,
                 transfer_delay_s: float = 0.0, fail_transfer: bool = False,
                 colocated: bool = False, token: str | None = None) -> None:
        if not reply:
            raise ValueError("the stub needs a reply of at least one token")
        self.redis_url, self.role, self.worker_id = redis_url, role, worker_id
        self.namespace = namespace
        self.token = token
        self.reply = list(reply)
        self.token_interval_s = token_interval_s
        self.prefill_delay_s = prefill_delay_s
        self.transfer_delay_s = transfer_delay_s
        self.fail_transfer = fail_transfer
        # Reservations: held until `reserve_gate` (a threading.Event) is set; refused
        # (BAD_REQUEST) while `fail_reserve` is set.
        self.reserve_gate: threading.Event | None = None
        self.fail_reserve = False
        self.colocated = colocated
        # Fault injection: cut the next decode stream after this many tokens (as a worker
        # that dies mid-stream does), once; stubs may share one DecodeCut.
        self.decode_cut = DecodeCut()
        self.decode_gate: threading.Event | None = None
        self.decode_hold_after = 0
        self.prefill_gate: threading.Event | None = None  # token 1 waits until it is set
        self.prefill_cut = False  # the next prefill stream dies before token 1, once
        self.tokens_sent: dict[str, int] = {}  # request id -> decode tokens produced
        self.held: dict[str, str] = {}  # request id -> what holds it ("reserved", ...)
        self.released_at: dict[str, float] = {}  # request id -> monotonic time freed
        self.aborts: list[str] = []
        self.role_changes: list[Role] = []  # recorded and answered; the stub keeps its role
        self.destinations: dict[str, asyncio.Event] = {}  # DestinationNotices, by request id
        self.requests: list[str] = []  # "<kind>:<request id>" in arrival order
        self.num_steps = 0  # prefills and tokens produced: what a HealthReport counts
        self.server: ControlServer | None = None
        self.publisher: WorkerPublisher | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> str:
        app = make_app(token=self.token)
        add_call(app, ReserveRequest, self._reserve)
        add_stream(app, PrefillRequest, self._prefill)
        add_call(app, DestinationNotice, self._destination)
        add_stream(app, DecodeRequest, self._decode)
        add_call(app, AbortRequest, self._abort)
        add_call(app, RoleChangeRequest, self._change_role)
        add_call(app, HealthRequest, self._health_report)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._health)
        app.router.add_get("/admin/state", self._state)
        self.server = ControlServer(app, token=self.token)
        url = await self.server.start()
        state = RedisState(connect(self.redis_url), namespace=self.namespace,
                           entry_key=derive_optional_key(self.token, KeyPurpose.REGISTRY))
        role = Role.COLOCATED if self.colocated else self.role
        info = WorkerInfo(worker_id=self.worker_id, role=role, model="stub", control_url=url,
                          kv_address="stub", num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)
        self.publisher = WorkerPublisher(state, info, self._load)
        await self.publisher.start()
        return url

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.stop()
            await self.publisher.state.aclose()
        if self.server is not None:
            await self.server.stop()

    def _load(self) -> WorkerLoad:
        return WorkerLoad(num_running=len(self.held), num_kv_blocks_used=len(self.held),
                          num_kv_blocks_total=NUM_KV_BLOCKS)

    def _release(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None:
            self.released_at[request_id] = time.monotonic()

    # ---------------------------------------------------------------- handlers

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _health_report(self, message: HealthRequest) -> HealthReport:
        ended = len(self.released_at)
        return HealthReport(epoch=self.publisher.epoch if self.publisher else 0,
                            load=self._load(), num_steps=self.num_steps, step_sum_s=0.0,
                            num_decode_steps=0, decode_sum_s=0.0, decode_seqs=0.0,
                            decode_context=0.0, num_requests=ended, num_failed=0)

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response({"held": self.held, "released_at": self.released_at,
                                  "aborts": self.aborts, "requests": self.requests})

    async def _reserve(self, message: ReserveRequest) -> ReserveResponse:
        self.requests.append(f"reserve:{message.request_id}")
        gate = self.reserve_gate
        while gate is not None and not gate.is_set():
            await asyncio.sleep(0.005)
        if self.fail_reserve:
            raise RequestRejected(ErrorCode.BAD_REQUEST, "stub: reservation refused",
                                  message.request_id)
        self.held[message.request_id] = "reserved"
        num_blocks = math.ceil(len(message.prompt_token_ids) / BLOCK_SIZE)
        destination = DecodeDestination(worker_id=self.worker_id, epoch=self.publisher.epoch,
                                        kv_address="stub", block_ids=list(range(num_blocks)))
        return ReserveResponse(request_id=message.request_id, destination=destination)

    async def _abort(self, message: AbortRequest) -> AbortResponse:
        self.aborts.append(message.request_id)
        found = message.request_id in self.held
        self._release(message.request_id)
        return AbortResponse(request_id=message.request_id, found=found)

    async def _change_role(self, message: RoleChangeRequest) -> RoleChangeResponse:
        self.role_changes.append(message.role)
        return RoleChangeResponse(role=message.role, epoch=self.publisher.epoch)

    async def _destination(self, message: DestinationNotice) -> DestinationAck:
        rid = message.request_id
        self.requests.append(f"destination:{rid}")
        waiting = rid in self.held
        self.destinations.setdefault(rid, asyncio.Event()).set()
        return DestinationAck(request_id=rid, waiting=waiting)

    async def _prefill(self, message: PrefillRequest, out: FrameWriter) -> AsyncIterator[object]:
        rid = message.request_id
        self.requests.append(f"prefill:{rid}")
        self.held[rid] = "prefilling"
        noticed = self.destinations.setdefault(rid, asyncio.Event())
        try:
            await asyncio.sleep(self.prefill_delay_s)
            gate = self.prefill_gate
            while gate is not None and not gate.is_set():
                await asyncio.sleep(0.005)
            if self.prefill_cut:
                self.prefill_cut = False
                raise ConnectionResetError("stub: prefill stream cut (fault injection)")
            token_id, _ = self.reply[0]
            self.num_steps += 1
            finish = FinishReason.LENGTH if message.sampling.max_tokens == 1 else None
            yield PrefillResult(request_id=rid, first_token_id=token_id,
                                num_prompt_tokens=len(message.prompt_token_ids),
                                num_cached_tokens=0, transfer_status=TransferStatus.PENDING,
                                finish_reason=finish)
            await asyncio.sleep(self.transfer_delay_s)
            if message.destination_follows:
                await asyncio.wait_for(noticed.wait(), 30)
            dest = message.destination
            yield TransferResult(
                request_id=rid, destination_worker_id=dest.worker_id if dest else self.worker_id,
                destination_epoch=dest.epoch if dest else 0,
                status=TransferStatus.FAILED if self.fail_transfer else TransferStatus.DONE,
                error="stub transfer failure" if self.fail_transfer else None)
        finally:
            self._release(rid)
            self.destinations.pop(rid, None)

    async def _decode(self, message: DecodeRequest, out: FrameWriter) -> AsyncIterator[object]:
        rid = message.request_id
        self.requests.append(f"decode:{rid}")
        if message.first_token_id is not None:
            if self.held.get(rid) != "reserved":
                raise RequestRejected(ErrorCode.UNKNOWN_REQUEST, f"no reservation for {rid}", rid)
            if message.first_token_id != self.reply[0][0]:
                raise RequestRejected(ErrorCode.BAD_REQUEST, "unexpected first token", rid)
        resumed = list(message.resume_token_ids)
        if resumed != [token_id for token_id, _ in self.reply[:len(resumed)]]:
            raise RequestRejected(ErrorCode.BAD_REQUEST, "resumed tokens are not the reply's",
                                  rid)
        self.held[rid] = "decoding"
        num_total = min(len(self.reply), message.sampling.max_tokens)
        start = 1 if message.first_token_id is not None else len(resumed)
        cut_after, self.decode_cut.after = self.decode_cut.after, None
        try:
            for i in range(start, num_total):
                if cut_after is not None and i - start >= cut_after:
                    raise ConnectionResetError("stub: decode stream cut (fault injection)")
                if self.token_interval_s:
                    await asyncio.sleep(self.token_interval_s)
                gate = self.decode_gate
                while (gate is not None and i - start >= self.decode_hold_after
                       and not gate.is_set()):
                    await asyncio.sleep(0.005)
                if rid not in self.held:  # aborted meanwhile
                    yield TokenFrame(request_id=rid, token_ids=[], finish_reason=FinishReason.ABORT)
                    return
                token_id, text = self.reply[i]
                self.tokens_sent[rid] = self.tokens_sent.get(rid, 0) + 1
                self.num_steps += 1
                last = i == num_total - 1
                finish = None
                if last:
                    finish = FinishReason.LENGTH if num_total < len(self.reply) else FinishReason.STOP
                yield TokenFrame(
                    request_id=rid, token_ids=[token_id], text=text, finish_reason=finish,
                    usage=Usage(num_prompt_tokens=len(message.prompt_token_ids),
                                num_completion_tokens=num_total) if last else None)
            if start >= num_total:  # the reply was all in the first token
                yield TokenFrame(request_id=rid, token_ids=[], finish_reason=FinishReason.LENGTH,
                                 usage=Usage(num_prompt_tokens=len(message.prompt_token_ids),
                                             num_completion_tokens=num_total))
        finally:
            self._release(rid)


def word_reply(tokenizer, text: str) -> list[tuple[int, str]]:
    """(id, text) per token of `text`, using a tokenizer with encode/decode."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [(i, tokenizer.decode([i])) for i in ids]


async def _main(args: argparse.Namespace) -> None:
    from gateway.api.model_files import read_model_info

    _, tokenizer = read_model_info(args.tokenizer_model)
    words = " ".join(["word"] * args.num_tokens)
    stub = StubWorker(args.redis_url, Role(args.role), args.worker_id or
                      f"stub-{args.role}-{os.getpid()}", word_reply(tokenizer, words),
                      namespace=args.namespace, token_interval_s=args.token_interval_ms / 1000,
                      token=os.environ.get(INTERNAL_TOKEN_ENV) or None)
    url = await stub.start()
    print(f"stub worker listening on {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await stub.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", required=True, help="the registry to register in")
    parser.add_argument("--role", default="decode", choices=["prefill", "decode"],
                        help="the pool to register in (default decode)")
    parser.add_argument("--worker-id", help="registry id (default: a fresh one)")
    parser.add_argument("--namespace", default="pdserve",
                        help="registry key prefix (default pdserve)")
    parser.add_argument("--num-tokens", type=int, default=64,
                        help="tokens streamed per request (default 64)")
    parser.add_argument("--token-interval-ms", type=float, default=0.0,
                        help="gap between tokens (default 0: back to back)")
    parser.add_argument("--tokenizer-model", default="default",
                        help="whose tokenizer spells the reply: \"default\" or a model path")
    import uvloop

    uvloop.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
