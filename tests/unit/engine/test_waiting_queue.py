"""The waiting queue: rank order, lazy removal of requests that left, an exact count."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.request import Request, RequestStatus
from engine.waiting_queue import WaitingQueue
from protocol.sampling_params import SamplingParams


def request(rid: str) -> Request:
    return Request(rid, (1, 2, 3), SamplingParams())


def test_the_head_is_the_best_ranked_and_pop_takes_it() -> None:
    queue = WaitingQueue()
    late, early = request("late"), request("early")
    queue.push((0, 2.0, 1), late)
    queue.push((0, 1.0, 0), early)
    assert len(queue) == 2 and queue.head() is early
    assert queue.pop() is early and queue.head() is late and len(queue) == 1


def test_a_forgotten_request_is_counted_out_at_once_and_skipped_at_the_top() -> None:
    queue = WaitingQueue()
    first, second = request("first"), request("second")
    queue.push((0, 1.0, 0), first)
    queue.push((0, 2.0, 1), second)
    queue.forget(first)
    first.status = RequestStatus.FINISHED_ABORTED  # what the scheduler does right after
    assert len(queue) == 1 and queue.waiting() == [second]
    assert queue.head() is second
    queue.check_invariants()
    assert queue.pop() is second and queue.head() is None and len(queue) == 0


@given(st.lists(st.tuples(st.sampled_from(["push", "pop", "forget"]), st.integers(0, 20)),
                max_size=40))
def test_against_a_sorted_list(ops: list[tuple[str, int]]) -> None:
    queue, model, made = WaitingQueue(), [], 0
    for op, key in ops:
        if op == "push":
            r = request(f"r{made}")
            queue.push((key, 0.0, made), r)
            model.append(((key, 0.0, made), r))
            made += 1
        elif model and op == "pop":
            model.sort(key=lambda e: e[0])
            assert queue.head() is model[0][1]
            assert queue.pop() is model.pop(0)[1]
        elif model:
            _, r = model.pop(key % len(model))
            queue.forget(r)
            r.status = RequestStatus.FINISHED_ABORTED
        queue.check_invariants()
        assert len(queue) == len(model)
        best = min(model, key=lambda e: e[0])[1] if model else None
        assert queue.head() is best
