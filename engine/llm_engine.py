"""The engine loop: one readable cycle, `schedule -> run -> sample -> postprocess`.

Lifecycle of a request inside one engine:

    add_request ----------> WAITING -> RUNNING (chunked prefill, then decode) -> finished
    add_request(PREFILL_ONLY)  ...  -> PREFILLED (first token out, blocks held)
                                        -> release_prefilled() once its KV has been sent
    reserve() -> [peer writes KV] -> add_decode_request() -> RUNNING (decode) -> finished
    abort_request() ends it in any state; blocks are freed exactly once (by the scheduler).
Every step returns one `RequestOutput` per request that produced a token or finished in it.
Text streams through the incremental detokenizer, held back while it may start a stop string.
Invariants: ids tracked here = ids the scheduler knows (live or PREFILLED); a finished
request produces exactly one output with `finish_reason` set. Outputs count engine steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from common.contract.finish_reason import FinishReason
from common.contract.sampling_params import SamplingParams
from engine.block_pool import BlockPool
from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager, Reservation
from engine.kv_ready import KVReady, LayerEventRecorder
from engine.kv_storage import KVStorage
from engine.model_runner import ModelRunner, StepRunner
from engine.request import Request, RequestMode, RequestStatus
from engine.sampler import Sampler, SamplingState, TokenLogprobs
from engine.schedule_output import ScheduledChunk, ScheduleOutput
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from engine.stop_checker import check_stop
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprobs | None]
    finish_reason: FinishReason | None  # None: more to come
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    prefilled: bool = False  # PREFILL_ONLY request parked with its KV (see release_prefilled)
    num_steps: int = 0  # Request.num_steps

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _Tracked:
    """Postprocessing state of one request: sampler memory, detokenizer, emitted text."""

    request: Request
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    stop: FinishReason | None = None
    notify_kv_ready: bool = False  # a KVReady is owed at the final prompt chunk (kv_ready.py)


@dataclass(slots=True)
class GenerationResult:
    """A whole finished request, as `LLMEngine.generate` returns it."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None  # None until it finishes
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class LLMEngine:
    """One model, one KV pool, one scheduler; driven by `step()` from a single thread."""

    def __init__(self, runner: StepRunner, kv_storage: KVStorage, model_config: ModelConfig,
                 tokenizer: Tokenizer, config: EngineConfig,
                 sampler_seed: int | None = None) -> None:
        """`runner` executes each step's schedule and writes the KV into `kv_storage`;
        `for_model` builds both for one process, engine/tensor_parallel.py for rank 0 of
        a group (a shard's storage, a runner that drives the followers)."""
        if kv_storage.layout.block_size != config.block_size:
            raise ValueError(f"KV storage block size {kv_storage.layout.block_size} != "
                             f"{config.block_size}")
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.config = config
        self.kv_storage = kv_storage
        self.kv_cache = KVCacheManager(BlockPool(config.num_kv_blocks, config.block_size))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            prefill_chunk_tokens=config.prefill_chunk_tokens),
            self.kv_cache)
        self.runner = runner
        self.sampler = Sampler(tokenizer.eos_token_ids, device=config.device, seed=sampler_seed)
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.num_preemptions = self.num_steps = 0  # preemptions (recompute), steps since start
        self.last_schedule: ScheduleOutput | None = None  # what the last step computed

    @classmethod
    def for_model(cls, model: torch.nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
                  config: EngineConfig, sampler_seed: int | None = None) -> "LLMEngine":
        """An engine running `model` in this process: its own KV pool and model runner."""
        kv_storage = KVStorage.for_model(model_config, config.num_kv_blocks, config.block_size,
                                         config.dtype, config.device)
        runner = ModelRunner(model, kv_storage, config.block_size,
                             cuda_graph_batch_sizes=config.cuda_graph_batch_sizes)
        return cls(runner, kv_storage, model_config, tokenizer, config, sampler_seed)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, priority: int = 0,
                    mode: RequestMode = RequestMode.PREFILL_AND_DECODE,
                    resumed_token_ids: Sequence[int] = (),
                    notify_kv_ready: bool = False) -> None:
        """Queue a request; its outputs come from later `step()` calls.

        With `notify_kv_ready` (PREFILL_ONLY requests only) the step that computes its final
        prompt chunk hands a KVReady to `step()`'s `on_kv_ready` (engine/kv_ready.py).

        With `resumed_token_ids` it continues after that output, produced elsewhere (a
        worker that died mid-stream): the tokens are replayed through the detokenizer and
        the stop rules, so the text continues exactly where theirs ended and they are never
        emitted again; seeded sampling draws the next token as the first worker would have
        (engine/sampler.py). Raises ValueError when that output already ends the request."""
        self._check_prompt(request_id, prompt_token_ids)
        if notify_kv_ready and mode is not RequestMode.PREFILL_ONLY:
            raise ValueError("notify_kv_ready is for PREFILL_ONLY requests")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority, mode=mode)
        tracked = self._track(request)
        tracked.notify_kv_ready = notify_kv_ready
        if not resumed_token_ids:
            self.scheduler.add_request(request)
            return
        try:
            self._replay(tracked, resumed_token_ids)
            self.scheduler.add_resumed_request(request, resumed_token_ids)
        except ValueError:
            self._tracked.pop(request_id, None)
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

    def release_reservation(self, request_id: str) -> None:
        """Give back a reservation that will not be joined (transfer failed or aborted)."""
        if self.kv_cache.holds_blocks(request_id) and request_id not in self._tracked:
            self.kv_cache.release(request_id)

    def add_decode_request(self, request_id: str, prompt_token_ids: Sequence[int],
                           params: SamplingParams, first_token_id: int,
                           priority: int = 0) -> None:
        """Decode side: join a reserved request whose prompt KV has landed. The first token
        was sampled (and streamed) by the prefill side, so it is not emitted again."""
        request = Request(request_id, list(prompt_token_ids), params, priority=priority,
                          mode=RequestMode.DECODE_ONLY)
        tracked = self._track(request)
        self.scheduler.add_decode_request(request, first_token_id)
        # Replay the first token through the detokenizer and stop check, so that held bytes
        # and held stop-string prefixes continue exactly where the prefill side left them.
        delta = tracked.detokenizer.add(first_token_id)
        tracked.text += delta
        check = check_stop(params, self.tokenizer.eos_token_ids, request.output_token_ids,
                           tracked.text, len(delta))
        tracked.num_emitted_chars = check.emit_end

    def release_prefilled(self, request_id: str) -> None:
        """Prefill side: the KV of a PREFILLED request has been sent (or given up): free it."""
        self._tracked.pop(request_id, None)
        self.scheduler.release_prefilled(request_id)

    def abort_request(self, request_id: str) -> bool:
        """End a request in any state and free its blocks; False if it was not known."""
        tracked = self._tracked.pop(request_id, None)
        if self.scheduler.get_request(request_id) is not None:
            self.scheduler.abort_request(request_id)
        elif tracked is not None and tracked.request.status is RequestStatus.PREFILLED:
            self.scheduler.release_prefilled(request_id)
        return tracked is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_waiting + self.scheduler.num_running > 0

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    # ---- the loop ---------------------------------------------------------------------------

    def step(self, on_kv_ready: Callable[[KVReady], None] | None = None) -> list[RequestOutput]:
        """One engine iteration. Returns the outputs of this step (possibly none).

        `on_kv_ready` gets the KVReady of every request that asked for one and whose final
        prompt chunk this step computes, before the step waits for the model (kv_ready.py).
        """
        schedule = self.last_schedule = self.scheduler.schedule()
        self.num_steps += 1
        self.num_preemptions += len(schedule.preempted_request_ids)
        sampled: dict[str, int] = {}
        logprobs: dict[str, TokenLogprobs | None] = {}
        if not schedule.is_empty:
            ready = ([c for c in schedule.chunks if c.sample and c.request_id in self._tracked
                      and self._tracked[c.request_id].notify_kv_ready]
                     if on_kv_ready is not None else [])
            recorder = LayerEventRecorder() if ready and self.runner.records_layer_events \
                else None
            if ready and recorder is None:
                self._announce_kv_ready(ready, None, on_kv_ready)
            logits = self.runner.execute(schedule, recorder)
            if ready and recorder is not None:
                self._announce_kv_ready(ready, tuple(recorder.events), on_kv_ready)
            if logits.is_cuda:
                # Wait for the model without the GIL (an event wait releases it; the
                # sampler's copies to the host may not), so the worker's event loop runs
                # while the GPU computes: streams, HTTP, and a KVReady's push.
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
        outputs = [self._postprocess(rid, token_id, logprobs[rid])
                   for rid, token_id in sampled.items()]
        for request in self.scheduler.drain_finished():
            tracked = self._tracked.get(request.request_id)
            if tracked is None or request.request_id in sampled:
                continue  # its output this step already carries the finish
            outputs.append(self._finish_output(tracked, []))
        return outputs

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[GenerationResult]:
        """Run prompts to completion together (continuous batching); results in input order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        results = {rid: GenerationResult(rid, [], "") for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while any(r.finish_reason is None for r in results.values()):
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                result.logprobs.extend(out.logprobs)
                if out.finish_reason is not None:
                    result.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]

    # ---- internals --------------------------------------------------------------------------

    def _announce_kv_ready(self, chunks: list[ScheduledChunk],
                           events: tuple[torch.cuda.Event, ...] | None,
                           on_kv_ready: Callable[[KVReady], None] | None) -> None:
        assert on_kv_ready is not None  # only called when chunks were collected for it
        for chunk in chunks:
            tracked = self._tracked[chunk.request_id]
            tracked.notify_kv_ready = False  # once
            ready = KVReady(chunk.request_id, chunk.block_ids,
                            tracked.request.num_prompt_tokens, events)
            if __debug__:
                ready.check_invariants(self.config.block_size, self.model_config.num_layers)
            on_kv_ready(ready)

    def _check_prompt(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")

    def _track(self, request: Request) -> _Tracked:
        sampling = SamplingState.create(request.sampling_params, request.prompt_token_ids,
                                        self.config.device)
        # The scheduler's list is the one record of output tokens; the sampler reads it.
        sampling.output_token_ids = request.output_token_ids
        tracked = _Tracked(request, sampling,
                           IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids))
        self._tracked[request.request_id] = tracked
        return tracked

    def _replay(self, tracked: _Tracked, token_ids: Sequence[int]) -> None:
        params = tracked.request.sampling_params
        seen: list[int] = []
        check = None
        for token_id in token_ids:
            if not 0 <= token_id < self.model_config.vocab_size:
                raise ValueError(f"resumed token id {token_id} is outside the vocabulary")
            seen.append(token_id)
            delta = tracked.detokenizer.add(token_id)
            tracked.text += delta
            check = check_stop(params, self.tokenizer.eos_token_ids, seen, tracked.text,
                               len(delta))
            if check.finished:
                raise ValueError(f"request {tracked.request.request_id} already ended at "
                                 f"resumed token {len(seen)} ({check.finish_reason})")
        if check is not None:
            tracked.num_emitted_chars = check.emit_end

    def _postprocess(self, request_id: str, token_id: int,
                     logprobs: TokenLogprobs | None) -> RequestOutput:
        tracked = self._tracked[request_id]
        request = tracked.request
        delta = tracked.detokenizer.add(token_id)
        tracked.text += delta
        check = check_stop(request.sampling_params, self.tokenizer.eos_token_ids,
                           request.output_token_ids, tracked.text, len(delta))
        if check.finished:
            tracked.stop = check.finish_reason
            if check.stop_reason is not None and isinstance(check.stop_reason, str):
                tracked.text = tracked.text[:check.emit_end]
            if request.status is RequestStatus.RUNNING:
                status = (RequestStatus.FINISHED_STOPPED if check.finish_reason is FinishReason.STOP
                          else RequestStatus.FINISHED_LENGTH)
                self.scheduler.finish_request(request_id, status)
            elif request.status is RequestStatus.PREFILLED:
                self.scheduler.release_prefilled(request_id)
        elif request.status.is_finished:
            pass  # ended by the scheduler (length / pool limit): release held text below
        else:
            return self._emit(tracked, [token_id], [logprobs], check.emit_end)
        return self._finish_output(tracked, [token_id], [logprobs])

    def _emit(self, tracked: _Tracked, token_ids: list[int], logprobs: list[TokenLogprobs | None],
              emit_end: int) -> RequestOutput:
        request = tracked.request
        text = tracked.text[tracked.num_emitted_chars:emit_end]
        tracked.num_emitted_chars = max(tracked.num_emitted_chars, emit_end)
        return RequestOutput(
            request.request_id, token_ids, text, logprobs, None, request.num_prompt_tokens,
            request.num_output_tokens, request.num_cached_tokens,
            prefilled=request.status is RequestStatus.PREFILLED, num_steps=request.num_steps)

    def _finish_output(self, tracked: _Tracked, token_ids: list[int],
                       logprobs: list[TokenLogprobs | None] | None = None) -> RequestOutput:
        request = tracked.request
        if tracked.stop is None:
            # Not stopped by a stop rule: whatever was held back turned out to be plain text.
            tracked.text += tracked.detokenizer.flush()
        self._tracked.pop(request.request_id, None)
        out = self._emit(tracked, token_ids, logprobs or [], len(tracked.text))
        out.finish_reason = (tracked.stop if tracked.stop is not None
                             else request.status.finish_reason)
        out.prefilled = False  # finished: nothing left to transfer
        return out

    def close(self) -> None:
        """Release tensor-parallel followers (they exit); nothing to do at TP 1. Idempotent."""
        self.runner.close()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
        for tracked in self._tracked.values():
            tracked.sampling.check_invariants(tracked.request.sampling_params)
        for rid in self._tracked:
            if self.scheduler.get_request(rid) is None and \
                    self._tracked[rid].request.status is not RequestStatus.PREFILLED:
                raise AssertionError(f"{rid} tracked by the engine but unknown to the scheduler")
