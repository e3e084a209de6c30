"""When a request stops, and how much of its text may be streamed now. Pure functions.

Two checks run after every sampled token, in this order (the first that fires wins):

1. `check_stop` token rules, given the output ids so far (the new token last):
   nothing stops before `min_tokens` output tokens; then EOS (unless `ignore_eos`), then
   `stop_token_ids`, then stop strings, then `max_tokens` ("length").
2. Stop strings work on the detokenized output text. A stop string may arrive split over
   several tokens, so text that could still become the start of a stop string is held back:

       text       "Hello wor"        stop = ("world",)
                   ^^^^^^            text[:6] may be streamed now (emit_end == 6)
                         ^^^         held: "wor" is a prefix of "world"

   Once "world" completes, the request stops and the output is truncated to the text before it
   (or through it, with `include_stop_str_in_output`). When the request finishes for another
   reason the held text is released: it turned out not to be a stop string.

Contract: the caller streams `text[num_emitted:emit_end]` and, on a stop-string match,
truncates the request's output text to `emit_end`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopCheck:
    finish_reason: FinishReason | None  # STOP or LENGTH; None: keep generating
    stop_reason: str | int | None  # the matched stop string, or the stop/EOS token id
    emit_end: int  # text[:emit_end] is final; with a stop string, the output is cut here

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def find_stop_string(text: str, stop: Sequence[str], num_new_chars: int,
                     include_stop_str_in_output: bool) -> StopCheck:
    """Looks for stop strings in `text`, of which the last `num_new_chars` are new since the
    previous call (earlier text was already searched, so only a window is scanned).

    Returns a finished check with the match that completes first (then the one starting
    first), the one a token-by-token stream would meet first whatever the token boundaries;
    or an unfinished check whose `emit_end`
    holds back the longest tail of `text` that is a proper prefix of some stop string.
    """
    if not stop:
        return StopCheck(None, None, len(text))
    num_old_chars = len(text) - num_new_chars
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        if not s:
            continue
        # A new match ends inside the new text, so it starts at most len(s)-1 chars before it.
        at = text.find(s, max(0, num_old_chars - len(s) + 1))
        if at != -1 and (best is None or (at + len(s), at) < best[:2]):
            best = (at + len(s), at, s)
    if best is not None:
        _, at, s = best
        return StopCheck(FinishReason.STOP, s, at + len(s) if include_stop_str_in_output else at)
    return StopCheck(None, None, len(text) - _held_suffix_len(text, stop))


def _held_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    held = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held


def check_stop(params: SamplingParams, eos_token_ids: Sequence[int], output_token_ids: Sequence[int],
               text: str, num_new_chars: int) -> StopCheck:
    """The stop decision after the newest token (`output_token_ids[-1]`) was appended and its
    text (`num_new_chars` chars, possibly 0 while bytes are incomplete) added to `text`."""
    num_tokens = len(output_token_ids)
    if num_tokens == 0:
        raise ValueError("check_stop needs at least one output token")
    token_id = output_token_ids[-1]
    if num_tokens < params.min_tokens:
        # Too early to stop; still hold back a partial stop string so that it is not streamed
        # before it can be recognised.
        held = _held_suffix_len(text, params.stop) if params.stop else 0
        return StopCheck(None, None, len(text) - held)
    if not params.ignore_eos and token_id in eos_token_ids:
        return StopCheck(FinishReason.STOP, token_id, len(text))
    if token_id in params.stop_token_ids:
        return StopCheck(FinishReason.STOP, token_id, len(text))
    if not params.stop:  # the common request: nothing to search, nothing held back
        return StopCheck(FinishReason.LENGTH if num_tokens >= params.max_tokens else None,
                         None, len(text))
    # A stop string completed before min_tokens is not searched again: the caller asked for
    # at least min_tokens tokens, so the text they produced stands.
    found = find_stop_string(text, params.stop, num_new_chars, params.include_stop_str_in_output)
    if found.finished:
        return found
    if num_tokens >= params.max_tokens:
        return StopCheck(FinishReason.LENGTH, None, len(text))
    return found
