"""The prefill lane: prompts computed beside the decode steps, on SMs of their own.

A worker that both prefills and decodes on one GPU otherwise puts a prompt's chunks into its
decode steps (chunked prefill): such a step lasts as long as its chunk, and every decoding
request waits for it. With a lane (`EngineConfig.prefill_lane_sms`) the engine keeps two
schedulers over its one KV cache and its one copy of the weights:

    lane scheduler (here, `parks_prefilled`)   admission, chunked prefill, the first token;
        │  the request is parked after its first token (PREFILLED, table held)
        ▼  hand_over → adopt: the very same blocks, nothing copied
    the engine's scheduler                     decodes (and what the lane does not take:
                                               prompts prefilled for another worker's
                                               decode, resumed requests)

The lane admits a prompt only into a free seat of the decode batch (the engine's scheduler's
`free_seats`): a request parked with no seat would wait between its first and second token,
which its TPOT target counts, instead of before its first, which the tier's TTFT allows for.

On CUDA the lane's steps are queued on one green-context stream and the engine's steps on
another (engine/lane_streams.py), so the two run at once; or, shared, on two plain streams
over every SM, the engine's at the higher priority. The lane has at most one step in
flight; the engine lands it (`land`) at the start of each of its own steps once the device is
done with it, and waits for it only when it has nothing else to do. On the CPU a lane step
runs inside `launch`, so it lands at the next engine step: the same schedule, no overlap.

Ordering rules, because two streams write one KV pool:
  * a lane step is queued after everything the decode stream has queued: a block it writes
    may have been freed by a request whose last, dropped row is still being computed there;
  * blocks of lane requests are freed only while no lane step is in flight: the abort of a
    request in the flying step is deferred until it lands;
  * the lane preempts only its own requests, between its steps; the engine's scheduler never
    sees a lane request until it is handed over.

Invariants (`check_invariants`): a flying step's sampled rows are live lane requests or
deferred aborts; deferred aborts name only requests of the flying step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import ContextManager

import torch

from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.lane_streams import LaneStreams, lane_streams, shared_lane_streams
from engine.model_runner import StepRunner
from engine.output_processor import OutputProcessor, RequestOutput, Tracked
from engine.pending_sample import PendingSample
from engine.request import Request, RequestStatus
from engine.sampler import Sampler, TokenLogprobs
from engine.schedule_output import ScheduleOutput
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Flight:
    schedule: ScheduleOutput
    rows: list[Tracked]  # the tracked request of each sampled chunk, in chunk order
    pending: PendingSample | None
    done: torch.cuda.Event | None  # recorded after the step on the lane stream (CUDA)


@dataclass(slots=True)
class Landed:
    """What a lane step produced once on the host."""

    sampled: dict[str, int] = field(default_factory=dict)  # first tokens, by request id
    logprobs: dict[str, TokenLogprobs | None] = field(default_factory=dict)
    # Requests the lane scheduler parked (PREFILLED: to hand over) or ended (FINISHED_*).
    finished: list[Request] = field(default_factory=list)


class PrefillLane:
    def __init__(self, scheduler: Scheduler, runner: StepRunner, sampler: Sampler,
                 streams: LaneStreams | None) -> None:
        if not scheduler.config.parks_prefilled:
            raise ValueError("the prefill lane's scheduler must park prefilled requests")
        self.scheduler = scheduler
        self.runner = runner
        self.streams = streams
        self._sampler = sampler
        self._flight: _Flight | None = None
        self._deferred_aborts: set[str] = set()
        self.num_steps = 0

    # ---- queries ----------------------------------------------------------------------------

    @property
    def flying(self) -> bool:
        return self._flight is not None

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    def has_work(self) -> bool:
        return self._flight is not None or self.scheduler.num_waiting + \
            self.scheduler.num_running > 0

    def holds(self, request_id: str) -> bool:
        return self.scheduler.get_request(request_id) is not None

    def live_requests(self) -> Iterable[Request]:
        return self.scheduler.live_requests()

    def decode_scope(self) -> ContextManager[object]:
        """Where the engine queues its own steps: the decode partition's stream."""
        return torch.cuda.stream(self.streams.decode) if self.streams else nullcontext()

    # ---- commands ---------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        """End a lane request; one in the flying step ends when that step lands."""
        flight = self._flight
        if flight is not None and any(c.request_id == request_id
                                      for c in flight.schedule.chunks):
            self._deferred_aborts.add(request_id)
        else:
            self.scheduler.abort_request(request_id)

    def launch(self, tracked: Mapping[str, Tracked], seats: int) -> bool:
        """Queue the lane's next step, if none is in flight and it has prompts to compute and
        blocks for them. `tracked`: the engine's postprocessing state, by request id;
        `seats`: how many requests the decode batch can still take: the lane admits no more
        than that (a request it parked with no seat to decode in would wait between its first
        and second token, where its TPOT target is, instead of before its first)."""
        if self._flight is not None or not self.scheduler.num_waiting + \
                self.scheduler.num_running:
            return False
        streams = self.streams
        with torch.cuda.stream(streams.lane) if streams else nullcontext():
            if streams is not None:
                streams.lane.wait_stream(streams.decode)  # the first ordering rule
            schedule = self.scheduler.schedule(seats)
            if schedule.is_empty:
                return False
            logits = self.runner.execute(schedule, None, None)
            rows = [tracked[c.request_id] for c in schedule.chunks if c.sample]
            pending = self._sampler.launch(
                logits, [t.request.sampling_params for t in rows],
                [t.sampling for t in rows]) if rows else None
            done = None
            if streams is not None:
                done = torch.cuda.Event()
                done.record(streams.lane)
        self._flight = _Flight(schedule, rows, pending, done)
        self.num_steps += 1
        return True

    def land(self, wait: bool) -> Landed | None:
        """The flying step's tokens applied to the lane scheduler (deferred aborts then
        done), once the device has finished it; with `wait`, after waiting for it (without
        the GIL). None: nothing landed (nothing in flight nor ended, or not finished and
        not waited for)."""
        flight = self._flight
        if flight is None:  # only what the scheduler ended unscheduled (prompts too long)
            finished = self.scheduler.drain_finished()
            return Landed(finished=finished) if finished else None
        if flight.done is not None and not wait and not flight.done.query():
            return None
        if flight.done is not None:
            flight.done.synchronize()
        self._flight = None
        landed = Landed()
        if flight.pending is not None:
            result = flight.pending.result()
            for tracked, token_id, logprobs in zip(flight.rows, result.token_ids,
                                                   result.logprobs):
                landed.sampled[tracked.request.request_id] = token_id
                landed.logprobs[tracked.request.request_id] = logprobs
        self.scheduler.update_from_output(flight.schedule, landed.sampled)
        for request_id in self._deferred_aborts:
            self.scheduler.abort_request(request_id)
        self._deferred_aborts.clear()
        landed.finished = self.scheduler.drain_finished()
        return landed

    # ---- invariants -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        flight = self._flight
        if flight is None:
            assert not self._deferred_aborts, "an abort deferred with no step in flight"
            return
        flying = {c.request_id for c in flight.schedule.chunks}
        assert self._deferred_aborts <= flying, "a deferred abort of a request not in flight"
        for tracked in flight.rows:
            rid = tracked.request.request_id
            assert self.holds(rid) or rid in self._deferred_aborts, \
                f"{rid} is in the flying lane step but not a lane request"


