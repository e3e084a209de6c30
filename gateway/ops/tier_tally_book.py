"""The gateway's running tally of finished requests per tier (protocol/tier_tally.py), handed
to the operations agent through Redis (state/tier_tallies.py) once per interval.

    observe(record)   one finished request (gateway/api/request_trace.py's record), with
                      the event loop's lag while it streamed (`lag`, the relay stage)
    take(now)         the tally since the last take, and a fresh one (None: nothing finished)
    start() / stop()  the publishing task: every `period_s` take() and append it to the
                      stream (best effort: with Redis away the interval's tally is dropped,
                      and one warning says so per outage); and the loop-lag sampler

Lifecycle: start() once in the gateway's cleanup_ctx, stop() there on shutdown (cancels
and awaits the task, then publishes what is left). Invariant: every observed request is in
exactly one taken tally, or in the current one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from gateway.api.request_trace import RequestRecord
from gateway.ops.loop_lag import LoopLag
from gateway.ops.request_history import MET, MISSED, REFUSED
from protocol.tier_tally import GatewayTally, StageSum, TierTally
from state.redis_state import REDIS_FAILURES, raise_if_cancelling
from state.tier_tallies import TallyStream

log = logging.getLogger(__name__)


def add_request(tally: TierTally, record: RequestRecord, relay_ms: float | None = None) -> None:
    """Count one finished request into its tier's tally; `relay_ms`: the gateway loop's
    mean lag while it streamed (None: not known)."""
    if record.outcome in MET:
        tally.num_met += 1
    elif record.outcome in MISSED:
        tally.num_missed += 1
    elif record.outcome in REFUSED:
        tally.num_refused += 1
        return  # refused before any worker saw it: no stage to time
    else:
        tally.num_failed += 1
    stages = {s.name: s for s in record.stages}
    queued = stages.get("queued")
    if queued is not None:
        tally.admission_queue.add(queued.end_ms - queued.start_ms)
    tally.num_transfer_retries += sum(s.name == "retry" and s.detail.startswith("transfer ")
                                      for s in record.stages)
    if record.workers:
        tally.num_prompts += 1
        tally.num_prompt_tokens += record.num_prompt_tokens
    prefill = stages.get("prefill")
    if prefill is not None and record.workers:
        ms = prefill.end_ms - prefill.start_ms
        tally.prefill.add(ms)
        tally.prefill_by_worker.setdefault(record.workers[0], StageSum()).add(ms)
    queue = stages.get("prefill_queue")  # the last attempt's, as `prefill` is
    if queue is not None and prefill is not None and record.route == "split":
        tally.prefill_queue.add(queue.end_ms - queue.start_ms)
    if record.tpot_ms is not None and record.workers:
        tally.decode.add(record.tpot_ms)
        tally.decode_by_worker.setdefault(record.workers[-1], StageSum()).add(record.tpot_ms)
        if relay_ms is not None:
            tally.relay.add(relay_ms)


def streamed_between(record: RequestRecord) -> tuple[float, float] | None:
    """The wall-clock seconds from its first token to its last (None: no decode stage)."""
    decode = next((s for s in record.stages if s.name == "decode"), None)
    if decode is None:
        return None
    arrived = record.arrived_unix_ms / 1000
    return arrived + decode.start_ms / 1000, arrived + decode.end_ms / 1000


class TierTallyBook:
    def __init__(self, stream: TallyStream | None, period_s: float = 1.0,
                 lag: LoopLag | None = None) -> None:
        if period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.lag = LoopLag() if lag is None else lag
        self.stream = stream  # None: tallied, never published (a gateway without Redis)
        self.period_s = period_s
        self.gateway_id = uuid.uuid4().hex[:12]
        self._tiers: dict[str, TierTally] = {}
        self._start_unix_ms = int(time.time() * 1000)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def observe(self, record: RequestRecord) -> None:
        streamed = streamed_between(record) if record.tpot_ms is not None else None
        add_request(self._tiers.setdefault(record.tier, TierTally()), record,
                    None if streamed is None else self.lag.mean_ms(*streamed))

    def take(self, now_unix_ms: int) -> GatewayTally | None:
        tiers, self._tiers = self._tiers, {}
        start, self._start_unix_ms = self._start_unix_ms, now_unix_ms
        if not tiers:
            return None
        return GatewayTally(gateway_id=self.gateway_id, start_unix_ms=start,
                            end_unix_ms=now_unix_ms, tiers=tiers)

    def start(self) -> None:
        self.lag.start()
        if self._task is None and self.stream is not None:
            self._task = asyncio.create_task(self._run(), name="tier-tally-publisher")

    async def stop(self) -> None:
        await self.lag.stop()
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        await self._publish(timeout_s=0.5)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self._publish()
            raise_if_cancelling()  # a stop that redis-py swallowed

    async def _publish(self, timeout_s: float | None = None) -> None:
        tally = self.take(int(time.time() * 1000))
        if tally is None or self.stream is None:
            return
        try:
            await self.stream.publish(tally, timeout_s)
        except REDIS_FAILURES as exc:
            raise_if_cancelling(exc)
            if not self._failing:
                log.warning("tier tallies not published (Redis: %r); the agent sees no "
                            "requests until it answers", exc)
            self._failing = True
            return
        self._failing = False
