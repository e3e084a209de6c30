"""The real `CompletionBackend`: plans routes, runs the prefill → decode handoff, and keeps
the stream alive when workers fail (retries before token 1, migration after it).

Long prompt (a prefill worker P and a decode worker D):

    gateway                          D                               P
      │── ReserveRequest ───────────▶│ holds blocks (timeout_ms)
      │◀─ ReserveResponse(dest) ─────│
      │── PrefillRequest(dest) ──────────────────────────────────────▶│ prefill, sample t1
          (early prefill, where D has room: PrefillRequest(destination_follows) at once,
           beside the ReserveRequest, and dest forwarded in a DestinationNotice: handoff.py)
      │◀─ PrefillResult(t1) ──────────────────────────────────────────│
      │ yield t1 to the client at once (stream-first)
      │── DecodeRequest(t1, epoch) ─▶│ waits for the KV      ◀══ KV ══│ push
      │◀─ TransferResult ─────────────────────────────────────────────│ (watched by a task)
      │◀─ TokenFrame t2.. ───────────│ ... last frame: finish_reason + usage

Short prompt (tier threshold) or no prefill worker: one DecodeRequest without a first
token; D prefills it and its first frame carries t1. Exactly once at the splice: t1 comes
only from PrefillResult (gateway/upstream/relay.py), D never re-sends it.

When a worker fails (gateway/routing/retry_policy.py says how each failure is classified):

    before t1 ──▶ abort the attempt's legs, exclude the worker, plan again (another P, or a
                  local prefill on a decode worker) and start over
    after t1  ──▶ migrate: abort the attempt's legs, exclude the worker, and send
                  DecodeRequest(prompt, resume_token_ids = every token the client has) to a
                  decode worker, which recomputes them and streams what follows; the client
                  sees one stream with no token lost or repeated (greedy and seeded sampling
                  give the tokens an undisturbed run would)

An unreachable worker leaves routing at once (`ClusterView.mark_unreachable`), before its
lease lapses. After `RetryLimits.max_attempts` attempts the failure reaches the client
(503 before t1, an in-band SSE error event after); client messages name no host or port.

Lifecycle of one generation: planned → attempt running (its legs added as they are called)
→ finished (D's finish_reason), or failed → legs aborted → next attempt or give up; or the
client goes away (generator closed, task cancelled) → the current attempt's legs aborted.
From each plan to that attempt's first token (or the generation's end) the cluster view
counts the prompt in the prefilling worker's queue (`ClusterView.settle` ends it).
Aborts are sent from tasks this backend's `WorkerClients` owns (gateway/upstream/worker_clients.py),
so a cancelled handler cannot stop them half-way; `aclose()` cancels what is left. Worker
messages carry the request's traceparent.
Invariants (`check_invariants`): every generation in progress is in `_active` under its id,
its relay's invariants hold, its legs use this backend's clients; an attempt that did not
finish has sent an abort to every worker in its `legs` (emptied when they are sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator

from gateway.admission.capacity import TtftWindow
from gateway.api.backend import BackendUnavailable, GenerationRequest, TokenDelta
from gateway.api.metrics import GatewayMetrics
from gateway.api.prompt_tokenizer import GatewayTokenizer
from gateway.routing.retry_policy import (FailureKind, LegFailed, Phase, RetryLimits, client_code,
                                          client_message, decode_failure, leg_failed,
                                          marks_worker_dead, retry_after_s, should_retry)
from gateway.routing.router import NoWorkers
from gateway.upstream.cluster import ClusterView
from gateway.upstream.handoff import (Attempt, Generation, UpstreamTimeouts, first_prefill_frame,
                                      prepend, reserve_and_forward, should_prefill_early,
                                      watch_transfer)
from gateway.upstream.relay import StreamEnd, TokenRelay
from gateway.upstream.worker_clients import CALL_FAILURES, WorkerClients
from protocol.block_hashes import block_hashes
from protocol.messages import (DecodeRequest, DecodeResponseFrame, PrefillRequest,
                               PrefillResponseFrame, PrefillResult, ReserveRequest, ReserveResponse,
                               TokenFrame)
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient, FrameBatches, FrameStream
from rpc.frames import FrameDecoder

log = logging.getLogger(__name__)

WORKER_WAIT_POLL_S = 0.2


class WorkerBackend:
    def __init__(self, cluster: ClusterView, tokenizer: GatewayTokenizer, channels: ChannelPool,
                 metrics: GatewayMetrics,
                 timeouts: UpstreamTimeouts = UpstreamTimeouts(),
                 limits: RetryLimits = RetryLimits(),
                 ttft_window: TtftWindow | None = None) -> None:
        """`channels`: the workers' channels (one connection each, shared by every request)."""
        self.cluster, self.channels, self.tokenizer = cluster, channels, tokenizer
        self.metrics = metrics
        self.timeouts, self.limits = timeouts, limits
        self.ttft_window = ttft_window or TtftWindow()  # feeds the concurrency limit
        self.clients = WorkerClients(channels, timeouts.abort_s)
        self._decode_frames: FrameDecoder[TokenFrame] = FrameDecoder(DecodeResponseFrame)
        self._active: dict[str, Generation] = {}  # generations in progress, by request id

    async def aclose(self) -> None:
        """Let pending aborts finish (bounded), then cancel what is left."""
        await self.clients.aclose()

    def generate_batches(self, request: GenerationRequest
                         ) -> AsyncGenerator[list[TokenDelta], None]:
        """The deltas of every frame one socket read brought, as one non-empty list."""
        return self._generate(request)

    def context_limit(self) -> int | None:
        # A prompt must fit the reservation of one decode worker, prompt + 1 positions.
        return self.cluster.max_kv_tokens()

    # ---------------------------------------------------------------- one generation

    async def _generate(self, request: GenerationRequest
                        ) -> AsyncGenerator[list[TokenDelta], None]:
        started = time.perf_counter()
        first_at: float | None = None
        outcome = "aborted"
        relay = TokenRelay(request.request_id, request.prompt_token_ids, request.sampling,
                           self.tokenizer, self.metrics)
        generation = Generation(request, relay)
        share = request.shared_prefill
        self._active[request.request_id] = generation
        try:
            while True:
                attempt = await self._plan(generation)
                prefilled = False
                try:
                    async with contextlib.aclosing(self._run(generation, attempt)) as batches:
                        async for batch in batches:
                            if not prefilled:  # its prompt has left the prefill queue
                                prefilled = True
                                self.cluster.settle(request.request_id)
                                if share is not None and share.leads(request.request_id):
                                    share.prefilled(attempt.plan)
                            if first_at is None:
                                first_at = time.perf_counter()
                                self.ttft_window.observe(request.tier, first_at - started)
                            if relay.finished:
                                # Before the yield: the consumer may stop right after it.
                                outcome = "finished"
                            yield batch
                    if relay.finished:
                        outcome = "finished"
                        return
                    raise LegFailed(attempt.plan.decode_worker_id, Phase.DECODE,
                                    FailureKind.WORKER_ERROR, "stream ended without a finish")
                except LegFailed as failure:
                    self._abort_legs(attempt)
                    self._note_failure(generation, failure)
                    if not should_retry(failure.kind, len(generation.attempts), self.limits):
                        outcome = "failed"
                        raise BackendUnavailable(
                            client_message(len(generation.attempts), failure),
                            retry_after_s(failure.kind), client_code(failure)) from None
                    self.metrics.observe_retry(failure.phase.value, failure.kind.value,
                                               migration=relay.num_tokens > 0)
        except BackendUnavailable:
            outcome = "failed" if generation.attempts else "unavailable"
            raise
        finally:
            self._active.pop(request.request_id, None)
            self.cluster.settle(request.request_id)
            if share is not None and share.leads(request.request_id):
                share.prefilled(None)  # its followers plan on their own (no-op once set)
            if outcome != "finished" and generation.current is not None:
                self._abort_legs(generation.current)
            num_tokens = relay.num_tokens
            self.metrics.observe_completion(
                request.tier, outcome, None if first_at is None else first_at - started,
                0.0 if first_at is None else time.perf_counter() - first_at, num_tokens)

    async def _plan(self, generation: Generation) -> Attempt:
        """The next attempt: a fresh plan, or (tokens delivered) a decode worker to resume.
        With no worker to route to (one restarting, say), waits for one up to
        `timeouts.worker_wait_s`, then gives up with 503; at once when decode workers are
        up but the request already failed on each of them (only a new one could take it)."""
        request, relay = generation.request, generation.relay
        resuming = relay.num_tokens > 0
        share = request.shared_prefill
        if share is not None and not share.leads(request.request_id) and not generation.attempts:
            shared = await share.route()  # the leader's, once its prompt is in a prefix cache
            if shared is not None and self.cluster.can_route(shared):
                self.metrics.observe_plan(shared.kind, False, request.tier)
                return generation.new_attempt(shared)
        tokens = [*request.prompt_token_ids, *relay.token_ids] if resuming \
            else request.prompt_token_ids
        hashes = block_hashes(tokens, self.cluster.block_size)
        # A migrated stream plans for what is left of it.
        targets = request.targets if not resuming else dataclasses.replace(
            request.targets, max_tokens=max(1, request.sampling.max_tokens - len(relay.token_ids)))
        deadline = time.monotonic() + self.timeouts.worker_wait_s
        while True:
            plan = self.cluster.plan(len(tokens), hashes,
                                     True if resuming else request.local_prefill,
                                     exclude=generation.excluded, targets=targets,
                                     request_id=request.request_id)
            if not isinstance(plan, NoWorkers):
                self.metrics.observe_plan(plan.kind, plan.predicted is not None, request.tier)
                return generation.new_attempt(plan)
            if time.monotonic() >= deadline:
                break
            if generation.excluded and self.cluster.num_decode_workers() > 0:
                # Decode workers are up, but this request failed on each of them in its
                # current epoch (one that aborted the stream, say): only a new worker could
                # take it, so it fails now instead of leaving its client silent.
                break
            await asyncio.sleep(WORKER_WAIT_POLL_S)
        if generation.last_failure is not None:  # every worker failed it once already
            failure = generation.last_failure
            raise BackendUnavailable(client_message(len(generation.attempts), failure), 1,
                                     client_code(failure))
        raise BackendUnavailable(plan.reason.capitalize() + ".", 1, "no_worker")

    def _note_failure(self, generation: Generation, failure: LegFailed) -> None:
        log.warning("%s: attempt %d failed (%s); %d token(s) delivered",
                    generation.request.request_id, len(generation.attempts) - 1, failure,
                    generation.relay.num_tokens)
        generation.failed(failure)
        epoch = self.cluster.epoch_of(failure.worker_id)
        if epoch is not None:  # else gone from the registry already: not routable anyway
            generation.excluded[failure.worker_id] = epoch
        if marks_worker_dead(failure.kind) and self.cluster.mark_unreachable(failure.worker_id):
            self.metrics.num_workers_marked_dead += 1
            log.warning("worker %s is unreachable: out of routing until it registers again",
                        failure.worker_id)

    def _run(self, generation: Generation, attempt: Attempt
             ) -> AsyncGenerator[list[TokenDelta], None]:
        if attempt.plan.prefill_worker_id is None:
            return self._local_prefill(generation, attempt)
        return self._disaggregated(generation, attempt, attempt.plan.prefill_worker_id)

    def _local_prefill(self, generation: Generation, attempt: Attempt
                       ) -> AsyncGenerator[list[TokenDelta], None]:
        request, decode_id = generation.request, attempt.plan.decode_worker_id
        message = DecodeRequest(
            request_id=attempt.request_id, prompt_token_ids=list(request.prompt_token_ids),
            sampling=request.sampling, priority=request.priority,
            timeout_ms=self.timeouts.request_ms, tpot_ms=request.tpot_ms,
            resume_token_ids=list(generation.relay.token_ids), traceparent=generation.traceparent)
        # Returned, not wrapped: one generator level less per relayed batch.
        stream = self._decode_stream(decode_id, attempt, message)
        return self._relay(generation, stream, attempt, decode_id, stream)

    def _decode_stream(self, decode_id: str, attempt: Attempt,
                       message: DecodeRequest) -> FrameStream[TokenFrame]:
        client = self._client(decode_id, attempt, Phase.DECODE)
        return client.open_stream(message, self._decode_frames, self.timeouts.first_token_s,
                                  self.timeouts.frame_s)

    async def _disaggregated(self, generation: Generation, attempt: Attempt, prefill_id: str
                             ) -> AsyncGenerator[list[TokenDelta], None]:
        t, request, relay = self.timeouts, generation.request, generation.relay
        decode_id, rid = attempt.plan.decode_worker_id, attempt.request_id
        prompt = list(request.prompt_token_ids)
        decoder, priority = self._client(decode_id, attempt, Phase.RESERVE), request.priority
        reserve = ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                 timeout_ms=t.reservation_ms, wait_ms=t.kv_wait_ms,
                                 priority=priority)
        early = should_prefill_early(len(prompt), self.cluster.block_size,
                                     self.cluster.load_of(decode_id))
        reserving: asyncio.Task[ReserveResponse] | None = None
        reserved: ReserveResponse | None = None
        if not early:
            reserved = await reserve_and_forward(decoder, decode_id, reserve, t.reserve_call_s)
        prefiller = self._client(prefill_id, attempt, Phase.PREFILL)
        prefill_frames = prefiller.stream(
            PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=request.sampling,
                priority=priority, timeout_ms=t.request_ms,
                destination=None if reserved is None else reserved.destination,
                destination_follows=early, traceparent=generation.traceparent),
            PrefillResponseFrame, t.first_token_s, t.first_token_s)
        if early:  # the prompt computes while D reserves
            reserving = asyncio.create_task(reserve_and_forward(
                decoder, decode_id, reserve, t.reserve_call_s, prefiller, prefill_id, t.reserve_s))
        watcher: asyncio.Task[None] | None = None
        next_frame: asyncio.Task[list[TokenFrame]] | None = None
        decode_frames: FrameStream[TokenFrame] | None = None
        try:
            first = await first_prefill_frame(prefill_frames, prefill_id, reserving)
            if not isinstance(first, PrefillResult):
                raise LegFailed(prefill_id, Phase.PREFILL, FailureKind.WORKER_ERROR,
                                f"sent {type(first).__name__} before the first token")
            # Token 1 is the client's from here (the relay counts it, and a retry resumes
            # after it): it goes out before any failure of D below is raised.
            first_delta, delivered = relay.first_token(first), False
            generation.prefilled(prefill_id, first.queue_ms)
            if relay.finished:  # nothing to decode: free D's reservation now, not at its timeout
                self._abort_legs(attempt)
                yield [first_delta]
                return
            try:
                if reserving is not None:
                    if not reserving.done():  # token 1 goes out while D still reserves
                        yield [first_delta]
                        delivered = True
                    reserved = await reserving
                assert reserved is not None
                decode_frames = self._decode_stream(decode_id, attempt, DecodeRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=request.sampling,
                    priority=priority, timeout_ms=t.request_ms, tpot_ms=request.tpot_ms,
                    first_token_id=first.first_token_id,
                    epoch=reserved.destination.epoch, traceparent=generation.traceparent))
                # Sent now, while token 1 is written to the client: D's wait for the KV
                # starts at once instead of after the client write.
                next_frame = asyncio.create_task(anext(decode_frames))
            except LegFailed:
                if not delivered:
                    yield [first_delta]
                raise
            watcher = asyncio.create_task(watch_transfer(prefill_frames, attempt, prefill_id,
                                                         self._abort_legs))
            if not delivered:
                yield [first_delta]
            frame_task, next_frame = next_frame, None
            relayed = self._relay(generation, prepend(frame_task, decode_frames), attempt,
                                  decode_id, decode_frames)
            async with contextlib.aclosing(relayed):
                async for batch in relayed:
                    yield batch
        finally:
            for task in (next_frame, watcher, reserving):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if decode_frames is not None:
                await decode_frames.aclose()
            if watcher is None:  # else the watcher owned (and closed) the prefill stream
                await prefill_frames.aclose()

    async def _relay(self, generation: Generation, batches: FrameBatches[TokenFrame],
                     attempt: Attempt, worker_id: str, stream: FrameStream[TokenFrame]
                     ) -> AsyncGenerator[list[TokenDelta], None]:
        """D's frame batches as delta batches (never empty); closes `batches` when done.
        Where the request has a sink, `stream` (under `batches`) offers it each plain
        token as it is read (TokenRelay.offer); the rest comes through `batches`.

        A failure of D (or of the transfer into it, which the watcher saw first) raises
        LegFailed after the tokens before it were yielded."""
        relay, sink = generation.relay, generation.request.sink
        if sink is not None:
            offer = relay.offer
            stream.listen(lambda frame: offer(frame, worker_id, sink))
        try:
            async with contextlib.aclosing(batches):
                async for frames in batches:
                    deltas, end = relay.frames(frames, worker_id)
                    if deltas:
                        yield deltas
                    if end is StreamEnd.FINISHED:
                        return
                    if end is StreamEnd.ABORTED:
                        raise attempt.transfer_failure or LegFailed(
                            worker_id, Phase.DECODE, FailureKind.WORKER_ERROR,
                            "the worker ended the request without finishing it")
        except CALL_FAILURES as exc:
            raise decode_failure(leg_failed(worker_id, Phase.DECODE, exc), exc,
                                 attempt.transfer_failure, attempt.plan.prefill_worker_id
                                 ) from exc

    # ---------------------------------------------------------------- state

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_background_tasks(self) -> int:
        return self.clients.num_background_tasks

    def check_invariants(self) -> None:
        for rid, generation in self._active.items():
            assert generation.request.request_id == rid, f"{rid} tracked under another id"
            generation.relay.check_invariants()
            for attempt in generation.attempts:
                for worker_id, client in attempt.legs.items():
                    assert self.clients.owns(client), f"{rid}: leg {worker_id} has a foreign client"
            for attempt in generation.attempts[:-1]:
                assert not attempt.legs, f"{attempt.request_id} ended without its aborts"
        self.clients.check_invariants()

    # ---------------------------------------------------------------- helpers

    def _client(self, worker_id: str, attempt: Attempt, phase: Phase) -> ControlClient:
        info = self.cluster.workers.get(worker_id)
        if info is None:
            raise LegFailed(worker_id, phase, FailureKind.UNREACHABLE, "left the cluster")
        client = self.clients.get(info.control_url)
        attempt.legs[worker_id] = client
        return client

    def _abort_legs(self, attempt: Attempt) -> None:
        legs, attempt.legs = attempt.legs, {}
        self.clients.abort(legs, attempt.request_id)
