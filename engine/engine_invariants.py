"""The engine's invariants (engine/llm_engine.py's module doc), checked over its parts.

    every request the engine tracks is known to its scheduler or its prefill lane, or is
    PREFILLED (its KV on its way to a peer), or has a step in flight
    a PLACEHOLDER token only stands in a request whose overlapped step is in flight
    each part's own: the scheduler's, the output processor's, each sampling state's, the
    step in flight's and the prefill lane's
"""

from __future__ import annotations

from engine.inflight_step import InFlightStep
from engine.output_processor import OutputProcessor
from engine.prefill_lane import PrefillLane
from engine.request import RequestStatus
from engine.scheduler import Scheduler


def check_engine(scheduler: Scheduler, outputs: OutputProcessor,
                 inflight: InFlightStep | None, lane: PrefillLane | None) -> None:
    """Raise AssertionError where one of an engine's parts breaks an invariant."""
    scheduler.check_invariants()
    outputs.check_invariants()
    for tracked in outputs.tracked.values():
        tracked.sampling.check_invariants(tracked.request.sampling_params)
    if inflight is not None:
        inflight.check_invariants()
    for request in scheduler.live_requests():  # a PLACEHOLDER only while in flight
        if request.token_pending and not (
                inflight is not None and inflight.holds(request.request_id)):
            raise AssertionError(f"{request.request_id} has a PLACEHOLDER, not in flight")
    if lane is not None:
        lane.check_invariants()
    for rid, tracked in outputs.tracked.items():
        if scheduler.get_request(rid) is None and not (lane and lane.holds(rid)) and \
                tracked.request.status is not RequestStatus.PREFILLED \
                and not (inflight is not None and inflight.holds(rid)):
            raise AssertionError(f"{rid} tracked by the engine but unknown to the scheduler")
