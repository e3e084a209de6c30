"""One generation request as the engine sees it: tokens, progress, blocks and status.

Lifecycle (the scheduler moves a request; nothing else writes `status`):

    add_request --> WAITING --admit--> RUNNING --max_tokens-------------------> FINISHED_LENGTH
                                        ^  |  |--finish_request (EOS, stop)--> FINISHED_STOPPED
                      admit (recompute) |  |  +--prompt done, PREFILL_ONLY---> PREFILLED
                                        |  v preempt                 release_prefilled: gone
                                       PREEMPTED
    add_decode_request --> RUNNING              (DECODE_ONLY: the prompt KV arrived by transfer)
    add_resumed_request --> PREEMPTED           (output so far produced elsewhere: recomputed)
    any live state --abort_request--> FINISHED_ABORTED
    too big for the whole KV pool --> FINISHED_ERROR (prompt) or FINISHED_LENGTH (grew past it)

Token positions:

    all_token_ids  [ prompt_token_ids ........ ][ output_token_ids ... ]
                   [ KV computed: 0 .. num_computed_tokens ) [ to compute ]

Invariants (checked by `Scheduler.check_invariants`):
    0 <= num_computed_tokens <= num_tokens; while RUNNING at least one token lacks KV (the
    last sampled one, or the rest of the prompt), and a decode step computes exactly that
    token and samples the next
    block_ids covers num_computed_tokens positions; WAITING/PREEMPTED hold no blocks
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams

# An output token sampled by a step whose result is still on the device (an overlapped step,
# engine/scheduler.py): only ever the last output token, replaced by `resolve_placeholder`.
PLACEHOLDER = -1


class RequestMode(enum.Enum):
    PREFILL_AND_DECODE = "prefill_and_decode"  # the whole generation on this engine
    PREFILL_ONLY = "prefill_only"  # prefill worker: compute the prompt, sample one token, hold KV
    DECODE_ONLY = "decode_only"  # decode worker: prompt KV arrives by transfer, then decode


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV will be recomputed
    PREFILLED = "prefilled"  # PREFILL_ONLY done; blocks held until the KV is sent
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens reached, or no room left to grow
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # can never run here (e.g. prompt larger than the pool)

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why a finished request ended; None while it is live."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """Identity semantics: two Request objects are never equal, even with one request_id."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    priority: int = 0  # higher is more important
    tpot_s: float | None = None  # its time-per-output-token target (engine/step_budget.py)
    arrival_time: float = field(default_factory=time.monotonic)  # seconds; orders equal ranks
    mode: RequestMode = RequestMode.PREFILL_AND_DECODE
    # ---- state below is written by the scheduler and the KV cache manager only ----
    queued_s: float | None = None  # arrival -> first admitted into a step; None: not yet
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    num_preemptions: int = 0
    num_steps: int = 0  # engine steps that computed some of its tokens (prefill chunks + decodes)
    # The request's block table; position p lives in block_ids[p // block_size]. Set by the
    # KV cache manager only, a new tuple at each change: the same object while it is the
    # same table, so a step's chunk takes it as it is (no copy per row per step).
    block_ids: tuple[int, ...] = ()
    status: RequestStatus = RequestStatus.WAITING

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id} has an empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output: a new list every call (O(num_tokens))."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    def token_ids_between(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end] without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt:end - num_prompt])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[:end - num_prompt])

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def token_pending(self) -> bool:
        """Its last output token is a PLACEHOLDER (an overlapped step's, still on the device)."""
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    def resolve_placeholder(self, token_id: int) -> None:
        """An overlapped step's token replaces its PLACEHOLDER, whatever the state since.
        (An engine step does this for its rows in compiled code, with the same check:
        engine/native's resolve_rows.)"""
        output = self.output_token_ids  # token_pending, read once
        if not output or output[-1] != PLACEHOLDER:
            raise AssertionError(f"{self.request_id} has no token pending")
        output[-1] = token_id


def check_prompt_tokens(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """ValueError unless the prompt has tokens, each in [0, vocab_size)."""
    if not prompt_token_ids:
        raise ValueError("the prompt has no tokens")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
