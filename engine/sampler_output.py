"""What the sampler hands back for one step: a token per row, and logprobs where asked.

Invariants (`SamplerOutput.check_invariants`, run by the engine on every step): one token
per row, each inside the vocabulary; a row that asked for logprobs reports the token it got,
with at most `logprobs` alternatives, most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: tuple[int, ...]  # the `logprobs` most likely tokens, most likely first
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask (logprobs is None)

    def check_invariants(self, params: Sequence[SamplingParams], vocab_size: int) -> None:
        token_ids, rows_logprobs = self.token_ids, self.logprobs
        assert len(token_ids) == len(rows_logprobs) == len(params), "one row per request"
        # The usual batch (no logprobs) without a loop: the engine checks every step.
        assert not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size), \
            f"tokens outside [0, {vocab_size}): {[t for t in token_ids if not 0 <= t < vocab_size]}"
        asked = [p.logprobs for p in params]
        if asked.count(None) == len(asked) == rows_logprobs.count(None):
            return
        for token_id, logprobs, p in zip(token_ids, rows_logprobs, params):
            assert (logprobs is None) == (p.logprobs is None), "logprobs where none asked"
            if logprobs is not None and p.logprobs is not None:
                assert logprobs.token_id == token_id, "logprobs of another token"
                assert len(logprobs.top_token_ids) <= p.logprobs
                assert list(logprobs.top_logprobs) == sorted(logprobs.top_logprobs, reverse=True)
