"""The engine loop: one readable cycle, `schedule -> run -> sample -> postprocess`.

Lifecycle of a request inside one engine:

    add_request ----------> WAITING -> RUNNING (chunked prefill, then decode) -> finished
                    (with a prefill lane: WAITING -> RUNNING there, then handed over)
    add_request(PREFILL_ONLY)  ...  -> PREFILLED (first token out, blocks held)
                                        -> release_prefilled() once its KV has been sent
    reserve() -> [peer writes KV] -> add_decode_request() -> RUNNING (decode) -> finished
    abort_request() ends it in any state; blocks are freed exactly once (by the scheduler).
Every step returns one `RequestOutput` per request that produced a token or finished in it
(a pipelined step hands some out during the next: engine/output_processor.py); text streams
through the detokenizer, held back while it may start a stop string. Invariants
(engine/engine_invariants.py): a finished request produces one output with `finish_reason`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.block_pool import BlockPool
from engine.config import ModelConfig
from engine.device_upload import to_device
from engine.engine_config import EngineConfig
from engine.engine_invariants import check_engine
from engine.generation_result import GenerationResult, run_to_completion
from engine.grammar_rows import GrammarRows
from engine.inflight_step import InFlightStep
from engine.kv_cache import KVCacheManager, Reservation
from engine.kv_ready import KVReady, LayerEventRecorder, announce_kv_ready
from engine.kv_storage import KVStorage
from engine.model_runner import DeviceTokens, ModelRunner, StepRunner
from engine.output_processor import OutputProcessor, RequestOutput, Tracked
from engine.prefill_lane import land_outputs, prefill_lane
from engine.request import Request, RequestMode, RequestStatus, check_prompt_tokens
from engine.sampler import Sampler, SamplingState, TokenLogprobs
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from engine.step_shape import step_shape
from engine.step_timer import StepTimer
from protocol.sampling_params import SamplingParams
from text.tokenizer import Tokenizer


class LLMEngine:
    """One model, one KV pool, one scheduler; driven by `step()` from a single thread."""

    def __init__(self, runner: StepRunner, kv_storage: KVStorage, model_config: ModelConfig,
                 tokenizer: Tokenizer, config: EngineConfig,
                 sampler_seed: int | None = None, lane_runner: StepRunner | None = None) -> None:
        """`runner` executes each step's schedule and writes the KV into `kv_storage`;
        `for_model` builds both for one process (and `lane_runner`, the prefill lane's),
        engine/tensor_parallel_group.py for rank 0 of a group."""
        if kv_storage.layout.block_size != config.block_size:
            raise ValueError(f"KV storage block size {kv_storage.layout.block_size} != "
                             f"{config.block_size}")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.kv_storage = kv_storage
        self.kv_cache = KVCacheManager(BlockPool(config.num_kv_blocks, config.block_size),
                                       kv_storage.host_tier(config.kv_host_cache_bytes))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            prefill_chunk_tokens=config.prefill_chunk_tokens,
                            hold_tpot=config.hold_tpot),
            self.kv_cache)
        self.runner = runner
        self.sampler = Sampler(tokenizer.eos_token_ids, device=config.device, seed=sampler_seed)
        self.outputs = OutputProcessor(tokenizer, self.scheduler)
        self._tracked = self.outputs.tracked  # the requests this engine postprocesses
        self.grammar_rows = GrammarRows(tokenizer, model_config.vocab_size)
        self._ids = itertools.count()
        self.num_preemptions = self.num_steps = 0  # preemptions (recompute), steps since start
        self.last_schedule: ScheduleOutput | None = None  # what the last step computed
        self._inflight: InFlightStep | None = None  # an overlapped step's, tokens pending
        self.step_timer: StepTimer | None = None  # set: each step timed on the device (CUDA)
        # Prompts computed beside the decode steps (engine/prefill_lane.py); None: in them
        self.lane = None if lane_runner is None else prefill_lane(
            config, self.kv_cache, lane_runner, self.sampler)

    @classmethod
    def for_model(cls, model: torch.nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
                  config: EngineConfig, sampler_seed: int | None = None) -> "LLMEngine":
        """An engine running `model` in this process: its own KV pool and model runner."""
        kv_storage = KVStorage.for_model(model_config, config.num_kv_blocks, config.block_size,
                                         config.kv_cache_dtype, config.device)
        runner = ModelRunner(model, kv_storage, config.block_size,
                             cuda_graph_batch_sizes=config.decode_graph_sizes(),
                             mixed_graph_tokens=(config.max_num_batched_tokens
                                                 if config.mixed_cuda_graphs else 0))
        lane_runner = ModelRunner(model, kv_storage, config.block_size, cuda_graph_batch_sizes=(),
                                  mixed_graph_tokens=0) if config.prefill_lane_sms else None
        return cls(runner, kv_storage, model_config, tokenizer, config, sampler_seed,
                   lane_runner)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, priority: int = 0,
                    mode: RequestMode = RequestMode.PREFILL_AND_DECODE,
                    resumed_token_ids: Sequence[int] = (),
                    notify_kv_ready: bool = False, tpot_s: float | None = None) -> None:
        """Queue a request; outputs come from later `step()` calls. `tpot_s`: its TPOT target.
        With `notify_kv_ready` (PREFILL_ONLY requests only) the step that computes its final
        prompt chunk hands a KVReady to `step()`'s `on_kv_ready` (engine/kv_ready.py).
        With `resumed_token_ids` it continues after that output, produced elsewhere (a dead
        worker's): the tokens are replayed through the detokenizer and stop rules, so the
        text goes on where theirs ended, none emitted again; seeded sampling draws the next
        token as the first worker would have. ValueError: that output already ends it."""
        self._check_prompt(request_id, prompt_token_ids)
        if notify_kv_ready and mode is not RequestMode.PREFILL_ONLY:
            raise ValueError("notify_kv_ready is for PREFILL_ONLY requests")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority,
                          tpot_s=tpot_s, mode=mode)
        tracked = self._track(request, notify_kv_ready, resumed_token_ids)
        if not resumed_token_ids:
            lane = self.lane
            if lane is not None and mode is RequestMode.PREFILL_AND_DECODE:
                lane.add(request)
            else:
                self.scheduler.add_request(request)
            return
        try:
            self.outputs.replay(tracked, resumed_token_ids, self.model_config.vocab_size)
            self.scheduler.add_resumed_request(request, resumed_token_ids)
        except ValueError:
            self.outputs.untrack(request_id)
            raise

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int]) -> Reservation | None:
        """Decode side: hold blocks for a prompt whose KV a peer will write (None: not now;
        ValueError: never, it exceeds the pool). Prefix blocks cached here are reported in
        `num_cached_tokens` and need not be sent."""
        self._check_prompt(request_id, prompt_token_ids)
        needed = self.kv_cache.blocks_needed(len(prompt_token_ids) + 1)
        if needed > self.kv_cache.num_blocks:
            raise ValueError(f"the prompt needs {needed} KV blocks; this worker's pool has "
                             f"{self.kv_cache.num_blocks}")
        if not self.kv_cache.can_reserve(list(prompt_token_ids)):
            return None
        return self.kv_cache.reserve(request_id, list(prompt_token_ids))

    def release_reservation(self, request_id: str) -> None:  # one never joined (failed, aborted)
        if self.kv_cache.holds_blocks(request_id) and request_id not in self._tracked:
            self.kv_cache.release(request_id)

    def add_decode_request(self, request_id: str, prompt_token_ids: Sequence[int],
                           params: SamplingParams, first_token_id: int,
                           priority: int = 0, tpot_s: float | None = None) -> None:
        """Decode side: join a reserved request whose prompt KV has landed. The first token
        was sampled (and streamed) by the prefill side, so it is not emitted again."""
        request = Request(request_id, list(prompt_token_ids), params, priority=priority,
                          tpot_s=tpot_s, mode=RequestMode.DECODE_ONLY)
        tracked = self._track(request, replayed=(first_token_id,))
        self.scheduler.add_decode_request(request, first_token_id)
        self.outputs.join_first_token(tracked, first_token_id)

    def release_prefilled(self, request_id: str) -> None:  # its KV sent (or given up): free it
        self.outputs.untrack(request_id)
        self.scheduler.release_prefilled(request_id)

    def abort_request(self, request_id: str) -> bool:
        """End a request in any state and free its blocks; False if it was not known."""
        tracked = self.outputs.untrack(request_id)
        if self.scheduler.get_request(request_id) is not None:
            self.scheduler.abort_request(request_id)
        elif self.lane is not None and self.lane.holds(request_id):
            self.lane.abort(request_id)
        elif tracked is not None and tracked.request.status is RequestStatus.PREFILLED:
            self.scheduler.release_prefilled(request_id)
        return tracked is not None

    def has_unfinished(self) -> bool:
        """Work left for `step()`: requests to compute, or deferred outputs to make."""
        return (self.scheduler.num_waiting + self.scheduler.num_running > 0
                or self.outputs.num_deferred > 0 or self._inflight is not None
                or self.lane is not None and self.lane.has_work())

    @property
    def num_waiting(self) -> int:  # the lane's included, as num_running
        return self.scheduler.num_waiting + (self.lane.num_waiting if self.lane else 0)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running + (self.lane.num_running if self.lane else 0)

    def live_requests(self) -> Iterable[Request]:
        """Every live request: the scheduler's, then the prefill lane's."""
        yield from self.scheduler.live_requests()
        if self.lane is not None:
            yield from self.lane.live_requests()

    # ---- the loop ---------------------------------------------------------------------------

    def step(self, on_kv_ready: Callable[[KVReady], None] | None = None,
             on_outputs: Callable[[list[RequestOutput]], None] | None = None,
             overlap: bool = False) -> list[RequestOutput]:
        """One engine iteration. Returns the outputs of this step (possibly none).
        `on_kv_ready` gets the KVReady of every request that asked for one and whose final
        prompt chunk this step computes, before the step waits for the model (kv_ready.py).
        With `on_outputs` the step is pipelined (engine/output_processor.py): the text of
        this step's tokens that cannot end a request is made during the next step, while
        the device computes it, and handed to `on_outputs` before that step waits; the
        rest is returned. Use it where the device computes asynchronously (CUDA): on the
        CPU the model runs inside `execute`, so nothing would overlap.
        With `overlap` the step is overlapped (engine/inflight_step.py): it plans and
        queues the next step before this one's tokens reach the host, and returns the
        outputs of the step before (`on_outputs` is then not used). Needs a runner that
        `reads_device_tokens`. A plain step after overlapped ones first finishes the last.
        With a prefill lane its step lands first, where the device is done with it, its
        next is queued, and this step runs beside it (engine/prefill_lane.py)."""
        lane = self.lane
        if lane is None:
            return self._step(on_kv_ready, on_outputs, overlap)
        with lane.decode_scope():
            outputs = land_outputs(lane.land(wait=False), lane, self.scheduler, self.outputs)
            lane.launch(self._tracked, self.scheduler.free_seats)
            outputs += self._step(on_kv_ready, on_outputs, overlap)
            idle = not (self._inflight or self.scheduler.num_running + self.scheduler.num_waiting)
            if lane.flying and idle:  # nothing to do beside it: wait for it
                outputs += land_outputs(lane.land(True), lane, self.scheduler, self.outputs)
        return outputs

    def _step(self, on_kv_ready: Callable[[KVReady], None] | None,
              on_outputs: Callable[[list[RequestOutput]], None] | None,
              overlap: bool) -> list[RequestOutput]:
        """One iteration of the engine's own scheduler (`step` without the lane)."""
        if overlap and not self.grammar_rows.any_live(self._tracked.keys()):
            return self._step_overlapped(on_kv_ready)
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            return self._resolve(previous) + self._finished_outputs(set())
        schedule = self._schedule()
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        outputs: list[RequestOutput] = []
        if not schedule.is_empty:
            logits = self._launch(schedule, on_kv_ready, None)
            if self.outputs.num_deferred and on_outputs is not None:
                on_outputs(self.outputs.flush_deferred())  # while the device computes
            if logits.is_cuda:
                # Wait for the model without the GIL (an event wait releases it; the sampler's
                # copies may not), so the worker's loop runs: streams, HTTP, a KVReady's push.
                done = torch.cuda.Event()
                done.record()
                done.synchronize()
            rows = [c.request_id for c in schedule.chunks if c.sample]
            if rows:
                tracked = [self._tracked[rid] for rid in rows]
                params = [t.request.sampling_params for t in tracked]
                result = self.sampler.sample(logits, params, [t.sampling for t in tracked])
                if __debug__:
                    result.check_invariants(params, logits.shape[-1])
                sampled = dict(zip(rows, result.token_ids))
                logprobs = dict(zip(rows, result.logprobs))
            self.scheduler.update_from_output(schedule, sampled)
        outputs.extend(self.outputs.flush_deferred())  # none left unless nothing ran
        defer = on_outputs is not None
        for rid, token_id in sampled.items():
            out = self.outputs.process(rid, token_id, logprobs[rid], defer)
            if out is not None:
                outputs.append(out)
        return outputs + self._finished_outputs(sampled)

    def _step_overlapped(self, on_kv_ready: Callable[[KVReady], None] | None
                         ) -> list[RequestOutput]:
        if not self.runner.reads_device_tokens:
            raise ValueError("this engine's runner cannot run overlapped steps")
        previous, self._inflight = self._inflight, None
        outputs = self.outputs.flush_deferred()  # left by a pipelined step before this one
        schedule = self._schedule(may_wait=previous is None)
        if schedule.is_empty:
            outputs += self._resolve(previous) if previous is not None else []
            return outputs + self._finished_outputs(set())
        tracked_by_id = self._tracked  # the requests as scheduled
        scheduled = [(c.request_id, tracked_by_id.get(c.request_id))
                     for c in schedule.chunks if c.sample]
        num_running = self.scheduler.num_running
        logits = self._launch(schedule, on_kv_ready,
                              previous.device_tokens if previous is not None else None)
        outputs += self._resolve(previous) if previous is not None else []
        # Rows of requests that ended meanwhile (an EOS just resolved) are not sampled, nor
        # their chunks applied. Nothing joins RUNNING in between (admissions are schedule()'s):
        # with as many running as before, every row still runs (no look at each row).
        tracked = tuple(t for _, t in scheduled if t is not None)
        if num_running != self.scheduler.num_running or len(tracked) < len(scheduled):
            kept = [(row, t) for row, (rid, t) in enumerate(scheduled) if t is not None
                    and tracked_by_id.get(rid) is t and t.request.status is RequestStatus.RUNNING]
            tracked = tuple(t for _, t in kept)
            if tracked and len(kept) < len(scheduled):
                # The rows through pinned memory: a list index would wait for this step.
                logits = logits.index_select(0, to_device([row for row, _ in kept],
                                                          torch.long, logits.device))
        inflight = None
        if tracked:  # sampled before the PLACEHOLDERs are recorded: states hold real tokens
            inflight = InFlightStep(tracked, self.sampler.launch(
                logits, [t.request.sampling_params for t in tracked],
                [t.sampling for t in tracked]))
        self.scheduler.update_from_output(schedule, None)
        self._inflight = inflight
        if __debug__ and inflight is not None:
            inflight.check_invariants()
        return outputs + self._finished_outputs(t.request.request_id for t in tracked)

    def _schedule(self, may_wait: bool = True) -> ScheduleOutput:
        schedule = self.scheduler.schedule()
        if schedule.is_empty and may_wait and self.scheduler.kv_cache.wait_for_a_load():
            self.num_preemptions += len(schedule.preempted_request_ids)
            schedule = self.scheduler.schedule()  # nothing else to run: a reload's end
        self.last_schedule = schedule
        self.num_steps += 1
        self.num_preemptions += len(schedule.preempted_request_ids)
        return schedule

    def _launch(self, schedule: ScheduleOutput, on_kv_ready: Callable[[KVReady], None] | None,
                previous: DeviceTokens | None) -> torch.Tensor:
        """Queue the model for a non-empty schedule (on the CPU: run it); the KVReadys."""
        owed = self.outputs.owe_kv_ready  # usually empty: no look at each chunk
        ready = ([c for c in schedule.chunks if c.sample and c.request_id in owed]
                 if on_kv_ready is not None and owed else [])
        recorder = LayerEventRecorder() if ready and self.runner.records_layer_events else None
        if ready and recorder is None:
            self._announce_kv_ready(ready, None, on_kv_ready)
        timer = self.step_timer
        if timer is not None:
            timer.start(step_shape(schedule))
        logits = self.runner.execute(schedule, recorder, previous)
        if timer is not None:
            timer.stop()
        if ready and recorder is not None:
            self._announce_kv_ready(ready, tuple(recorder.events), on_kv_ready)
        return logits

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """An overlapped step's tokens on the host: in place of the PLACEHOLDERs, then
        through the stop rules and the detokenizer, as a plain step's (process_resolved)."""
        result = step.pending.result()
        if __debug__:
            result.check_invariants([t.request.sampling_params for t in step.tracked],
                                    self.model_config.vocab_size)
        return self.outputs.process_resolved(step.tracked, result.token_ids, result.logprobs)

    def _finished_outputs(self, held: Iterable[str]) -> list[RequestOutput]:
        """The last output of each request the scheduler ended since, unless its token's
        output carries the finish (`held`: sampled now, or in flight; read, lazily, only
        when some request ended)."""
        finished = self.scheduler.drain_finished()
        held_ids = set(held) if finished else set()
        outputs = []
        for request in finished:
            tracked_request = self._tracked.get(request.request_id)
            if tracked_request is None or request.request_id in held_ids:
                continue
            outputs.append(self.outputs.finish_output(tracked_request, []))
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[GenerationResult]:
        """Run prompts to completion together (continuous batching); results in input order."""
        return run_to_completion(self, prompts, params, [f"generate-{next(self._ids)}"
                                                         for _ in prompts])

    # ---- internals --------------------------------------------------------------------------

    def _announce_kv_ready(self, chunks: list[ScheduledChunk],
                           events: tuple[torch.cuda.Event, ...] | None,
                           on_kv_ready: Callable[[KVReady], None] | None) -> None:
        assert on_kv_ready is not None  # only called when chunks were collected for it
        for chunk in chunks:
            self.outputs.kv_ready_sent(chunk.request_id)  # once
        announce_kv_ready(chunks, lambda rid: self._tracked[rid].request.num_prompt_tokens,
                          events, on_kv_ready, self.config.block_size,
                          self.model_config.num_layers)

    def _check_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt_tokens(prompt_token_ids, self.model_config.vocab_size)

    def _track(self, request: Request, notify_kv_ready: bool = False,
               replayed: Sequence[int] = ()) -> Tracked:
        grammar = self.grammar_rows.matcher_for(request, replayed)  # may raise GrammarError
        sampling = SamplingState.create(request.sampling_params, request.prompt_token_ids,
                                        self.config.device, grammar)
        # The scheduler's list is the one record of output tokens; the sampler reads it.
        sampling.output_token_ids = request.output_token_ids
        return self.outputs.track(request, sampling, notify_kv_ready)

    def close(self) -> None:
        """Release tensor-parallel followers (they exit); nothing to do at TP 1. Idempotent."""
        self.runner.close()

    def check_invariants(self) -> None:
        check_engine(self.scheduler, self.outputs, self._inflight, self.lane)
