"""From each sampled token to its request's output: streamed text, stop rules, the finish.

    sampled token --> detokenizer.add --> check_stop --> RequestOutput (text may be held back)
                                              \\--> finished: the scheduler is told, held
                                                   text released, the request untracked

A pipelined step (`LLMEngine.step` with `on_outputs`, on a device that computes while the
host goes on) splits this in two. Right after sampling, only what decides whether the request
goes on runs: the token rules of `check_stop` (EOS, stop tokens, min/max tokens), exact
without the text when the request has no stop strings. The rest (detokenizer, text, the
output record) is deferred and done during the next step, after that step was handed to the
device and before the engine waits for it (`flush_deferred`): the host's share of the
postprocessing hides behind the device's compute. Processed at once, never deferred: a
request with stop strings (its stop decision needs the text), one that is not RUNNING after
the step (PREFILLED: its output starts a KV handoff; finished by the scheduler), and one
whose token rules end it.

Lifecycle of a tracked request: `track` (added) -> `process` per sampled token (at once, or
`defer` then `flush_deferred`) -> `finish_output` once (it leaves `tracked`) or `untrack`
(aborted, released).

Invariants: at most one deferred token per request, and it is flushed before the request's
next token is processed, so a request's outputs leave in token order; a deferred token whose
request was untracked since (aborted) is dropped at the flush; a finished request produces
exactly one output with `finish_reason` set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.native import resolve_rows
from engine.request import PLACEHOLDER, Request, RequestStatus
from engine.sampler import SamplingState, TokenLogprobs
from engine.scheduler import Scheduler
from protocol.finish_reason import FinishReason
from text.byte_detokenizer import ByteDetokenizer
from text.detokenizer import Detokenizer, new_detokenizer
from text.stop_checker import check_stop
from text.tokenizer import Tokenizer


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
    queued_s: float | None = None  # on a `prefilled` output: Request.queued_s; else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Tracked:
    """Postprocessing state of one request: sampler memory, detokenizer, emitted text."""

    request: Request
    sampling: SamplingState
    detokenizer: Detokenizer
    # The token ids that end this request once min_tokens is reached: its stop_token_ids,
    # and the EOS ids unless it ignores them (check_stop's token rules, as one set).
    stop_token_ids: frozenset[int] = frozenset()
    # The output's text, text[:num_emitted_chars] of it streamed already. Only a stop
    # string's search reads streamed text, so a request without stop strings drops it
    # once emitted (`_emit`): its text is what is held back, not a copy of the whole
    # output made again at every token.
    text: str = ""
    num_emitted_chars: int = 0
    stop: FinishReason | None = None


@dataclass(frozen=True, slots=True)
class _Deferred:
    tracked: Tracked
    token_id: int
    logprobs: TokenLogprobs | None


class OutputProcessor:
    """Owns the tracked requests' postprocessing state; engine thread only."""

    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler) -> None:
        self._tokenizer = tokenizer
        tokenizer.token_bytes()  # built now, not at the first request
        self._eos_token_ids = tokenizer.eos_token_ids
        self._scheduler = scheduler
        self.tracked: dict[str, Tracked] = {}
        self.owe_kv_ready: set[str] = set()  # tracked ids owed a KVReady (kv_ready.py)
        self._deferred: list[_Deferred] = []

    @property
    def num_deferred(self) -> int:
        return len(self._deferred)

    def track(self, request: Request, sampling: SamplingState,
              notify_kv_ready: bool = False) -> Tracked:
        """`notify_kv_ready`: a KVReady is owed at its final prompt chunk (kv_ready.py);
        its id is in `owe_kv_ready` until `kv_ready_sent` or until it leaves."""
        params = request.sampling_params
        stop_token_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_token_ids |= frozenset(self._eos_token_ids)
        tracked = Tracked(request, sampling,
                          new_detokenizer(self._tokenizer, request.prompt_token_ids),
                          stop_token_ids)
        self.tracked[request.request_id] = tracked
        if notify_kv_ready:
            self.owe_kv_ready.add(request.request_id)
        return tracked

    def untrack(self, request_id: str) -> Tracked | None:
        self.owe_kv_ready.discard(request_id)
        return self.tracked.pop(request_id, None)

    def kv_ready_sent(self, request_id: str) -> None:
        self.owe_kv_ready.discard(request_id)  # once

    def replay(self, tracked: Tracked, token_ids: Sequence[int], vocab_size: int) -> None:
        """Feed output produced elsewhere through the detokenizer and the stop rules, so the
        text continues where it ended; ValueError if that output already ends the request."""
        params = tracked.request.sampling_params
        seen: list[int] = []
        check = None
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"resumed token id {token_id} is outside the vocabulary")
            seen.append(token_id)
            delta = tracked.detokenizer.add(token_id)
            tracked.text += delta
            check = check_stop(params, self._eos_token_ids, seen, tracked.text, len(delta))
            if check.finished:
                raise ValueError(f"request {tracked.request.request_id} already ended at "
                                 f"resumed token {len(seen)} ({check.finish_reason})")
        if check is not None:
            tracked.num_emitted_chars = check.emit_end

    def join_first_token(self, tracked: Tracked, first_token_id: int) -> None:
        """Decode side: the prefill side streamed the first token; continue its text without
        emitting it again (held bytes and held stop-string prefixes carry over)."""
        delta = tracked.detokenizer.add(first_token_id)
        tracked.text += delta
        check = check_stop(tracked.request.sampling_params, self._eos_token_ids,
                           tracked.request.output_token_ids, tracked.text, len(delta))
        tracked.num_emitted_chars = check.emit_end

    def process(self, request_id: str, token_id: int, logprobs: TokenLogprobs | None,
                defer: bool) -> RequestOutput | None:
        """The output of a token the scheduler has just recorded; None when deferred (then
        `flush_deferred` makes it, before this request's next token is processed)."""
        tracked = self.tracked[request_id]
        if defer and self._may_defer(tracked):
            self._deferred.append(_Deferred(tracked, token_id, logprobs))
            return None
        return self._postprocess(tracked, token_id, logprobs)

    def process_resolved(self, rows: Sequence[Tracked], token_ids: Sequence[int],
                         logprobs: Sequence[TokenLogprobs | None]) -> list[RequestOutput]:
        """The tokens of an overlapped step (engine/inflight_step.py): first each row's
        token replaces its request's PLACEHOLDER (AssertionError where none is pending),
        then, in row order, `process(..., defer=False)` of each; rows no longer tracked
        (aborted since) are skipped.

        One compiled call (engine/native): a step makes one output per running request, so
        this loop is the host's per-row cost at every step. The common row (RUNNING, no
        stop strings, neither a stop token nor max_tokens) gets its output there: for such
        a row `check_stop` says "go on, emit all the text", before min_tokens too (without
        a stop string nothing is held back); a byte-level detokenizer holding no bytes
        gives a whole-character token's text from its table (ByteDetokenizer.add's first
        branch). Every other row goes through `_postprocess`."""
        return resolve_rows(rows, token_ids, logprobs, self.tracked, RequestStatus.RUNNING,
                            RequestOutput, self._postprocess, ByteDetokenizer, PLACEHOLDER)

    def flush_deferred(self) -> list[RequestOutput]:
        """The outputs of the deferred tokens (none of them finishes its request)."""
        deferred, self._deferred = self._deferred, []
        outputs = []
        for item in deferred:
            tracked = item.tracked
            if self.tracked.get(tracked.request.request_id) is not tracked:
                continue  # aborted or released since: nobody reads it
            tracked.text += tracked.detokenizer.add(item.token_id)
            outputs.append(self._emit(tracked, [item.token_id], [item.logprobs],
                                      len(tracked.text)))
        return outputs

    def finish_output(self, tracked: Tracked, token_ids: list[int],
                      logprobs: list[TokenLogprobs | None] | None = None) -> RequestOutput:
        """The request's last output (called exactly once): held text released, untracked."""
        request = tracked.request
        if tracked.stop is None:
            # Not stopped by a stop rule: whatever was held back turned out to be plain text.
            tracked.text += tracked.detokenizer.flush()
        self.untrack(request.request_id)
        out = self._emit(tracked, token_ids, logprobs or [], len(tracked.text))
        out.finish_reason = (tracked.stop if tracked.stop is not None
                             else request.status.finish_reason)
        out.prefilled = False  # finished: nothing left to transfer
        return out

    def check_invariants(self) -> None:
        if stray := self.owe_kv_ready - self.tracked.keys():
            raise AssertionError(f"a KVReady owed to untracked requests {stray}")
        ids = [item.tracked.request.request_id for item in self._deferred]
        if len(ids) != len(set(ids)):
            raise AssertionError(f"more than one deferred token for a request: {ids}")
        for item in self._deferred:
            if item.tracked.stop is not None:
                raise AssertionError(f"{ids}: a stopped request's token was deferred")

    def _may_defer(self, tracked: Tracked) -> bool:
        request = tracked.request
        params = request.sampling_params
        if params.stop or request.status is not RequestStatus.RUNNING:
            return False
        # Without stop strings the decision does not depend on the text.
        return not check_stop(params, self._eos_token_ids, request.output_token_ids,
                              "", 0).finished

    def _postprocess(self, tracked: Tracked, token_id: int,
                     logprobs: TokenLogprobs | None) -> RequestOutput:
        request = tracked.request
        request_id = request.request_id
        delta = tracked.detokenizer.add(token_id)
        tracked.text += delta
        check = check_stop(request.sampling_params, self._eos_token_ids,
                           request.output_token_ids, tracked.text, len(delta))
        if check.finish_reason is not None:
            tracked.stop = check.finish_reason
            if isinstance(check.stop_reason, str):  # a stop string: the text ends at it
                tracked.text = tracked.text[:check.emit_end]
            else:  # a stop token or a length: bytes held for a character are output too
                tracked.text += tracked.detokenizer.flush()
            if request.status is RequestStatus.PREFILLED:
                self._scheduler.release_prefilled(request_id)
            elif not request.status.is_finished:  # RUNNING (or preempted since it sampled)
                status = (RequestStatus.FINISHED_STOPPED if check.finish_reason is FinishReason.STOP
                          else RequestStatus.FINISHED_LENGTH)
                self._scheduler.finish_request(request_id, status)
        elif request.status.is_finished:
            pass  # ended by the scheduler (length / pool limit): release held text below
        else:
            return self._emit(tracked, [token_id], [logprobs], check.emit_end)
        return self.finish_output(tracked, [token_id], [logprobs])

    def _emit(self, tracked: Tracked, token_ids: list[int], logprobs: list[TokenLogprobs | None],
              emit_end: int) -> RequestOutput:
        request = tracked.request
        emitted = tracked.num_emitted_chars
        text = tracked.text[emitted:emit_end]
        if emit_end > emitted:
            tracked.num_emitted_chars = emit_end
        if not request.sampling_params.stop:  # streamed text is never read again
            tracked.text = tracked.text[tracked.num_emitted_chars:]
            tracked.num_emitted_chars = 0
        prefilled = request.status is RequestStatus.PREFILLED
        return RequestOutput(
            request.request_id, token_ids, text, logprobs, None, len(request.prompt_token_ids),
            len(request.output_token_ids), request.num_cached_tokens, prefilled,
            request.num_steps, request.queued_s if prefilled else None)
