"""What a gateway tells the operations agent about the requests it finished: per tier, the
outcomes, the prompt lengths and the time each stage took, summed over one short interval
(about a second), so that tallies of several intervals and several gateway replicas add up.

    gateway: each finished request ─▶ TierTally.add_request (its tier's)
             every interval ─▶ GatewayTally ─▶ Redis stream {ns}:tier_tallies
    agent:   every tick, the new GatewayTallies ─▶ merged per tier ─▶ agent/root_cause.py

Stages, as the gateway times them (gateway/api/request_trace.py), all in ms:

    admission_queue  arrival -> admitted
    prefill          admitted -> first token: the prefill worker's queue and compute and
                     the KV transfer to the decode worker (the workers' own reports split it)
    prefill_queue    of that, the time the prompt waited in a prefill worker's queue before
                     its first chunk (its PrefillResult says; prompts a decode worker
                     prefills itself do not report it)
    decode           the mean gap between later tokens (TPOT): the decode worker's steps
                     and the relay to the client
    relay            of that, how late the gateway's event loop ran while the request
                     streamed (gateway/ops/loop_lag.py): how long each token waited for
                     the gateway to relay it

The decode gap is also summed per decode worker and the prefill stage per prefill worker
(the last attempt's), so that a stage that grew on one worker shows as that worker's.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
TALLY_VERSION = 1


class StageSum(msgspec.Struct, array_like=True):
    """A sum of one stage's times (ms) over `count` requests; its mean is the figure."""

    sum_ms: NonNegFloat = 0.0
    count: Count = 0

    def add(self, ms: float) -> None:
        self.sum_ms += max(0.0, ms)
        self.count += 1

    def merge(self, other: StageSum) -> None:
        self.sum_ms += other.sum_ms
        self.count += other.count

    @property
    def mean_ms(self) -> float | None:
        return self.sum_ms / self.count if self.count else None


class TierTally(msgspec.Struct, kw_only=True):
    """One tier's finished requests over an interval."""

    num_met: Count = 0
    num_missed: Count = 0  # finished late (TTFT, TPOT or both)
    num_refused: Count = 0  # 429s
    num_failed: Count = 0  # 503s, errors, clients gone
    num_prompt_tokens: Count = 0  # of the requests that reached a worker
    num_prompts: Count = 0
    num_transfer_retries: Count = 0  # attempts that failed moving the KV cache
    admission_queue: StageSum = msgspec.field(default_factory=StageSum)
    prefill: StageSum = msgspec.field(default_factory=StageSum)
    decode: StageSum = msgspec.field(default_factory=StageSum)
    prefill_queue: StageSum = msgspec.field(default_factory=StageSum)
    relay: StageSum = msgspec.field(default_factory=StageSum)
    prefill_by_worker: dict[str, StageSum] = msgspec.field(default_factory=dict)
    decode_by_worker: dict[str, StageSum] = msgspec.field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return self.num_met + self.num_missed + self.num_refused + self.num_failed

    def merge(self, other: TierTally) -> None:
        self.num_met += other.num_met
        self.num_missed += other.num_missed
        self.num_refused += other.num_refused
        self.num_failed += other.num_failed
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_prompts += other.num_prompts
        self.num_transfer_retries += other.num_transfer_retries
        self.admission_queue.merge(other.admission_queue)
        self.prefill.merge(other.prefill)
        self.prefill_queue.merge(other.prefill_queue)
        self.decode.merge(other.decode)
        self.relay.merge(other.relay)
        for mine, theirs in ((self.prefill_by_worker, other.prefill_by_worker),
                             (self.decode_by_worker, other.decode_by_worker)):
            for worker_id, stage in theirs.items():
                mine.setdefault(worker_id, StageSum()).merge(stage)


class GatewayTally(msgspec.Struct, kw_only=True):
    """One gateway replica's tallies of one interval, as it publishes them."""

    version: int = TALLY_VERSION
    gateway_id: str
    start_unix_ms: int
    end_unix_ms: int
    tiers: dict[str, TierTally]


def merged(tallies: list[TierTally]) -> TierTally:
    """The sum of `tallies` (a new tally; the arguments are left as they were)."""
    out = TierTally()
    for tally in tallies:
        out.merge(tally)
    return out
