"""What one engine step computed, and what an engine still has queued: the inputs of the
step-time model the workers fit (worker/step_fit.py) and the router uses.

    StepShape   prefill tokens computed, decoding sequences, context tokens they attend over
    QueueShape  prompt tokens still to prefill, sequences decoding, their context tokens

Both are pure functions of engine state; they run on the engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.request import Request, RequestStatus
from engine.schedule_output import ScheduleOutput


@dataclass(frozen=True, slots=True)
class StepShape:
    prefill_tokens: int = 0
    decode_seqs: int = 0
    context_tokens: int = 0

    @property
    def decodes_only(self) -> bool:
        """A step that decoded and computed no prompt token (comparable across workers)."""
        return self.prefill_tokens == 0 and self.decode_seqs > 0


@dataclass(frozen=True, slots=True)
class QueueShape:
    prefill_tokens: int = 0  # prompt tokens waiting or not yet computed
    decode_seqs: int = 0
    context_tokens: int = 0


def step_shape(schedule: ScheduleOutput | None) -> StepShape:
    """A one-token chunk after position 0 is a decode step; anything else is prefill."""
    if schedule is None:
        return StepShape()
    prefill = decodes = context = 0
    for chunk in schedule.chunks:
        if len(chunk.token_ids) == 1 and chunk.start_pos > 0:
            decodes += 1
            context += chunk.end_pos
        else:
            prefill += len(chunk.token_ids)
    return StepShape(prefill, decodes, context)


def queue_shape(requests: Iterable[Request]) -> QueueShape:
    prefill = decodes = context = 0
    for request in requests:
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            prefill += request.num_tokens - request.num_computed_tokens
        elif request.status is RequestStatus.RUNNING:
            left = request.num_tokens - request.num_computed_tokens
            if left > 1:
                prefill += left
            else:
                decodes += 1
                context += request.num_tokens
    return QueueShape(prefill, decodes, context)
