"""PrefixIndex (pure): event application against a brute-force model, overlap queries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.messages import PrefixIndexEvent
from state.prefix_index_mirror import PrefixIndex


def ev(worker: str, epoch: int, inserted=(), evicted=(), reset=False) -> PrefixIndexEvent:
    return PrefixIndexEvent(worker_id=worker, epoch=epoch, inserted=list(inserted),
                            evicted=list(evicted), reset=reset)


def test_overlap_counts_leading_hashes_only() -> None:
    index = PrefixIndex()
    index.apply(ev("a", 1, [1, 2, 3]))
    index.apply(ev("b", 1, [1, 3]))  # holds 3 but not 2: its chain breaks at 2
    index.apply(ev("c", 1, [2, 3]))  # no first block: no match at all
    assert index.overlap([1, 2, 3]) == {"a": 3, "b": 1}
    assert index.overlap([1, 2, 3, 4]) == {"a": 3, "b": 1}
    assert index.overlap([9]) == {} and index.overlap([]) == {}
    index.check_invariants()


def test_live_epochs_hide_dead_and_restarted_workers() -> None:
    index = PrefixIndex()
    index.apply(ev("a", 1, [1, 2]))
    index.apply(ev("b", 5, [1, 2]))
    assert index.overlap([1, 2], {"a": 1}) == {"a": 2}  # b has no lease
    assert index.overlap([1, 2], {"a": 2, "b": 5}) == {"b": 2}  # a restarted, not republished


def test_epochs_fence_old_events_and_new_epochs_reset() -> None:
    index = PrefixIndex()
    index.apply(ev("a", 2, [1, 2]))
    assert not index.apply(ev("a", 1, [7]))  # a zombie of an older start
    assert index.overlap([7]) == {}
    assert index.apply(ev("a", 3, [5]))  # a restart drops every epoch-2 entry
    assert index.overlap([1]) == {} and index.overlap([5]) == {"a": 1}
    index.apply(ev("a", 3, [6], reset=True))  # a full republish replaces the set
    assert index.held["a"] == {6}
    index.apply(ev("a", 3, [8], evicted=[6, 99]))  # evicting an unknown hash is harmless
    assert index.held["a"] == {8}
    index.check_invariants()


events = st.lists(st.tuples(
    st.sampled_from(["a", "b", "c"]), st.integers(1, 3),
    st.lists(st.integers(0, 8), max_size=4), st.lists(st.integers(0, 8), max_size=4),
    st.booleans()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(events)
def test_matches_a_brute_force_model(event_list) -> None:
    index = PrefixIndex()
    model: dict[str, tuple[int, set[int]]] = {}
    for worker, epoch, inserted, evicted, reset in event_list:
        index.apply(ev(worker, epoch, inserted, evicted, reset))
        known_epoch, held = model.get(worker, (None, set()))
        if known_epoch is not None and epoch < known_epoch:
            continue
        if reset or known_epoch is None or epoch > known_epoch:
            held = set()
        held = (held - set(evicted)) | set(inserted)
        model[worker] = (epoch, held)
        index.check_invariants()
    for worker, (epoch, held) in model.items():
        assert index.held.get(worker, set()) == held and index.epochs[worker] == epoch
    chain = [0, 1, 2, 3]
    expected = {}
    for worker, (_, held) in model.items():
        n = next((i for i, h in enumerate(chain) if h not in held), len(chain))
        if n:
            expected[worker] = n
    assert index.overlap(chain) == expected
    # Reloading from a snapshot of the same state gives the same answers.
    copy = PrefixIndex()
    copy.load({w: (e, sorted(h)) for w, (e, h) in model.items()})
    assert copy.overlap(chain) == expected
