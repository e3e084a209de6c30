"""The reference attention's explicit-matmul path (engine/attention_reference.py): the same
attention as PyTorch's SDPA, and what bfloat16 decode rows on the CPU run through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention_reference import _attend, _attend_eager, _eager_is_faster


def inputs(chunks: int, queries: int, keys: int, dtype: torch.dtype, heads: int = 9,
           kv_heads: int = 3, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(chunks, heads, queries, dim, generator=g).to(dtype)
    k = torch.randn(chunks, kv_heads, keys, dim, generator=g).to(dtype)
    v = torch.randn(chunks, kv_heads, keys, dim, generator=g).to(dtype)
    # Each chunk sees a prefix of its keys (a padded group): chunk c its first keys - 7c,
    # its queries the last positions of that prefix, causally.
    ends = torch.tensor([keys - 7 * c for c in range(chunks)])
    query_pos = ends[:, None] - queries + torch.arange(queries)[None, :]
    mask = (torch.arange(keys)[None, None, :] <= query_pos[:, :, None])[:, None]
    return q, k, v, mask


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=0.125, enable_gqa=True)


@pytest.mark.parametrize("chunks,queries,keys", [(16, 1, 130), (1, 1, 33), (3, 5, 40)])
def test_eager_is_sdpa_in_float32(chunks: int, queries: int, keys: int) -> None:
    q, k, v, mask = inputs(chunks, queries, keys, torch.float32)
    torch.testing.assert_close(_attend_eager(q, k, v, mask, 0.125, None), sdpa(q, k, v, mask),
                               atol=1e-5, rtol=1e-5)


def test_eager_is_sdpa_causal_from_key_zero() -> None:
    q, k, v, _ = inputs(1, 24, 24, torch.float32)
    torch.testing.assert_close(_attend_eager(q, k, v, None, 0.125, None),
                               sdpa(q, k, v, None), atol=1e-5, rtol=1e-5)


def test_bfloat16_decode_rows_on_the_cpu_take_the_eager_path_within_bfloat16s_error() -> None:
    q, k, v, mask = inputs(16, 1, 300, torch.bfloat16)
    assert _eager_is_faster(q)
    out = _attend(q, k, v, mask, 0.125, None)
    exact = sdpa(q.float(), k.float(), v.float(), mask)  # the same rounded inputs, in float32
    assert out.dtype == torch.bfloat16
    # The scores and the probabilities are rounded to bfloat16 once each (as transformers'
    # eager attention does): a few bfloat16 ulps of an output of magnitude ~0.1-1.
    assert (out.float() - exact).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype,queries,eager", [(torch.bfloat16, 1, True),
                                                 (torch.bfloat16, 8, False),
                                                 (torch.float32, 1, False)])
def test_only_bfloat16_decode_rows_take_the_eager_path(dtype: torch.dtype, queries: int,
                                                      eager: bool) -> None:
    q, _, _, _ = inputs(2, queries, 16, dtype)
    assert _eager_is_faster(q) is eager
