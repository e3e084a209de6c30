"""What the HTTP layer needs from whatever generates tokens: the `CompletionBackend` protocol.

The HTTP layer validates a request, turns it into a `GenerationRequest` and iterates the
backend's `TokenDelta`s in batches, encoding each delta as one SSE event and each batch as
one socket write (or collecting them for a non-streamed answer). The backend that talks to
prefill/decode workers (gateway/upstream/upstream.py) plugs in here; unit tests plug in a
fake.

Contract of `generate_batches`:
  * yields non-empty lists of deltas (whatever arrived together), in order; every delta
    carries at least one token, except that the last one may carry none and only a
    `finish_reason`;
  * exactly one delta has `finish_reason` set, and it is the last;
  * when the consumer stops iterating early (client gone), the generator is closed with
    `aclose()`; the backend must release the request's work on its workers then;
  * raises `BackendUnavailable` (503 to the client) when it cannot serve at all.

A streamed request may carry a `DeltaSink` (gateway/api/stream_writer.py): while it `accepts()`,
the backend may hand it deltas that end nothing (no finish reason) instead of yielding
them, from wherever they arrive (a socket's read callback), and they reach the client at
once; every delta still goes out exactly once, in order, by one way or the other.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

import msgspec

from gateway.api.shared_prefill import SharedPrefill
from gateway.routing.plan_model import Targets
from gateway.routing.retry_policy import LegFailed
from gateway.routing.router import RoutePlan
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams
from text.tool_prompt import ChatTurn, ToolFunction


class BackendUnavailable(Exception):
    """No worker can take the request now (answered as 503)."""

    def __init__(self, message: str, retry_after_s: float | None = None,
                 code: str = "service_unavailable") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code  # the error body's `code`: what ran out or failed


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # alternatives, most likely first


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    num_tokens: int
    finish_reason: FinishReason | None = None  # STOP or LENGTH, on the last delta
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token when requested
    # On the last delta, when a worker reported it: the prompt tokens the prefilling worker
    # found in its prefix cache.
    num_cached_tokens: int | None = None


class DeltaSink(Protocol):
    """A streamed answer's direct way to its client (see the module docstring)."""

    def accepts(self) -> bool:
        """True when deltas pushed now reach the client at once, after every delta the
        backend yielded before: the consumer waits for the next batch and the client keeps
        up. Side-effect free."""
        ...

    def push(self, deltas: list[TokenDelta]) -> None:
        """Deliver `deltas` (none with a finish reason); only right after `accepts()`."""
        ...


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tier: str
    local_prefill: bool | None  # the tier's override (gateway/admission/tiers.py); None: the router decides
    targets: Targets  # the tier's, for the router: computed once at classification
    priority: int = 0  # the protocol's (larger runs first): the tier's, computed once
    key_id: str | None = None
    trace: RouteObserver | None = None  # told each plan and failure (gateway/api/request_trace.py)
    sink: DeltaSink | None = None  # a streamed answer's direct way to the client
    # n > 1: the choices of one prompt prefill once (gateway/api/shared_prefill.py)
    shared_prefill: SharedPrefill | None = None

    @property
    def tpot_ms(self) -> float:
        """The TPOT target a worker holds its steps to while this decodes (its tier's)."""
        return self.targets.tpot_s * 1000


class RouteObserver(Protocol):
    """What a backend tells about one request's routing (its timeline and trace spans)."""

    @property
    def traceparent(self) -> str | None:
        """Sent to the workers, whose spans become children of the request's."""
        ...

    def planned(self, attempt: int, plan: RoutePlan, now_s: float) -> None: ...

    def failed(self, failure: LegFailed, now_s: float) -> None: ...

    def prefill_queue(self, worker_id: str, queue_ms: float, now_s: float) -> None: ...


class CompletionBackend(Protocol):
    """Whatever generates the tokens (see the module docstring for the contract)."""

    def generate_batches(self, request: GenerationRequest
                         ) -> AsyncGenerator[list[TokenDelta], None]:
        """The request's deltas, in non-empty batches of what arrived together."""
        ...

    def context_limit(self) -> int | None:
        """The most tokens (prompt + completion) one request can hold now, e.g. the largest
        KV cache among the workers that can take it; None: unknown (no limit beyond the
        model's)."""
        ...


class PromptTokenizer(Protocol):
    """The workers' tokenizer, used once at the gateway for length limits and routing."""

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's text can have (bounds tokens from below)."""
        ...

    def encode(self, text: str) -> list[int]:
        ...

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Apply the chat template to (role, text) turns and tokenize, with the generation
        prompt for the assistant appended."""
        ...

    def encode_tool_chat(self, turns: Sequence[ChatTurn],
                         functions: tuple[ToolFunction, ...]) -> list[int]:
        """The same for a conversation with tools, tool calls or tool results
        (text/tool_prompt.py)."""
        ...
