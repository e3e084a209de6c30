"""Per-request sampling parameters: one type from the HTTP body to the engine's sampler.

The gateway builds them from the OpenAI request (gateway/api/request_parsing.py), they travel
as-is inside PrefillRequest and DecodeRequest (msgpack), and the engine samples with them.
Validated once wherever they are made: at construction and, on a worker, while decoding
(msgspec runs `__post_init__` then; a ValueError there makes the message invalid, which the
worker answers with BAD_REQUEST). The size limits below are checked while decoding, so a
hostile peer cannot make a worker allocate without bound.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.grammar_spec import GrammarSpec

MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1 << 20
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]; -100 bans a token in effect
_INT32_MAX = 2**31 - 1

StopStrings = Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_STOP_CHARS)], ...],
                        msgspec.Meta(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)]
# (token id, bias) pairs, ids ascending and distinct.
LogitBias = Annotated[tuple[tuple[int, float], ...], msgspec.Meta(max_length=MAX_LOGIT_BIAS_TOKENS)]


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: StopStrings = ()
    stop_token_ids: StopTokenIds = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and k alternatives
    include_stop_str_in_output: bool = False
    logit_bias: LogitBias = ()  # added to the logits before any other edit (OpenAI)
    grammar: GrammarSpec | None = None  # the output must match it (protocol/grammar_spec.py)

    def __post_init__(self) -> None:
        # Integers stay inside what every peer's wire and tensors take (int32 counts and
        # ids, a 64-bit seed), so no value can fail later than here.
        if not 1 <= self.max_tokens <= _INT32_MAX:
            raise ValueError(f"max_tokens must be in [1, {_INT32_MAX}], got {self.max_tokens}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.top_k is not None and self.top_k > _INT32_MAX:
            raise ValueError(f"top_k must be at most {_INT32_MAX}, got {self.top_k}")
        if any(not 0 <= t <= _INT32_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {_INT32_MAX}]")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or unset), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        ids = [t for t, _ in self.logit_bias]
        if any(not 0 <= t <= _INT32_MAX for t in ids) or ids != sorted(set(ids)):
            raise ValueError("logit_bias token ids must be distinct, ascending and in "
                             f"[0, {_INT32_MAX}]")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]")
        if self.grammar is not None and self.ignore_eos:
            # The grammar ends the output by allowing only EOS; ignoring it would run on.
            raise ValueError("ignore_eos cannot be combined with a grammar")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
