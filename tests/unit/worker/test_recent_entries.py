"""Remembered entries: claimed once, forgotten when old, bounded in number."""

from __future__ import annotations

from worker.recent_entries import RecentEntries


def test_an_entry_is_claimed_once_and_only_while_young() -> None:
    entries: RecentEntries[str] = RecentEntries(max_age_s=10.0, max_entries=8)
    entries.put("a", "first", now=0.0)
    entries.put("a", "second", now=1.0)  # put again: the newer value, as new
    assert len(entries) == 1 and "a" in entries
    assert entries.pop("a", now=11.0) == "second"
    assert entries.pop("a", now=11.0) is None  # claimed already
    entries.put("old", "x", now=0.0)
    assert entries.pop("old", now=10.5) is None  # too old to count
    entries.check_invariants()


def test_old_entries_go_first_and_the_number_is_bounded() -> None:
    entries: RecentEntries[int] = RecentEntries(max_age_s=10.0, max_entries=3)
    for i in range(5):
        entries.put(f"k{i}", i, now=float(i))
    assert len(entries) == 3 and "k0" not in entries and "k1" not in entries
    entries.put("late", 9, now=100.0)  # everything older than 10 s is dropped on the way
    assert len(entries) == 1 and entries.pop("late", now=100.0) == 9
    entries.check_invariants()
