"""Engine outputs -> protocol frames: token frames, logprobs, finish reasons, usage.

Pure functions shared by the prefill and decode workers.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.llm_engine import RequestOutput
from engine.sampler import TokenLogprobs
from protocol.finish_reason import FinishReason
from protocol.messages import ErrorCode, ErrorFrame, TokenFrame, TokenLogprob, Usage


def to_token_logprob(logprobs: TokenLogprobs | None) -> TokenLogprob | None:
    if logprobs is None:
        return None
    return TokenLogprob(logprobs.token_id, logprobs.logprob,
                        list(zip(logprobs.top_token_ids, logprobs.top_logprobs)))


def merge_outputs(request_id: str, outputs: Sequence[RequestOutput]
                  ) -> TokenFrame | ErrorFrame:
    """One frame for the outputs of one request that are ready now (in order).

    The last output decides the end: a finish carries usage; an engine error becomes an
    ErrorFrame (the tokens before it were already delivered or are dropped with it).
    Merged one-token outputs keep their texts apart (`texts`).
    """
    if len(outputs) == 1:  # the usual frame, one per token: one output, more to come
        out = outputs[0]
        if out.finish_reason is None and not any(out.logprobs):
            return TokenFrame(request_id=request_id, token_ids=list(out.new_token_ids),
                              text=out.new_text)
    token_ids: list[int] = []
    text: list[str] = []
    logprobs: list[TokenLogprob] = []
    wants_logprobs = False
    for out in outputs:
        token_ids.extend(out.new_token_ids)
        text.append(out.new_text)
        for lp in out.logprobs:
            converted = to_token_logprob(lp)
            if converted is not None:
                wants_logprobs = True
                logprobs.append(converted)
    last = outputs[-1]
    if last.finish_reason is FinishReason.ERROR:
        return ErrorFrame(request_id=request_id, code=ErrorCode.INTERNAL,
                          message="the engine could not run this request (prompt too long "
                                  "for the KV pool?)")
    usage = None
    if last.finish_reason is not None:
        usage = Usage(num_prompt_tokens=last.num_prompt_tokens,
                      num_completion_tokens=last.num_output_tokens,
                      num_cached_tokens=last.num_cached_tokens, num_steps=last.num_steps)
    # Several one-token outputs (a gateway that lagged): per-token texts, so the gateway
    # still sends one SSE event per token.
    per_token = len(outputs) > 1 and all(len(o.new_token_ids) == 1 for o in outputs)
    return TokenFrame(request_id=request_id, token_ids=token_ids,
                      text="" if per_token else "".join(text),
                      texts=text if per_token else None,
                      logprobs=logprobs if wants_logprobs else None,
                      finish_reason=last.finish_reason, usage=usage)


def error_frame(request_id: str, code: ErrorCode, message: str,
                retryable: bool = False) -> ErrorFrame:
    return ErrorFrame(request_id=request_id, code=code, message=message, retryable=retryable)


def frame_outcome(frame: TokenFrame | ErrorFrame) -> str | None:
    """How the request ended with this frame ("error" or the finish reason), or None when
    the stream goes on."""
    if isinstance(frame, ErrorFrame):
        return "error"
    return None if frame.finish_reason is None else frame.finish_reason.value
