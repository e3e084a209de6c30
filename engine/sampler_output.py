"""What the sampler hands back for one step: a token per row, and logprobs where asked.

Invariants (`SamplerOutput.check_invariants`, run by the engine on every step): one token
per row, each inside the vocabulary; a row that asked for logprobs reports the token it got,
with at most `logprobs` alternatives, most likely first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.contract.sampling_params import SamplingParams


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
        assert len(self.token_ids) == len(self.logprobs) == len(params), "one row per request"
        for token_id, logprobs, p in zip(self.token_ids, self.logprobs, params):
            assert 0 <= token_id < vocab_size, f"token {token_id} outside [0, {vocab_size})"
            assert (logprobs is None) == (p.logprobs is None), "logprobs where none asked"
            if logprobs is not None and p.logprobs is not None:
                assert logprobs.token_id == token_id, "logprobs of another token"
                assert len(logprobs.top_token_ids) <= p.logprobs
                assert list(logprobs.top_logprobs) == sorted(logprobs.top_logprobs, reverse=True)
