"""The one message from the scheduler to the model runner.

Every step the scheduler emits a `ScheduleOutput`; the model runner executes exactly what it
says and nothing else. Prefill chunks and decode steps have the same shape: a run of tokens
whose K/V is computed this step, starting at a known position of the sequence.

    sequence positions   0 ............ start_pos ........ start_pos+len(token_ids)
                         [ KV already in cache ][ computed this step      ]
    block_ids            covers at least start_pos + len(token_ids) positions;
                         position p lives in block_ids[p // block_size], slot p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from engine.request import Request


class _ChunkFields(NamedTuple):
    request_id: str
    token_ids: tuple[int, ...]  # tokens whose K/V is written this step (at least one)
    start_pos: int  # number of the sequence's tokens already in the KV cache
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # True when this chunk ends at the last known token: sample the next one


class ScheduledChunk(_ChunkFields):
    """One request's tokens in a step. Immutable (a named tuple: a step makes one per running
    request, so its construction is part of the host's cost per row); the constructor checks
    the fields, and `decode` makes the one-token chunk of a decode step, valid by
    construction, without the checks."""

    __slots__ = ()

    def __new__(cls, request_id: str, token_ids: tuple[int, ...], start_pos: int,
                block_ids: tuple[int, ...], sample: bool) -> "ScheduledChunk":
        if not token_ids:
            raise ValueError(f"chunk of {request_id} has no tokens")
        if start_pos < 0:
            raise ValueError(f"chunk of {request_id} has negative start_pos")
        return tuple.__new__(cls, (request_id, token_ids, start_pos, block_ids, sample))

    @classmethod
    def decode(cls, request_id: str, token_id: int, start_pos: int,
               block_ids: tuple[int, ...]) -> "ScheduledChunk":
        """The request's last token, computed at `start_pos` (>= 0), sampled. The scheduler's
        compiled decode rows (engine/native: schedule_decodes) build this same tuple."""
        return tuple.__new__(cls, (request_id, (token_id,), start_pos, block_ids, True))

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


# ScheduledChunk's fields by position (compiled code reads them so: engine/native).
TOKEN_IDS, BLOCK_IDS = 1, 3
_TOKEN_IDS, _BLOCK_IDS = itemgetter(TOKEN_IDS), itemgetter(BLOCK_IDS)


@dataclass(frozen=True, slots=True)
class ScheduleOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_request_ids: tuple[str, ...] = ()  # moved back to waiting this step (recompute)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, map(_TOKEN_IDS, self.chunks)))  # in C: a runner asks every step

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_leading_decodes(self) -> int:
        """How many chunks, from the first, have one token each: the decode rows, which the
        scheduler puts first (engine/attention_kernels.py gives them the decode kernel)."""
        ones = bytes(map((1).__eq__, map(len, map(_TOKEN_IDS, self.chunks))))  # 1: a decode
        first_other = ones.find(0)
        return len(ones) if first_other < 0 else first_other

    @property
    def max_table_len(self) -> int:
        """The longest block table of the step's chunks (0 for none)."""
        return max(map(len, map(_BLOCK_IDS, self.chunks)), default=0)


class ScheduleDraft:
    """What one `Scheduler.schedule()` call has decided so far: the chunks by request (a
    preempted request's chunk is withdrawn), the token budget left, the preempted ids.
    The budget left is the step's budget less the tokens of the chunks."""

    __slots__ = ("budget", "chunks", "preempted", "prefill_chunk_tokens", "seats")

    def __init__(self, budget: int, seats: int, prefill_chunk_tokens: int | None = None) -> None:
        self.budget = budget
        self.seats = seats  # admission stops once this many requests run
        self.prefill_chunk_tokens = prefill_chunk_tokens  # a request's most tokens per step
        self.chunks: dict[str, ScheduledChunk] = {}
        self.preempted: list[str] = []

    def chunk_len(self, num_left: int) -> int:
        """The tokens a request with `num_left` to compute may take now."""
        cap = self.prefill_chunk_tokens
        return min(num_left, self.budget, num_left if cap is None else cap)

    def add_chunk(self, request: Request, num_new: int) -> None:
        """The request's next `num_new` tokens (from num_computed_tokens), sampling when
        they reach its last known token."""
        start = request.num_computed_tokens
        end = start + num_new
        self.chunks[request.request_id] = ScheduledChunk(
            request_id=request.request_id, token_ids=request.token_ids_between(start, end),
            start_pos=start, block_ids=request.block_ids, sample=end == request.num_tokens)
        self.budget -= num_new

    def preempt(self, request_id: str) -> None:
        """The request was preempted: its chunk, if it had one, is withdrawn."""
        withdrawn = self.chunks.pop(request_id, None)
        if withdrawn is not None:
            self.budget += len(withdrawn.token_ids)
        self.preempted.append(request_id)

    def output(self) -> ScheduleOutput:
        return ScheduleOutput(tuple(self.chunks.values()), tuple(self.preempted))
