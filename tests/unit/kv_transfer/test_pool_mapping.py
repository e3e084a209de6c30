"""Mapping a host pool through its memfd, and every refusal of pool_mapping.open_pool."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.kv_storage import KVLayout, KVStorage
from kv_transfer.outbound import _ranges
from kv_transfer.pool_mapping import MappingUnavailable, PoolExport, export_pool, open_pool

LAYOUT = KVLayout(dtype="bfloat16", num_layers=2, num_blocks=8, block_size=4,
                  num_kv_heads=2, head_dim=8)


def test_a_mapped_host_pool_is_the_same_memory():
    storage = KVStorage(LAYOUT)
    assert storage.host_file is not None  # host pools live in a memfd on Linux
    export = export_pool(storage)
    assert export is not None and export.kind == "memfd"
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(export), type=PoolExport)
    mapped = open_pool(wire, LAYOUT, torch.zeros(1))
    assert mapped.tensor.shape == storage.kv.shape
    mapped.tensor[1, 0, 3].fill_(2.5)
    assert torch.all(storage.kv[1, 0, 3] == 2.5) and storage.kv.sum() == 2.5 * 64
    mapped.close()
    with pytest.raises(RuntimeError, match="closed"):
        mapped.tensor


@pytest.mark.parametrize("change, reason", [
    (dict(host_id="another-boot"), "another host"),
    (dict(name="pdserve-kv-someone-else"), "not the receiver's pool"),
    (dict(fd=9999), "cannot open"),
    (dict(num_bytes=12), "the layout says"),
])
def test_refusals_say_why(change, reason):
    storage = KVStorage(LAYOUT)
    export = msgspec.structs.replace(export_pool(storage), **change)
    with pytest.raises(MappingUnavailable, match=reason):
        open_pool(export, LAYOUT, torch.zeros(1))


def test_a_gpu_export_needs_a_gpu_pool_here():
    export = msgspec.structs.replace(export_pool(KVStorage(LAYOUT)), kind="cuda_ipc")
    with pytest.raises(MappingUnavailable, match="GPU pool cannot take copies"):
        open_pool(export, LAYOUT, torch.zeros(1))


def test_layers_group_into_ranges():
    assert _ranges([0, 1, 2, 5, 7, 8]) == [range(0, 3), range(5, 6), range(7, 9)]
    assert _ranges([]) == []
