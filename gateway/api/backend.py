"""What the HTTP layer needs from whatever generates tokens: the `CompletionBackend` protocol.

The HTTP layer validates a request, turns it into a `GenerationRequest` and iterates the
backend's `TokenDelta`s, encoding each as one SSE event (or collecting them for a
non-streamed answer). The backend that talks to prefill/decode workers plugs in here; unit
tests plug in a fake.

Contract of `generate`:
  * yields deltas in order; every delta carries at least one token, except that the last
    one may carry none and only a `finish_reason`;
  * exactly one delta has `finish_reason` set, and it is the last;
  * when the consumer stops iterating early (client gone), the generator is closed with
    `aclose()`; the backend must release the request's work on its workers then;
  * raises `BackendUnavailable` (503 to the client) when it cannot serve at all.

A backend may also offer `generate_batches` (`BatchingBackend`): the same deltas, in the
same order, grouped into non-empty lists of whatever arrived together, so the HTTP layer
writes one batch with one socket write. `BackendCalls.of` picks it when it is there.

A streamed request may carry a `DeltaSink` (gateway/api/fast_lane.py): while it `accepts()`,
the backend may hand it deltas that end nothing (no finish reason) instead of yielding
them, from wherever they arrive (a socket's read callback), and they reach the client at
once; every delta still goes out exactly once, in order, by one way or the other.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec

from gateway.routing.retry_policy import LegFailed
from gateway.routing.router import RoutePlan
from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams


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
    key_id: str | None = None
    trace: RouteObserver | None = None  # told each plan and failure (gateway/api/request_trace.py)
    sink: DeltaSink | None = None  # a streamed answer's direct way to the client


class RouteObserver(Protocol):
    """What a backend tells about one request's routing (its timeline and trace spans)."""

    @property
    def traceparent(self) -> str | None:
        """Sent to the workers, whose spans become children of the request's."""
        ...

    def planned(self, attempt: int, plan: RoutePlan, now_s: float) -> None: ...

    def failed(self, failure: LegFailed, now_s: float) -> None: ...


class CompletionBackend(Protocol):
    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Stream the request's tokens (see the module docstring for the contract)."""
        ...


@runtime_checkable
class BatchingBackend(Protocol):
    def generate_batches(self, request: GenerationRequest
                         ) -> AsyncGenerator[list[TokenDelta], None]:
        """`generate`'s deltas grouped into non-empty lists, order kept."""
        ...


@dataclass(frozen=True, slots=True)
class BackendCalls:
    """What the HTTP layer calls on a backend, resolved once: a runtime Protocol check
    costs about 12 us, too much to repeat per request."""

    batches: Callable[[GenerationRequest], AsyncGenerator[list[TokenDelta], None]]
    context_limit: Callable[[], int | None]  # see ContextLimited

    @classmethod
    def of(cls, backend: CompletionBackend) -> BackendCalls:
        batches: Callable[[GenerationRequest], AsyncGenerator[list[TokenDelta], None]]
        if isinstance(backend, BatchingBackend):
            batches = backend.generate_batches
        else:
            def batches(request: GenerationRequest) -> AsyncGenerator[list[TokenDelta], None]:
                return _one_per_batch(backend.generate(request))
        limit = backend.context_limit if isinstance(backend, ContextLimited) else _no_limit
        return cls(batches, limit)


def _no_limit() -> int | None:
    return None


async def _one_per_batch(deltas: AsyncGenerator[TokenDelta, None]
                         ) -> AsyncGenerator[list[TokenDelta], None]:
    try:
        async for delta in deltas:
            yield [delta]
    finally:
        await deltas.aclose()  # the backend's cleanup runs when the client goes away


@runtime_checkable
class ContextLimited(Protocol):
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
