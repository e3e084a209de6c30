"""The NIXL modes' descriptor lists (benchmarks/kv_nixl.py): pure parts, no NIXL needed."""

from __future__ import annotations

from benchmarks.kv_nixl import matching_runs, regions, runs_of


def test_runs_are_the_consecutive_stretches_in_order() -> None:
    assert runs_of([7, 8, 9, 2, 3, 11]) == [(7, 3), (2, 2), (11, 1)]
    assert runs_of([]) == []


def test_regions_cover_each_run_in_every_layers_k_and_v() -> None:
    # A pool of 10 blocks of 4 bytes per (layer, K|V) plane, at address 1000.
    descs = regions(1000, 10, 4, 2, [(7, 2), (1, 1)], device_id=3)
    planes = [1000 + p * 40 for p in range(4)]  # layer 0 K, layer 0 V, layer 1 K, layer 1 V
    assert descs == [(base + offset, size, 3) for base in planes
                     for offset, size in ((28, 8), (4, 4))]


def test_the_senders_runs_pair_one_to_one_with_the_receivers() -> None:
    dst = runs_of([40, 41, 42, 10, 11, 90])
    src = matching_runs(dst)
    assert src == [(0, 3), (3, 2), (5, 1)]
    assert [length for _, length in src] == [length for _, length in dst]
    local, remote = regions(0, 100, 8, 1, src, 0), regions(0, 100, 8, 1, dst, 0)
    assert [d[1] for d in local] == [d[1] for d in remote]  # equal lengths, one by one
