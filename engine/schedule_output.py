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


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: tuple[int, ...]  # tokens whose K/V is written this step (at least one)
    start_pos: int  # number of the sequence's tokens already in the KV cache
    block_ids: tuple[int, ...]  # the request's whole block table
    sample: bool  # True when this chunk ends at the last known token: sample the next one

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"chunk of {self.request_id} has no tokens")
        if self.start_pos < 0:
            raise ValueError(f"chunk of {self.request_id} has negative start_pos")

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class ScheduleOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_request_ids: tuple[str, ...] = ()  # moved back to waiting this step (recompute)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_leading_decodes(self) -> int:
        """How many chunks, from the first, have one token each: the decode rows, which the
        scheduler puts first (engine/attention.py gives them the decode kernel)."""
        return next((i for i, c in enumerate(self.chunks) if len(c.token_ids) != 1),
                    len(self.chunks))


class ScheduleDraft:
    """What one `Scheduler.schedule()` call has decided so far: the chunks by request (a
    preempted request's chunk is withdrawn), the token budget left, the preempted ids."""

    __slots__ = ("budget", "chunks", "preempted")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.chunks: dict[str, ScheduledChunk] = {}
        self.preempted: list[str] = []

    def add_decode(self, request_id: str, token_id: int, start_pos: int,
                   block_ids: tuple[int, ...]) -> None:
        """A decode chunk: the request's last token, computed at `start_pos`, sampled."""
        self.chunks[request_id] = ScheduledChunk(request_id, (token_id,), start_pos, block_ids,
                                                 True)
        self.budget -= 1

    def output(self) -> ScheduleOutput:
        return ScheduleOutput(tuple(self.chunks.values()), tuple(self.preempted))
