"""The real `CompletionBackend`: plans a route and runs the prefill → decode handoff.

Long prompt (a prefill worker P and a decode worker D):

    gateway                          D                               P
      │── ReserveRequest ───────────▶│ holds blocks (timeout_ms)
      │◀─ ReserveResponse(dest) ─────│
      │── PrefillRequest(dest) ──────────────────────────────────────▶│ prefill, sample t1
      │◀─ PrefillResult(t1) ──────────────────────────────────────────│
      │ yield t1 to the client at once (stream-first)
      │── DecodeRequest(t1, epoch) ─▶│ waits for the KV      ◀══ KV ══│ push
      │◀─ TransferResult ─────────────────────────────────────────────│ (watched by a task)
      │◀─ TokenFrame t2.. ───────────│ ... last frame: finish_reason + usage

Short prompt (tier threshold) or no prefill worker: one DecodeRequest without a first
token; D prefills it and its first frame carries t1.

Exactly once at the splice: t1 comes only from PrefillResult (its text made here by
`GatewayTokenizer.first_token_text`, as the engine makes it); D never re-sends t1, so the
client sees t1, t2, ... tn, and the relayed count must equal D's `usage`
(`num_completion_tokens`); a mismatch is counted in pdserve_gateway_splice_mismatch_total.

Failure of any leg (error frame, deadline, transport, failed transfer) or a client that
goes away (the generator is closed or its task cancelled): /internal/abort goes to every
worker the request touched, and the open streams are dropped (D treats a dropped decode
stream as an abort too). Aborts are sent from tasks this backend owns, so a cancelled
handler cannot stop them half-way; `aclose()` cancels what is left at shutdown. Before
the first token a failure is `BackendUnavailable` (HTTP 503); after it the same exception
becomes an in-band SSE error event (gateway/http_api.py).

Lifecycle of one generation: planned (route) → legs opened (each worker it calls is added
to its Handoff's `legs`) → streaming → finished (D's finish_reason), or failed / closed
early → every leg aborted (from an owned background task) → gone from `_active`.

Invariants (`check_invariants`): a generation that did not end with a finish_reason from
its decode worker has sent an abort to every worker in its `legs` (the legs are emptied
when the aborts are sent); every generation in progress is in `_active` under its id, and
its legs use this backend's clients; every abort task is in `_background` until it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence

from aiohttp import ClientSession

from common.contract.block_hashes import block_hashes
from common.contract.control_client import ControlClient
from common.contract.frames import FrameBatchDecoder, stream_frame_batches
from common.contract.protocol import (AbortRequest, AbortResponse, DecodeRequest,
                                      DecodeResponseFrame, FinishReason, Message, PrefillRequest,
                                      PrefillResponseFrame, PrefillResult, ReserveRequest,
                                      ReserveResponse, TokenFrame)
from common.contract.protocol import TokenLogprob as WireLogprob
from common.contract.protocol import TransferResult, TransferStatus
from gateway.backend import BackendUnavailable, GenerationRequest, TokenDelta, TokenLogprob
from gateway.cluster import ClusterView
from gateway.handoff import (UPSTREAM_FAILURES, Handoff, UpstreamTimeouts, client_finish_reason,
                             prepend, unavailable)
from gateway.metrics import GatewayMetrics
from gateway.prompt_tokenizer import GatewayTokenizer
from gateway.router import NoWorkers
from gateway.tiers import TierConfig

log = logging.getLogger(__name__)

class WorkerBackend:
    def __init__(self, cluster: ClusterView, tokenizer: GatewayTokenizer, session: ClientSession,
                 tiers: TierConfig, metrics: GatewayMetrics, internal_token: str | None = None,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts()) -> None:
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.session = session
        self.tiers = tiers
        self.metrics = metrics
        self.internal_token = internal_token
        self.timeouts = timeouts
        self.num_aborts_sent = 0
        self._clients: dict[str, ControlClient] = {}
        self._decode_frames: FrameBatchDecoder[TokenFrame] = FrameBatchDecoder(
            DecodeResponseFrame)  # fresh() per stream
        self._background: set[asyncio.Task[None]] = set()
        self._active: dict[str, Handoff] = {}  # generations in progress, by request id

    async def aclose(self) -> None:
        """Let pending aborts finish (bounded), then cancel what is left."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.timeouts.abort_s)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        async with contextlib.aclosing(self.generate_batches(request)) as batches:
            async for batch in batches:
                for delta in batch:
                    yield delta

    def generate_batches(self, request: GenerationRequest
                         ) -> AsyncGenerator[list[TokenDelta], None]:
        """The deltas of every frame one socket read brought, as one non-empty list."""
        return self._generate(request)

    # ---------------------------------------------------------------- one generation

    async def _generate(self, request: GenerationRequest
                        ) -> AsyncGenerator[list[TokenDelta], None]:
        started = time.perf_counter()
        first_at: float | None = None
        num_tokens, outcome = 0, "aborted"
        handoff = Handoff(request.request_id)
        self._active[request.request_id] = handoff
        try:
            plan = self.cluster.plan(len(request.prompt_token_ids),
                                     block_hashes(request.prompt_token_ids, self.cluster.block_size),
                                     request.local_prefill)
            if isinstance(plan, NoWorkers):
                outcome = "unavailable"
                raise BackendUnavailable(plan.reason.capitalize() + ".", retry_after_s=1)
            if plan.prefill_worker_id is None:
                deltas = self._local_prefill(request, plan.decode_worker_id, handoff)
            else:
                deltas = self._disaggregated(request, plan.prefill_worker_id,
                                             plan.decode_worker_id, handoff)
            async with contextlib.aclosing(deltas):
                async for batch in deltas:
                    if first_at is None:
                        first_at = time.perf_counter()
                    for delta in batch:
                        num_tokens += delta.num_tokens
                    if batch[-1].finish_reason is not None:
                        outcome = "finished"
                    yield batch
        except BackendUnavailable:
            outcome = "failed" if outcome != "unavailable" else outcome
            raise
        finally:
            self._active.pop(request.request_id, None)
            if outcome != "finished":
                self._abort_legs(handoff)
            self.metrics.observe_completion(
                request.tier, outcome, None if first_at is None else first_at - started,
                0.0 if first_at is None else time.perf_counter() - first_at, num_tokens)

    def _local_prefill(self, request: GenerationRequest, decode_id: str,
                       handoff: Handoff) -> AsyncGenerator[list[TokenDelta], None]:
        message = DecodeRequest(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling,
            priority=self._priority(request), timeout_ms=self.timeouts.request_ms)
        # Returned, not wrapped: one generator level less per relayed batch.
        return self._relay(self._decode_stream(decode_id, handoff, message), handoff,
                           num_tokens_before=0, worker_id=decode_id)

    def _decode_stream(self, decode_id: str, handoff: Handoff,
                       message: DecodeRequest) -> AsyncGenerator[list[TokenFrame], None]:
        client = self._client(decode_id, handoff)
        return stream_frame_batches(self.session, client.base_url + "/internal/decode",
                                    message, self._decode_frames, self.timeouts.first_token_s,
                                    self.timeouts.frame_s, token=self.internal_token)

    async def _disaggregated(self, request: GenerationRequest, prefill_id: str, decode_id: str,
                             handoff: Handoff) -> AsyncGenerator[list[TokenDelta], None]:
        t = self.timeouts
        prompt = list(request.prompt_token_ids)
        decoder = self._client(decode_id, handoff)
        try:
            reserved: ReserveResponse = await decoder.call(
                "/internal/reserve", ReserveRequest(
                    request_id=request.request_id, prompt_token_ids=prompt,
                    timeout_ms=t.reservation_ms),
                ReserveResponse, t.reserve_s)
        except UPSTREAM_FAILURES as exc:
            raise unavailable(f"decode worker {decode_id} could not reserve KV blocks", exc)
        spec = request.sampling
        priority = self._priority(request)
        prefiller = self._client(prefill_id, handoff)
        prefill_frames = prefiller.stream(
            "/internal/prefill", PrefillRequest(
                request_id=request.request_id, prompt_token_ids=prompt, sampling=spec,
                priority=priority, timeout_ms=t.request_ms, destination=reserved.destination),
            PrefillResponseFrame, t.first_token_s, t.first_token_s)
        watcher: asyncio.Task[None] | None = None
        next_frame: asyncio.Task[list[TokenFrame]] | None = None
        decode_frames: AsyncGenerator[list[TokenFrame], None] | None = None
        try:
            try:
                first = await anext(prefill_frames)
            except (StopAsyncIteration, *UPSTREAM_FAILURES) as exc:
                raise unavailable(f"prefill worker {prefill_id} failed", exc)
            if not isinstance(first, PrefillResult):
                raise BackendUnavailable(f"prefill worker {prefill_id} sent {type(first).__name__} "
                                         "before the first token")
            finished = first.finish_reason is not None
            text = self.tokenizer.first_token_text(prompt, first.first_token_id,
                                                   request.sampling, finished)
            first_delta = TokenDelta(
                text=text, num_tokens=1,
                finish_reason=client_finish_reason(first.finish_reason) if finished else None,
                logprobs=self._logprobs([first.first_logprob]) if first.first_logprob else None)
            if finished:
                # Nothing to decode: free the reservation on D now rather than at its timeout.
                self._abort_legs(handoff)
                yield [first_delta]
                return
            decode_frames = self._decode_stream(decode_id, handoff, DecodeRequest(
                request_id=request.request_id, prompt_token_ids=prompt, sampling=spec,
                priority=priority, timeout_ms=t.request_ms,
                first_token_id=first.first_token_id, first_logprob=first.first_logprob,
                epoch=reserved.destination.epoch))
            # Sent now, while token 1 is written to the client: D's wait for the KV starts
            # at once instead of after the client write.
            next_frame = asyncio.create_task(anext(decode_frames))
            watcher = asyncio.create_task(self._watch_transfer(prefill_frames, handoff, decode_id))
            yield [first_delta]
            frame_task, next_frame = next_frame, None
            relay = self._relay(prepend(frame_task, decode_frames), handoff,
                                num_tokens_before=1, worker_id=decode_id)
            async with contextlib.aclosing(relay):
                async for batch in relay:
                    yield batch
        finally:
            for task in (next_frame, watcher):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if decode_frames is not None:
                await decode_frames.aclose()
            if watcher is None:  # else the watcher owned (and closed) the prefill stream
                await prefill_frames.aclose()

    async def _relay(self, batches: AsyncGenerator[list[TokenFrame], None], handoff: Handoff,
                     num_tokens_before: int, worker_id: str
                     ) -> AsyncGenerator[list[TokenDelta], None]:
        """D's frame batches as delta batches (never empty); closes `batches` when done.

        Checks the splice count against D's usage at the end.
        """
        num_tokens = num_tokens_before
        try:
            async with contextlib.aclosing(batches):
                async for frames in batches:
                    deltas: list[TokenDelta] = []
                    for frame in frames:
                        assert isinstance(frame, TokenFrame)  # ErrorFrames raise in the reader
                        reason = frame.finish_reason
                        if reason is None and frame.token_ids and not frame.logprobs:
                            # The common case, kept short: one more token, nothing else.
                            num_tokens += len(frame.token_ids)
                            deltas.append(TokenDelta(text=frame.text,
                                                     num_tokens=len(frame.token_ids)))
                            continue
                        if reason is FinishReason.ABORT:
                            if deltas:  # what came before the abort is still the client's
                                yield deltas
                            raise BackendUnavailable(
                                handoff.failure_text("the request was aborted"))
                        num_tokens += len(frame.token_ids)
                        finish = client_finish_reason(reason)
                        if finish is not None and frame.usage is not None \
                                and frame.usage.num_completion_tokens != num_tokens:
                            self.metrics.num_splice_mismatches += 1
                            log.error("%s: relayed %d tokens, decode worker %s counted %d",
                                      handoff.request_id, num_tokens, worker_id,
                                      frame.usage.num_completion_tokens)
                        if not frame.token_ids and finish is None:
                            continue
                        deltas.append(TokenDelta(
                            text=frame.text, num_tokens=len(frame.token_ids), finish_reason=finish,
                            logprobs=self._logprobs(frame.logprobs) if frame.logprobs else None))
                        if finish is not None:
                            # Frames after the finishing one (none from a correct worker)
                            # are dropped with the stream.
                            yield deltas
                            return
                    if deltas:
                        yield deltas
        except UPSTREAM_FAILURES as exc:
            raise unavailable(handoff.failure_text(f"decode worker {worker_id} failed"), exc)
        raise BackendUnavailable(f"decode worker {worker_id} ended the stream without finishing")

    async def _watch_transfer(self, prefill_frames: AsyncGenerator[Message, None],
                              handoff: Handoff, decode_id: str) -> None:
        """Reads P's TransferResult; a failed move aborts D so the client hears at once."""
        error: str | None = None
        try:
            async with contextlib.aclosing(prefill_frames):
                async for frame in prefill_frames:
                    if isinstance(frame, TransferResult):
                        if frame.status is TransferStatus.FAILED:
                            error = frame.error or "KV transfer failed"
                        return
                error = "prefill worker ended its stream before the KV transfer finished"
        except UPSTREAM_FAILURES as exc:
            error = f"KV transfer: {exc}"
        finally:
            if error is not None:
                handoff.transfer_error = error
                log.warning("%s: %s; aborting on %s", handoff.request_id, error, decode_id)
                self._abort_legs(handoff)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_background_tasks(self) -> int:
        return len(self._background)

    def check_invariants(self) -> None:
        clients = set(map(id, self._clients.values()))
        for rid, handoff in self._active.items():
            assert handoff.request_id == rid, f"{rid} tracked under another id"
            for worker_id, client in handoff.legs.items():
                assert id(client) in clients, f"{rid}: leg {worker_id} has a foreign client"
        for task in self._background:
            assert not task.done(), "a finished abort task is still listed"

    # ---------------------------------------------------------------- helpers

    def _client(self, worker_id: str, handoff: Handoff) -> ControlClient:
        info = self.cluster.workers.get(worker_id)
        if info is None:
            raise BackendUnavailable(f"worker {worker_id} left the cluster", retry_after_s=1)
        client = self._clients.get(info.control_url)
        if client is None:
            client = ControlClient(info.control_url, self.internal_token, self.session)
            self._clients[info.control_url] = client
        handoff.legs[worker_id] = client
        return client

    def _priority(self, request: GenerationRequest) -> int:
        # Tiers: smaller number = more important; the protocol: larger runs first.
        tier = self.tiers.tiers.get(request.tier)
        return -tier.priority if tier is not None else 0

    def _abort_legs(self, handoff: Handoff) -> None:
        legs, handoff.legs = handoff.legs, {}
        for worker_id, client in legs.items():
            task = asyncio.get_running_loop().create_task(
                self._send_abort(client, worker_id, handoff.request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_abort(self, client: ControlClient, worker_id: str, request_id: str) -> None:
        self.num_aborts_sent += 1
        try:
            await client.call("/internal/abort", AbortRequest(request_id=request_id,
                                                              reason="gateway"),
                              AbortResponse, self.timeouts.abort_s)
        except UPSTREAM_FAILURES as exc:
            # The worker's own deadlines free the request when it cannot hear us.
            log.warning("abort of %s on %s failed: %s", request_id, worker_id, exc)

    def _logprobs(self, wire: Sequence[WireLogprob | None]) -> tuple[TokenLogprob, ...]:
        text = self.tokenizer.token_text
        return tuple(TokenLogprob(token=text(lp.token_id), logprob=lp.logprob,
                                  top=tuple((text(t), v) for t, v in lp.top))
                     for lp in wire if lp is not None)

