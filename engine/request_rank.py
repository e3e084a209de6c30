"""The scheduler's two orders of requests: pure functions of priority, age and work left,
and `RequestOrder`, which holds each live request's arrival to compute them.

**Rank** (who is seated, who is preempted): rank = priority * aging_steps - arrival_step
(priority alone when aging_steps is None); ties go to the earlier arrival_time, then the
earlier add. This equals "every request gains one priority level per aging_steps steps of
age", so a request that arrived T steps before another outranks it unless its priority is
lower by more than T / aging_steps. Hence only finitely many requests can ever rank above a
given one; the best-ranked running request can preempt every other, so it always holds its
blocks.

**Prefill order** (who gets the step's token budget for prompt tokens): shortest remaining
first within a tier, with aging. A request's urgency, in steps (smaller goes first), is

    arrival_step - priority * aging_steps + num_steps_served + tokens_left / aging_tokens

(without aging_steps the priority is compared first, the rest within it; without
aging_tokens the order is the rank's). `tokens_left` is what it still has to compute;
`num_steps_served` the steps that gave it a chunk. Between two steps the urgency of a
request that was served grows by 1 (and drops by what it computed / aging_tokens), that of
one passed over stays: measured against requests that arrive later, a request gains one
step of age per step it waited unserved, and every `aging_tokens` tokens it has left cost
it one. So a prompt that is being served is overtaken by any shorter newcomer (a short
prompt never waits behind a long one that is progressing for more than the step in which it
arrives), and a long prompt passed over for ceil(tokens_left / aging_tokens) steps goes
before every prompt of its tier that arrives after that.

**Starvation.** Every step a prompt is passed over either ages it by one step or computes
at least one of its tokens; after ceil(R / aging_tokens) such steps (R: its tokens left),
none that arrives later precedes it in the prefill order, so only the finitely many queued
before it then (and a higher tier, for at most aging_steps steps of age per level) can
take the budget first; each of those finishes its prefill, so it does. Its blocks it gets
by rank, as above. Two things the scheduler cannot preempt hold blocks outside this
argument: PREFILLED requests (until `release_prefilled`) and reservations not yet joined
(until `KVCacheManager.release`); their owners must release them, and a decode worker
should reserve only while `num_waiting == 0`, so preempted requests get blocks first.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.request import Request

RankKey = tuple[int, float, int]  # smaller is better; unique per request
PrefillKey = tuple[int, float, float, int]  # smaller goes first; unique per request


class Arrival(NamedTuple):
    """How a request entered the scheduler: fixed when it registers."""

    priority: int  # higher is more important
    step: int  # the scheduler's step count at its registration
    arrival_time: float
    seq: int  # its place among every request the scheduler registered


def rank_key(arrival: Arrival, aging_steps: int | None) -> RankKey:
    """Sort key of the rank: smaller ranks better. rank = priority * aging_steps - step, or
    priority when aging_steps is None."""
    rank = arrival.priority if aging_steps is None \
        else arrival.priority * aging_steps - arrival.step
    return (-rank, arrival.arrival_time, arrival.seq)


def prefill_key(arrival: Arrival, aging_steps: int | None, aging_tokens: int | None,
                num_tokens_left: int, num_steps_served: int) -> PrefillKey:
    """Sort key of the prefill order (smaller goes first): (tier, urgency in steps,
    arrival_time, seq). With aging_steps the tier is folded into the urgency, as in the rank;
    with aging_tokens None the order is the rank's."""
    if aging_tokens is None:
        if aging_steps is None:
            return (-arrival.priority, 0.0, arrival.arrival_time, arrival.seq)
        return (0, float(arrival.step - arrival.priority * aging_steps), arrival.arrival_time,
                arrival.seq)
    urgency = arrival.step + num_steps_served + num_tokens_left / aging_tokens
    if aging_steps is None:
        return (-arrival.priority, urgency, arrival.arrival_time, arrival.seq)
    return (0, urgency - arrival.priority * aging_steps, arrival.arrival_time, arrival.seq)


class RequestOrder:
    """Each live request's `Arrival` (the scheduler's step count and add count when it
    registered), and its keys in the two orders."""

    def __init__(self, aging_steps: int | None, aging_tokens: int | None) -> None:
        self.aging_steps, self.aging_tokens = aging_steps, aging_tokens
        self._arrivals: dict[str, Arrival] = {}
        self._num_added = 0

    def add(self, request: Request, step: int) -> None:
        self._arrivals[request.request_id] = Arrival(request.priority, step,
                                                     request.arrival_time, self._num_added)
        self._num_added += 1

    def remove(self, request_id: str) -> None:
        del self._arrivals[request_id]

    def request_ids(self) -> set[str]:
        return set(self._arrivals)

    def rank_key(self, request: Request) -> RankKey:
        return rank_key(self._arrivals[request.request_id], self.aging_steps)

    def prefill_key(self, request: Request) -> PrefillKey:
        """Its key now: the tokens it has left, the steps that served it so far."""
        return prefill_key(self._arrivals[request.request_id], self.aging_steps,
                           self.aging_tokens, request.num_tokens - request.num_computed_tokens,
                           request.num_steps)
