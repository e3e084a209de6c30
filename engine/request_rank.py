"""The scheduler's order of requests: a pure function of priority, age and arrival.

rank = priority * aging_steps - arrival_step (priority alone when
aging_steps is None); ties go to the earlier arrival_time, then the earlier add. This equals
"every request gains one priority level per aging_steps steps of age", so a request that
arrived T steps before another outranks it unless its priority is lower by more than
T / aging_steps. Hence only finitely many requests can ever rank above a given one; the
best-ranked running request can preempt every other, so it always progresses and finishes;
by induction every request finishes. Two things the scheduler cannot preempt hold blocks
outside this argument: PREFILLED requests (until `release_prefilled`) and reservations not
yet joined (until `KVCacheManager.release`); their owners must release them, and a decode
worker should reserve only while `num_waiting == 0`, so preempted requests get blocks first.
"""

from __future__ import annotations


def rank_key(priority: int, aging_steps: int | None, step: int, arrival_time: float,
             seq: int) -> tuple[int, float, int]:
    """Sort key of a request added at scheduler step `step` (the `seq`-th added): smaller
    ranks better. rank = priority * aging_steps - step, or priority when aging_steps is None."""
    rank = priority if aging_steps is None else priority * aging_steps - step
    return (-rank, arrival_time, seq)
