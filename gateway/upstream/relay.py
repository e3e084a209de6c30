"""The client's side of one generation's tokens, across every attempt that produced them.

Workers send token ids (with their text; per token when a frame carries several); the
client receives `TokenDelta`s, one per token where the worker said which text is whose.
The relay turns one into the other and keeps what a retry or a migration needs: the token
ids the client already has, in order.

    PrefillResult(t1)      ──▶ first_token() ──▶ delta t1            token_ids = [t1]
    TokenFrame(t2 t3)      ──▶ frames()      ──▶ deltas t2, t3       token_ids = [t1, t2, t3]
    (decode worker dies; another resumes after [t1, t2, t3])
    TokenFrame(t4, finish) ──▶ frames()      ──▶ delta t4 + finish   token_ids = [t1 .. t4]

Exactly once: a token reaches `token_ids` exactly when its delta is returned for the
client (or pushed to it: `offer`), and a resuming worker is told those ids, so it neither repeats nor skips one; at
the finish, the worker's usage (which counts the resumed tokens too) must equal
len(token_ids), else `num_splice_mismatches` grows (and the mismatch is logged).

Lifecycle: created with the generation → first_token()/frames() per batch, across
attempts → `finished` once a finish reason went out; nothing may be relayed after.
Invariant (`check_invariants`): num_tokens == len(token_ids); nothing after the finish.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

import msgspec

from gateway.api.backend import DeltaSink, TokenDelta, TokenLogprob
from gateway.api.metrics import GatewayMetrics
from gateway.api.prompt_tokenizer import GatewayTokenizer
from protocol.finish_reason import FinishReason
from protocol.messages import PrefillResult, TokenFrame
from protocol.messages import TokenLogprob as WireLogprob
from protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class StreamEnd(enum.Enum):
    """How a batch of frames left the stream."""

    OPEN = "open"  # more frames to come
    FINISHED = "finished"  # a finish reason went to the client
    ABORTED = "aborted"  # the worker ended the request without finishing it


def client_finish_reason(reason: FinishReason | None) -> FinishReason | None:
    """The reason a client sees: STOP or LENGTH; ABORT is reported as an error instead."""
    if reason is None or not reason.is_openai_reason:
        return None
    return reason


class TokenRelay:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingParams, tokenizer: GatewayTokenizer,
                 metrics: GatewayMetrics) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.token_ids: list[int] = []
        self.finished = False
        # The prefill worker's prefix-cache hits (its PrefillResult); None: the decode
        # worker prefilled, and its last frame's usage says.
        self._num_cached_tokens: int | None = None
        self._tokenizer = tokenizer
        self._metrics = metrics

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def first_token(self, result: PrefillResult) -> TokenDelta:
        """Token 1 from a prefill worker; its text made here exactly as the engine makes it
        (gateway/api/prompt_tokenizer.py)."""
        finish = client_finish_reason(result.finish_reason)
        text = self._tokenizer.first_token_text(self.prompt_token_ids, result.first_token_id,
                                                self.sampling, finish is not None)
        self.token_ids.append(result.first_token_id)
        self.finished = finish is not None
        self._num_cached_tokens = result.num_cached_tokens
        logprobs = self._logprobs([result.first_logprob]) if result.first_logprob else None
        return TokenDelta(text=text, num_tokens=1, finish_reason=finish, logprobs=logprobs,
                          num_cached_tokens=result.num_cached_tokens if finish else None)

    def frames(self, frames: Sequence[TokenFrame], worker_id: str
               ) -> tuple[list[TokenDelta], StreamEnd]:
        """The deltas of one batch of a decode worker's frames (possibly none)."""
        deltas: list[TokenDelta] = []
        token_ids = self.token_ids
        for frame in frames:
            reason = frame.finish_reason
            if reason is None and frame.token_ids and not frame.logprobs and frame.texts is None:
                # The common case, kept short: one more token, nothing else.
                token_ids.extend(frame.token_ids)
                deltas.append(TokenDelta(text=frame.text, num_tokens=len(frame.token_ids)))
                continue
            if reason is FinishReason.ABORT:
                return deltas, StreamEnd.ABORTED  # the tokens before it are the client's
            token_ids.extend(frame.token_ids)
            finish = client_finish_reason(reason)
            if finish is not None and frame.usage is not None \
                    and frame.usage.num_completion_tokens != len(token_ids):
                self._metrics.num_splice_mismatches += 1
                log.error("%s: relayed %d tokens, decode worker %s counted %d",
                          self.request_id, len(token_ids), worker_id,
                          frame.usage.num_completion_tokens)
            if not frame.token_ids and finish is None:
                continue
            logprobs = self._logprobs(frame.logprobs) if frame.logprobs else None
            texts = frame.texts
            if texts is not None and len(texts) == len(frame.token_ids) > 1 and \
                    (logprobs is None or len(logprobs) == len(texts)):
                # Tokens the worker merged into one frame: one delta (SSE event) each.
                last = len(texts) - 1
                deltas.extend(TokenDelta(
                    text=text, num_tokens=1, finish_reason=finish if i == last else None,
                    logprobs=None if logprobs is None else logprobs[i:i + 1])
                    for i, text in enumerate(texts))
            else:
                text = frame.text if texts is None else "".join(texts)
                deltas.append(TokenDelta(text=text, num_tokens=len(frame.token_ids),
                                         finish_reason=finish, logprobs=logprobs))
            if finish is not None:
                cached = self._num_cached_tokens if self._num_cached_tokens is not None \
                    else frame.usage.num_cached_tokens if frame.usage is not None else None
                deltas[-1] = msgspec.structs.replace(deltas[-1], num_cached_tokens=cached)
                # Frames after the finishing one (none from a correct worker) are dropped.
                self.finished = True
                return deltas, StreamEnd.FINISHED
        return deltas, StreamEnd.OPEN

    def offer(self, frame: TokenFrame, worker_id: str, sink: DeltaSink) -> bool:
        """A frame that ends nothing straight to the client, when the sink takes it now
        (the listener of a decode stream, gateway/api/stream_writer.py); False: it is pulled."""
        if frame.finish_reason is not None or frame.logprobs or not frame.token_ids \
                or not sink.accepts():
            return False
        deltas, _ = self.frames((frame,), worker_id)
        sink.push(deltas)
        self._metrics.num_direct_tokens += len(frame.token_ids)
        return True

    def _logprobs(self, wire: Sequence[WireLogprob | None]) -> tuple[TokenLogprob, ...]:
        text = self._tokenizer.token_text
        return tuple(TokenLogprob(token=text(lp.token_id), logprob=lp.logprob,
                                  top=tuple((text(t), v) for t, v in lp.top))
                     for lp in wire if lp is not None)

    def check_invariants(self) -> None:
        assert self.num_tokens == len(self.token_ids)
        assert self.num_tokens <= self.sampling.max_tokens, \
            f"{self.request_id}: {self.num_tokens} tokens relayed, max_tokens " \
            f"{self.sampling.max_tokens}"
