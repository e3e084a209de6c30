"""The running requests in rank order: against a sort of the same set after every change."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.ranked_requests import RankedRequests
from engine.request import Request
from protocol.sampling_params import SamplingParams


def request(rid: str) -> Request:
    return Request(rid, (1, 2), SamplingParams())


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 30)), max_size=40))
def test_the_order_is_a_sort_by_key(ops: list[tuple[bool, int, int]]) -> None:
    ranked, model, made = RankedRequests(), {}, 0
    for add, priority, pick in ops:
        if add or not model:
            r = request(f"r{made}")
            key = (-priority, float(pick), made)
            ranked.add(r, key)
            model[r.request_id] = (key, r)
            made += 1
        else:
            rid = sorted(model)[pick % len(model)]
            ranked.remove(model.pop(rid)[1])
        ranked.check_invariants()
        order = [r for _, r in sorted(model.values(), key=lambda e: e[0])]
        assert list(ranked.values()) == order and len(ranked) == len(order)
        assert ranked.best(3) == order[:3]
        if order:
            assert ranked.worst() is order[-1] and order[0].request_id in ranked


def test_a_request_is_added_once_and_removed_only_as_itself() -> None:
    ranked, a = RankedRequests(), request("a")
    ranked.add(a, (0, 1.0, 0))
    with pytest.raises(ValueError, match="already running"):
        ranked.add(request("a"), (0, 2.0, 1))
    with pytest.raises(KeyError):
        ranked.remove(request("a"))  # another request under the same id
    ranked.remove(a)
    assert len(ranked) == 0
    with pytest.raises(IndexError):
        ranked.worst()
