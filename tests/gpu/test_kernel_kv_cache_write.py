"""write_kv_cache_: scatter into one layer of a real KVStorage pool."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_cache_write import (write_kv_cache_, write_kv_cache_reference_,
                                           write_kv_cache_triton_)
from engine.kv_storage import DTYPE_NAMES, KVLayout, KVStorage

pytestmark = pytest.mark.timeout(60)


def _storage(target, num_kv_heads, head_dim, num_blocks=12, block_size=16):
    layout = KVLayout(dtype=DTYPE_NAMES[target.dtype], num_layers=2, num_blocks=num_blocks,
                      block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    storage = KVStorage(layout, target.device)
    storage.kv.copy_(torch.randn(storage.kv.shape))
    return storage


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_writes_exactly_the_mapped_slots(target, num_kv_heads, head_dim):
    torch.manual_seed(0)
    storage = _storage(target, num_kv_heads, head_dim)
    before = storage.kv.clone()
    # Slots in blocks 7, 2 and 11, out of order; one padding token (-1) is skipped.
    slots = torch.tensor([7 * 16 + 3, 2 * 16, -1, 11 * 16 + 15, 7 * 16 + 4],
                         device=target.device)
    k = target.randn(5, num_kv_heads, head_dim)
    v = target.randn(5, num_kv_heads, head_dim)
    k_cache, v_cache = storage.layer(1)
    write_kv_cache_triton_(k, v, k_cache, v_cache, slots)

    expected = before.clone()
    write_kv_cache_reference_(k, v, *(expected[1, i] for i in range(2)), slots)
    assert torch.equal(storage.kv, expected)
    assert torch.equal(storage.kv[1, 0, 11, 15], k[3])
    assert torch.equal(storage.kv[1, 1, 2, 0], v[1])
    changed = (storage.kv != before).any(dim=(-1, -2))  # [layer, kv, block, slot]
    assert int(changed.sum()) == 2 * 4  # 4 live tokens, K and V, nothing else


def test_dispatch_uses_the_torch_path_off_cuda():
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    write_kv_cache_(k, v, k_cache, v_cache, torch.tensor([17, 63]))
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[3, 15], v[1])