def prefill_lane(config: EngineConfig, kv_cache: KVCacheManager, runner: StepRunner,
                 sampler: Sampler) -> PrefillLane | None:
    """The lane of an engine whose `config.prefill_lane_sms` asks for one: its own scheduler
    over the engine's KV cache, `runner` (over the engine's model and KV storage), and on CUDA
    its two green-context streams (or, `config.prefill_lane_shared`, two plain streams of two
    priorities). None on a CUDA device without green contexts (logged): prompts are then
    computed in the decode steps."""
    streams = None
    if str(config.device).startswith("cuda"):
        device = torch.device(config.device)
        streams = shared_lane_streams(device) if config.prefill_lane_shared else \
            lane_streams(device, config.prefill_lane_sms)
        if streams is None:
            return None
    else:
        log.info("prefill lane: on the CPU its steps take turns with the decode steps")
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk_tokens=config.prefill_chunk_tokens, parks_prefilled=True), kv_cache)
    return PrefillLane(scheduler, runner, sampler, streams)


def land_outputs(landed: Landed | None, lane: PrefillLane, main: Scheduler,
                 outputs: OutputProcessor) -> list[RequestOutput]:
    """The engine's side of a landing: each parked request handed over to the engine's
    scheduler `main`, then the first tokens through the stop rules and the
    detokenizer, then the last output of each request the lane ended otherwise (a prompt
    that cannot fit the pool). Requests aborted meanwhile produce nothing."""
    if landed is None:
        return []
    for request in landed.finished:
        if request.status is RequestStatus.PREFILLED:
            main.adopt(lane.scheduler.hand_over(request.request_id))
    made = []
    tracked = outputs.tracked
    for request_id, token_id in landed.sampled.items():
        if request_id in tracked:
            output = outputs.process(request_id, token_id, landed.logprobs[request_id], False)
            if output is not None:
                made.append(output)
    for request in landed.finished:
        ended = tracked.get(request.request_id)
        if ended is not None and request.status.is_finished and \
                request.request_id not in landed.sampled:
            made.append(outputs.finish_output(ended, []))
    return made
