"""The scheduler's invariants (engine/scheduler.py's module doc), checked over its parts.

    each live request is in exactly one of waiting / running / prefilled, per its status
    running and prefilled requests hold a block table covering their computed tokens;
    waiting requests hold no blocks and have computed nothing
    a running request has at least one token without KV; PREFILLED holds exactly its prompt
    and one output token
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.kv_cache import KVCacheManager
from engine.ranked_requests import RankedRequests
from engine.request import Request, RequestMode, RequestStatus
from engine.request_rank import RequestOrder
from engine.waiting_queue import WaitingQueue


def check_scheduler(kv_cache: KVCacheManager, waiting_queue: WaitingQueue,
                    running: RankedRequests, prefilled: Mapping[str, Request],
                    requests: Mapping[str, Request], order: RequestOrder) -> None:
    """Raise AssertionError where one of a scheduler's parts breaks an invariant."""
    kv_cache.check_invariants()
    bs = kv_cache.block_size
    waiting_queue.check_invariants(order.prefill_key)
    running.check_invariants()
    waiting = waiting_queue.waiting()
    assert all(requests.get(r.request_id) is r for r in waiting)
    assert len(waiting) + len(running) + len(prefilled) == len(requests)
    assert order.request_ids() == set(requests)
    assert not any(kv_cache.holds_blocks(r.request_id) for r in waiting), \
        "a waiting request holds blocks"
    for request in running.values():
        assert request.status is RequestStatus.RUNNING
        assert 1 <= request.num_tokens - request.num_computed_tokens
        if request.mode is not RequestMode.PREFILL_ONLY:
            assert request.num_output_tokens < request.sampling_params.max_tokens
    for request in prefilled.values():
        assert request.status is RequestStatus.PREFILLED
        assert request.num_computed_tokens == request.num_prompt_tokens
        assert request.num_output_tokens == 1
    for request in [*running.values(), *prefilled.values()]:
        assert requests[request.request_id] is request
        assert kv_cache.holds_blocks(request.request_id), "live request lost its table"
        assert request.block_ids == kv_cache.block_table(request.request_id)
        assert len(request.block_ids) * bs >= request.num_computed_tokens
