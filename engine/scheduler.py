"""Continuous batching: every step, decide which tokens of which requests the model computes.

Pure state machine (no tensors; no clock in a decision): `schedule()` turns the request set
and the free blocks into one `ScheduleOutput`; `update_from_output()` applies what the model
sampled. `clock` only stamps each request's wait for admission (`Request.queued_s`).
Called by one engine loop, in this order, every step:

    out = scheduler.schedule()              # never while a non-empty `out` is outstanding
    sampled = model_runner.execute(out)     # {request_id: token} for chunks with sample=True
    scheduler.update_from_output(out, sampled)   # exactly once per non-empty `out`
    ... engine checks EOS / stop strings -> scheduler.finish_request(id, FINISHED_STOPPED)
    for request in scheduler.drain_finished(): ...   # LENGTH / ERROR / PREFILLED

Overlapped steps: `update_from_output(out, None)` records PLACEHOLDER for each sampled token;
the next `schedule()` may come before `Request.resolve_placeholder`. A PLACEHOLDER is only a
request's last output token, alone in its decode chunk (the runner reads it on the device);
never hashed (blocks publish up to num_computed_tokens) nor recomputed (no admission then).
Stop rules: max_tokens (FINISHED_LENGTH) and pool-capacity limits are this module's; EOS,
stop ids and stop strings the engine's (`finish_request`). It counts each request's steps.

One step, under a budget of max_num_batched_tokens tokens and max_num_seqs chunks:
  1. seats: the max_num_seqs best-ranked RUNNING requests (more only after joins beyond it);
  2. seated decodes, one token each (max_num_batched_tokens >= max_num_seqs: a decode is
     never stalled by a long prompt);
  3. prefills, shortest remaining first within a tier, with aging: seated partial prefills
     and (while nothing was preempted this step) WAITING/PREEMPTED requests, merged in prefill
     order, each a chunk of min(tokens left, budget left, prefill_chunk_tokens), the budget
     being with `hold_tpot` what the decodes' tightest TPOT leaves (engine/step_budget.py).
     Admission (prefix-cache hits skip their compute) never preempts and stops at the first
     waiting request without a seat or blocks: nobody overtakes it.
  A seated request whose host-tier reload is in flight (`KVCacheManager.loading_ids`) sits
  out until the copy is done. When a running request needs a block and none is free, the
  worst-ranked running request (lowest rank, then newest; possibly itself) is preempted: its
  blocks are freed (published full blocks stay cached), it computes nothing more and
  re-enters the waiting queue, and a chunk already scheduled for it this step is withdrawn.
Two schedulers may share one KV cache (the prefill lane, engine/prefill_lane.py): one with
`parks_prefilled` parks each prompt after its first token; `hand_over` gives it, blocks held,
to the other, which `adopt`s it and decodes it.

Rank, prefill order, starvation: `engine/request_rank.py`; lifecycle: `engine/request.py`.
No deadlock: a prompt needing more blocks than the whole pool is rejected at `add_request`
(FINISHED_ERROR); a request that grows past the pool while decoding ends FINISHED_LENGTH.

Invariants (`check_invariants`, plus the KV cache manager's):
    each live request is in exactly one of waiting / running / prefilled, per its status
    running and prefilled requests hold a block table covering their computed tokens;
    waiting requests hold no blocks and have computed nothing
    a running request has at least one token without KV; PREFILLED holds exactly its prompt
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from engine.kv_cache import KVCacheManager
from engine.native import advance_chunks, schedule_decodes
from engine.ranked_requests import RankedRequests
from engine.request import PLACEHOLDER, Request, RequestMode, RequestStatus
from engine.request_rank import RequestOrder
from engine.schedule_output import ScheduledChunk, ScheduleDraft, ScheduleOutput
from engine.scheduler_config import SchedulerConfig
from engine.scheduler_invariants import check_scheduler
from engine.step_budget import budget_beside
from engine.waiting_queue import WAITING_STATES, WaitingQueue
from protocol.worker_load import StepModel


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._requests: dict[str, Request] = {}  # every live request
        self._order = RequestOrder(config.aging_steps, config.prefill_aging_tokens)
        self._waiting = WaitingQueue()
        self._running = RankedRequests()  # in rank order (engine/ranked_requests.py)
        self._prefilled: dict[str, Request] = {}
        self._finished: list[Request] = []
        self._outstanding: ScheduleOutput | None = None
        self._scheduled: dict[str, Request] = {}
        self._num_steps = 0
        self.step_model: StepModel | None = None  # the worker's, for hold_tpot (None: unfitted)
        self._parks = config.parks_prefilled
        self.clock: Callable[[], float] = time.monotonic  # stamps Request.queued_s only

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def free_seats(self) -> int:
        """Requests the batch could still take: max_num_seqs less the running and waiting."""
        return max(0, self.config.max_num_seqs - len(self._running) - len(self._waiting))

    @property
    def num_prefilled(self) -> int:  # PREFILL_ONLY done, blocks held until released
        return len(self._prefilled)

    @property
    def num_unfinished(self) -> int:  # live: waiting, running or prefilled (to be released)
        return len(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def live_requests(self) -> Iterable[Request]:  # waiting, running or prefilled
        return self._requests.values()

    # ---- adding and ending requests ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a fresh PREFILL_AND_DECODE or PREFILL_ONLY request. A prompt that needs
        more blocks than the whole pool ends at once as FINISHED_ERROR (`drain_finished`)."""
        if request.mode is RequestMode.DECODE_ONLY:
            raise ValueError(f"{request.request_id}: DECODE_ONLY requests join through "
                             "add_decode_request")
        self._check_fresh(request)
        self._queue(request, RequestStatus.FINISHED_ERROR)

    def add_resumed_request(self, request: Request, output_token_ids: Sequence[int]) -> None:
        """Queue a PREFILL_AND_DECODE request continuing after `output_token_ids` (produced
        elsewhere): like a preempted one, prompt + output are recomputed, then it samples."""
        self._check_fresh(request)
        if request.mode is not RequestMode.PREFILL_AND_DECODE or not 0 < len(
                output_token_ids) < request.sampling_params.max_tokens:
            raise ValueError(f"{request.request_id}: cannot resume a {request.mode.value} "
                             f"request after {len(output_token_ids)} output tokens")
        request.output_token_ids.extend(output_token_ids)
        request.status = RequestStatus.PREEMPTED
        self._queue(request, RequestStatus.FINISHED_LENGTH)  # too long: as at a context limit

    def add_decode_request(self, request: Request, first_token_id: int) -> None:
        """Join a DECODE_ONLY request whose reservation (`kv_cache.reserve`) the peer has
        filled: it becomes the request's table, `first_token_id` (the prefill side's) its
        first output token, decoded next; max_tokens == 1 ends it (FINISHED_LENGTH)."""
        if request.mode is not RequestMode.DECODE_ONLY:
            raise ValueError(f"{request.request_id}: add_decode_request needs DECODE_ONLY")
        self._check_fresh(request)
        if not self.kv_cache.holds_blocks(request.request_id):
            raise ValueError(f"{request.request_id} has no reservation")
        self.kv_cache.adopt_reservation(request)
        self._register(request)
        request.output_token_ids.append(first_token_id)
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self._running.add(request, self._order.rank_key(request))
        self.kv_cache.cache_full_blocks(request)
        self._after_sample(request)

    def abort_request(self, request_id: str) -> Request | None:  # any state; None: not live
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a live request for a reason the engine decided (EOS, stop string, abort).
        Returns the request, or None when it is no longer live (already finished, or
        released). Not reported again by `drain_finished`."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._end(request, status, report=False)
        return request

    def release_prefilled(self, request_id: str) -> Request:
        """Free a PREFILLED request's blocks (full ones stay cached) once its KV was sent."""
        request = self._prefilled[request_id]  # KeyError: not PREFILLED (or already released)
        self._remove(request)
        return request

    def hand_over(self, request_id: str) -> Request:
        """A PREFILLED request leaves, its blocks still allocated, for another's `adopt`."""
        request = self._prefilled.pop(request_id)  # KeyError: not PREFILLED here
        del self._requests[request_id]
        self._order.remove(request_id)
        return request

    def adopt(self, request: Request) -> None:
        """Decode a request handed over by a scheduler sharing this KV cache (`hand_over`)."""
        if request.request_id in self._requests or request.status is not \
                RequestStatus.PREFILLED or not self.kv_cache.holds_blocks(request.request_id):
            raise ValueError(f"{request.request_id} is not a handed-over prefilled request")
        self._register(request)
        request.status = RequestStatus.RUNNING
        self._running.add(request, self._order.rank_key(request))

    def drain_finished(self) -> list[Request]:
        """Requests the scheduler itself ended or parked since the last call, in order:
        FINISHED_LENGTH, FINISHED_ERROR, and PREFILLED (still holding blocks)."""
        finished, self._finished = self._finished, []
        return finished

    # ---- one step ------------------------------------------------------------------------

    def schedule(self, seats: int | None = None) -> ScheduleOutput:
        """The next step. `seats`: admit only while fewer run (at most max_num_seqs, the
        default); the prefill lane passes the decode batch's `free_seats`."""
        if self._outstanding is not None:
            raise RuntimeError("schedule() called before update_from_output() of the last step")
        self._num_steps += 1
        self.kv_cache.flush_offloads()  # host copies of the blocks released since the last step
        limit = self.config.max_num_seqs
        step = ScheduleDraft(self.config.max_num_batched_tokens,
                             limit if seats is None else max(0, min(limit, seats)),
                             self.config.prefill_chunk_tokens)
        seated = self._running.best(self.config.max_num_seqs)
        loading = self.kv_cache.poll_loads()  # empty unless a host-tier reload is in flight
        # Decodes first, in rank order (compiled: engine/native), then prefills (either may
        # preempt worse-ranked ones). A seated RUNNING request not reloading with one token
        # left gets its decode chunk while the budget lasts (nearly every request, every
        # step: its slot is in its table already); one needing a new block goes through
        # _schedule_running; one with more tokens left comes back, in order, for rule 3.
        prefills = schedule_decodes(seated, loading, step, self.kv_cache.block_size,
                                    RequestStatus.RUNNING, ScheduledChunk, tuple.__new__,
                                    lambda request: self._schedule_running(request, step))
        chunks = step.chunks
        if self.config.hold_tpot and self.step_model is not None and (prefills or self._waiting):
            # (Only steps with prompts to compute ask: decode-only steps pay nothing for it.)
            step.budget = budget_beside(self.step_model, seated, chunks, step.budget)
        self._prefill(prefills, step)
        out = step.output()
        if out.is_empty:
            self._num_steps -= 1  # no step ran: age counts steps (a retried one counts once)
        else:
            self._outstanding = out
            self._scheduled = {rid: self._requests[rid] for rid in step.chunks}
        return out

    def update_from_output(self, schedule: ScheduleOutput,
                           sampled_token_ids: Mapping[str, int] | None) -> None:
        """Apply a step: advance every chunk's request, record tokens of sample=True chunks,
        publish newly full blocks, apply max_tokens / PREFILL_ONLY completion. Chunks of
        requests aborted or finished since `schedule()` are skipped. None: the tokens are
        still on the device; PLACEHOLDER stands in for each (see the module doc)."""
        if schedule.is_empty:
            return
        if schedule is not self._outstanding:
            raise RuntimeError("update_from_output() got a schedule that is not outstanding")
        # Compiled (engine/native): the live chunks (their request, as scheduled, still
        # RUNNING and still this scheduler's) are checked first, so a bad call leaves the
        # step outstanding and unchanged; then each advances past its chunk, counts a step,
        # publishes the blocks it filled (cache_full_blocks is idempotent: a chunk that
        # completes no block has none to publish), and a sampling chunk records its token
        # and, where it ends a phase (PREFILL_ONLY, parked, max_tokens), _after_sample runs.
        missing = advance_chunks(
            schedule.chunks, self._scheduled, self._requests, RequestStatus.RUNNING,
            sampled_token_ids, PLACEHOLDER, self.kv_cache.block_size,
            self.kv_cache.cache_full_blocks, self._after_sample, RequestMode.PREFILL_ONLY,
            self._parks)
        if missing:
            raise ValueError(f"no sampled token for {missing}")
        self._scheduled, self._outstanding = {}, None

    # ---- internals ---------------------------------------------------------------------------

    def _schedule_running(self, request: Request, step: ScheduleDraft) -> None:
        start, kv_cache = request.num_computed_tokens, self.kv_cache
        num_new = step.chunk_len(request.num_tokens - start)
        if kv_cache.blocks_needed(start + num_new) > kv_cache.num_blocks:
            self._end_unfittable(request)
            return
        while not kv_cache.allocate_for(request, num_new):
            self._preempt(victim := self._running.worst(), step)
            if victim is request:
                return
        step.add_chunk(request, num_new)

    def _prefill(self, partial: list[Request], step: ScheduleDraft) -> None:
        """Rule 3: the seated partial prefills and the waiting queue, merged in prefill order."""
        queued = sorted([(self._order.prefill_key(r), r) for r in partial],
                        key=lambda e: e[0], reverse=True)  # the first last
        admitting = not step.preempted
        while step.budget > 0:
            head = self._waiting.head_entry() if admitting else None
            if queued and (head is None or queued[-1][0] < head[0]):
                request = queued.pop()[1]
                if request.status is RequestStatus.RUNNING:  # else preempted this step
                    self._schedule_running(request, step)
                    admitting = admitting and not step.preempted
            elif head is not None:
                admitting = self._try_admit(head[1], step)
            else:
                return

    def _try_admit(self, request: Request, step: ScheduleDraft) -> bool:
        """Admit the waiting head; False when it finds no seat or blocks (nobody overtakes it)."""
        if max(len(self._running), len(step.chunks)) >= step.seats:
            return False
        if self.kv_cache.blocks_needed(request.num_tokens) > self.kv_cache.num_blocks:
            self._end_unfittable(request)
            return True
        prefix = self.kv_cache.find_cached_prefix(request.all_token_ids)
        num_new = step.chunk_len(request.num_tokens - prefix.num_cached_tokens)
        if not self.kv_cache.allocate_for(request, num_new, prefix):
            return False
        self._waiting.pop()
        if request.queued_s is None:  # its first admission (not a preempted one's return)
            request.queued_s = self.clock() - request.arrival_time
        request.num_computed_tokens = request.num_cached_tokens = prefix.num_cached_tokens
        request.status = RequestStatus.RUNNING
        self._running.add(request, self._order.rank_key(request))
        if request.request_id not in self.kv_cache.loading_ids:  # else seated, reloading
            step.add_chunk(request, num_new)
        return True

    def _preempt(self, victim: Request, step: ScheduleDraft) -> None:
        step.preempt(victim.request_id)
        self._running.remove(victim)
        self.kv_cache.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self._waiting.push(self._order.prefill_key(victim), victim)

    def _after_sample(self, request: Request) -> None:
        if request.mode is RequestMode.PREFILL_ONLY or self._parks and \
                request.num_output_tokens < request.sampling_params.max_tokens:
            self._running.remove(request)
            request.status = RequestStatus.PREFILLED
            self._prefilled[request.request_id] = request
            self._finished.append(request)
        elif request.num_output_tokens >= request.sampling_params.max_tokens:
            self._end(request, RequestStatus.FINISHED_LENGTH, report=True)

    def _end_unfittable(self, request: Request) -> None:  # streamed output: a length cut
        self._end(request, RequestStatus.FINISHED_LENGTH if request.output_token_ids
                  else RequestStatus.FINISHED_ERROR, report=True)

    def _end(self, request: Request, status: RequestStatus, report: bool) -> None:
        self._remove(request)
        request.status = status
        if report:
            self._finished.append(request)

    def _remove(self, request: Request) -> None:
        """Forget a live request, freeing its blocks (if it holds any) exactly once."""
        request_id = request.request_id
        del self._requests[request_id]
        self._order.remove(request_id)
        if request.status in WAITING_STATES:
            self._waiting.forget(request)  # its status is set next
            return
        if request.status is RequestStatus.RUNNING:  # RUNNING or PREFILLED: they hold blocks
            self._running.remove(request)
        else:
            del self._prefilled[request_id]
        self.kv_cache.free(request)

    def _check_fresh(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id} is already live")
        if request.status is not RequestStatus.WAITING or request.output_token_ids \
                or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"{request.request_id} is not a fresh request")

    def _register(self, request: Request) -> None:
        self._order.add(request, self._num_steps)
        self._requests[request.request_id] = request

    def _queue(self, request: Request, status_if_unfittable: RequestStatus) -> None:
        """Register and queue a fresh WAITING or PREEMPTED request; end one the pool cannot fit."""
        if self.kv_cache.blocks_needed(request.num_tokens) > self.kv_cache.num_blocks:
            request.status = status_if_unfittable
            self._finished.append(request)
            return
        self._register(request)
        self._waiting.push(self._order.prefill_key(request), request)

    # ---- invariants ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        check_scheduler(self.kv_cache, self._waiting, self._running, self._prefilled,
                        self._requests, self._order)
