"""The scheduler's budgets: how much one step may do, and how fast waiting requests age."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # chunks (requests) per step
    max_num_batched_tokens: int = 2048  # tokens per step
    prefill_chunk_tokens: int | None = None  # per-request prefill tokens per step; None: budget
    aging_steps: int | None = 1000  # steps of age worth one priority level; None: no aging
    # Prompt tokens left worth one step of age in the prefill order (shortest remaining
    # first, engine/request_rank.py); None: prefills in rank order.
    prefill_aging_tokens: int | None = 256
    # A step's prompt tokens are what the tightest TPOT target among its decoding requests
    # leaves, by the worker's step model (engine/step_budget.py); False: the fixed budget.
    hold_tpot: bool = False
    # Every PREFILL_AND_DECODE request is parked after its first token (PREFILLED, table
    # held), as a PREFILL_ONLY one, for another scheduler over the same KV cache to adopt:
    # the prefill lane's scheduler (engine/prefill_lane.py).
    parks_prefilled: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs so every seated "
                             f"decode fits the budget, got {self.max_num_batched_tokens} < "
                             f"{self.max_num_seqs}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be at least 1, got "
                             f"{self.prefill_chunk_tokens}")
        if self.aging_steps is not None and self.aging_steps < 1:
            raise ValueError(f"aging_steps must be at least 1, got {self.aging_steps}")
        if self.prefill_aging_tokens is not None and self.prefill_aging_tokens < 1:
            raise ValueError(f"prefill_aging_tokens must be at least 1, got "
                             f"{self.prefill_aging_tokens}")
