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


def _fp8_storage(target, num_kv_heads, head_dim, num_blocks=12, block_size=16):
    layout = KVLayout(dtype="fp8_e4m3", num_layers=2, num_blocks=num_blocks,
                      block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    storage = KVStorage(layout, target.device)
    g = torch.Generator().manual_seed(1)
    storage.kv.copy_(torch.randint(0, 256, storage.kv.shape, dtype=torch.uint8, generator=g))
    return storage


@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_an_fp8_pool_gets_exactly_the_references_values_and_scales(target, num_kv_heads,
                                                                    head_dim):
    torch.manual_seed(0)
    storage = _fp8_storage(target, num_kv_heads, head_dim)
    before = storage.kv.clone()
    slots = torch.tensor([7 * 16 + 3, 2 * 16, -1, 11 * 16 + 15, 7 * 16 + 4],
                         device=target.device)
    k = target.randn(5, num_kv_heads, head_dim) * 30
    v = target.randn(5, num_kv_heads, head_dim)
    k[1, 0] = 0.0  # an all-zero head vector: scale 1
    write_kv_cache_triton_(k, v, *storage.layer(1), slots)
    expected = KVStorage(storage.layout, target.device)
    expected.kv.copy_(before)
    write_kv_cache_reference_(k, v, *expected.layer(1), slots)
    assert torch.equal(storage.kv, expected.kv)  # values and scales, bit for bit
    k_cache, _ = storage.layer(1)
    assert float(k_cache.scales[2, 0, 0]) == 1.0
    changed = (storage.kv != before).view(2, 2, 12, -1).any(dim=-1)  # [layer, kv, block]
    assert changed[1].sum() == 2 * 3 and not changed[0].any()  # blocks 7, 2, 11 of layer 1


def test_fp8_rounding_is_torchs_on_every_kind_of_value(target):
    """Head vectors whose largest value is 448 get scale 1, so the stored values are the
    rounding alone: normal and subnormal values, exact midpoints (ties to even) and values
    that carry into the next power of two, against torch's conversion."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    midpoints = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(2)
    spread = torch.exp2(torch.rand(512, generator=g) * 20 - 12) * 448 / 2 ** 8
    values = torch.cat([grid, midpoints, spread, grid * 0.999, grid * 1.001]).clamp(max=447)
    values = values * torch.where(torch.rand(values.numel(), generator=g) < 0.5, -1.0, 1.0)
    head_dim = 64
    rows = -(-values.numel() // (head_dim - 1))
    k = torch.zeros(rows * (head_dim - 1))
    k[:values.numel()] = values
    k = torch.cat([torch.full((rows, 1), 448.0), k.view(rows, head_dim - 1)], dim=1)
    k = k.view(rows, 1, head_dim).to(target.device, torch.float32)
    layout = KVLayout(dtype="fp8_e4m3", num_layers=1, num_blocks=-(-rows // 16),
                      block_size=16, num_kv_heads=1, head_dim=head_dim)
    storage = KVStorage(layout, target.device)
    k_cache, v_cache = storage.layer(0)
    write_kv_cache_triton_(k, k.clone(), k_cache, v_cache, torch.arange(rows,
                                                                        device=target.device))
    stored = k_cache.values.reshape(-1, head_dim)[:rows]
    assert bool((k_cache.scales.reshape(-1)[:rows] == 1.0).all())
    assert torch.equal(stored.view(torch.uint8), k.view(rows, head_dim).to(
        torch.float8_e4m3fn).view(torch.uint8))
