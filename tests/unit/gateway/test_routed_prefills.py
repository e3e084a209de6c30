"""The routed prefills' ledger: totals per worker follow adds, replacements and settles."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.upstream.routed_prefills import RoutedPrefills


def test_a_retry_replaces_the_entry_and_a_settle_counts_once() -> None:
    routed = RoutedPrefills()
    routed.add("r1", "p0", 5000)
    routed.add("r2", "p0", 5)
    assert routed.totals("p0") == (2, 5005) and routed.totals("d0") == (0, 0)
    routed.add("r1", "d0", 5000)  # re-planned after p0 failed it: now d0 prefills it
    assert routed.totals("p0") == (1, 5) and routed.totals("d0") == (1, 5000)
    routed.settle("r1")
    routed.settle("r1")
    routed.settle("never-added")
    assert routed.totals("d0") == (0, 0) and len(routed) == 1
    routed.check_invariants()


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.sampled_from(["a", "b"]),
                          st.integers(0, 100)), max_size=40))
def test_totals_are_the_sums_of_the_entries_left(ops) -> None:
    routed, model = RoutedPrefills(), {}
    for is_add, request, worker, tokens in ops:
        if is_add:
            routed.add(f"r{request}", worker, tokens)
            model[f"r{request}"] = (worker, tokens)
        else:
            routed.settle(f"r{request}")
            model.pop(f"r{request}", None)
        routed.check_invariants()
        for w in ("a", "b"):
            mine = [t for x, t in model.values() if x == w]
            assert routed.totals(w) == (len(mine), sum(mine))
