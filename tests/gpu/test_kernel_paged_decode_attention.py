"""paged_decode_attention: Triton (single pass and split-K) against the torch reference, and
the reference against dense attention over the unpaged sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.paged_decode_attention import (SPLIT_COUNTS, num_decode_splits,
                                                   paged_decode_attention,
                                                   paged_decode_attention_reference,
                                                   paged_decode_attention_triton)

pytestmark = pytest.mark.timeout(120)
BLOCK_SIZE = 16


def _paged_batch(device, dtype, num_heads, num_kv_heads, head_dim, context_lens, seed=0):
    """Random caches, shuffled (non-contiguous) block tables, one query per sequence."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(1, max(-(-n // BLOCK_SIZE) for n in context_lens))
    num_blocks = len(context_lens) * max_blocks + 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    k_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    v_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    ids = torch.randperm(num_blocks, generator=gen)[:len(context_lens) * max_blocks]
    block_tables = ids.view(len(context_lens), max_blocks).to(torch.int32).to(device)
    q = randn(len(context_lens), num_heads, head_dim)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens


SHAPES = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M, Llama-3-8B
CONTEXTS = [1, 15, 16, 17, 70, 0, 200]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_matches_reference(target, num_heads, num_kv_heads, head_dim, num_splits):
    q, k_cache, v_cache, tables, lens = _paged_batch(
        target.device, target.dtype, num_heads, num_kv_heads, head_dim, CONTEXTS)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale,
                                  num_splits=num_splits, out=out)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)
    assert torch.equal(out[CONTEXTS.index(0)], torch.zeros_like(out[0]))  # padding row


def fp8_caches(k_cache, v_cache):
    """The same keys and values stored as an FP8 pool would (engine/kv_quant.py)."""
    from engine.kv_quant import QuantizedCache, quantize

    return QuantizedCache(*quantize(k_cache)), QuantizedCache(*quantize(v_cache))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         SHAPES if torch.cuda.is_available() else SHAPES[:1])  # interpreter: CI time
@pytest.mark.parametrize("num_splits", [1, 3])
def test_an_fp8_cache_is_read_as_the_reference_reads_it(target, num_heads, num_kv_heads,
                                                        head_dim, num_splits):
    q, k_cache, v_cache, tables, lens = _paged_batch(
        target.device, target.dtype, num_heads, num_kv_heads, head_dim, CONTEXTS)
    k8, v8 = fp8_caches(k_cache, v_cache)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_triton(q, k8, v8, tables, lens, scale, num_splits=num_splits,
                                  out=out)
    expected = paged_decode_attention_reference(q, k8, v8, tables, lens, scale)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)
    # And the FP8 answer is near the unquantized one: one stored value is off by up to 1/16
    # of its vector's largest (~3 here), and the output is a weighted mean of values.
    exact = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
    assert float((out.float() - exact.float()).abs().max()) < 0.25
    assert torch.equal(out[CONTEXTS.index(0)], torch.zeros_like(out[0]))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_softcap_and_window_match_reference(target, num_splits):
    """Gemma 2's options: scores squashed by 2 * tanh(s / 2) (a cap that bites on these
    random scores), keys older than the last 20 positions hidden; contexts shorter and
    longer than the window, and the padding row."""
    q, k_cache, v_cache, tables, lens = _paged_batch(
        target.device, target.dtype, 8, 2, 64, CONTEXTS, seed=4)
    options = dict(softcap=2.0, window=20)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.125,
                                  num_splits=num_splits, out=out, **options)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125,
                                                **options)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)
    plain = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.125)
    assert not torch.allclose(expected, plain, atol=1e-2)  # the options change the result
    # The window hides exactly the keys before the last 20: a sequence of 70 positions
    # attends like one of its own last 20 positions.
    row = CONTEXTS.index(70)
    last = torch.arange(50, 70)
    table = tables[row].long().cpu()
    slots = (table[last // BLOCK_SIZE] * BLOCK_SIZE + last % BLOCK_SIZE).to(k_cache.device)
    keys = k_cache.view(-1, 2, 64)[slots].float().repeat_interleave(4, dim=1)
    values = v_cache.view(-1, 2, 64)[slots].float().repeat_interleave(4, dim=1)
    scores = torch.einsum("hd,phd->hp", q[row].float(), keys) * 0.125
    probs = torch.softmax(torch.tanh(scores / 2.0) * 2.0, dim=-1)
    dense = torch.einsum("hp,phd->hd", probs, values)
    # The reference returns q's dtype: compare at that dtype's tolerance.
    torch.testing.assert_close(expected[row].float(), dense, atol=target.atol, rtol=target.rtol)


def test_long_context_split_k_on_cuda(target, on_cuda):
    if not on_cuda:
        pytest.skip("a 4k-token context is minutes under the interpreter")
    q, k_cache, v_cache, tables, lens = _paged_batch(
        target.device, target.dtype, 32, 8, 128, [4000, 1, 2048, 777])
    splits = num_decode_splits(4, 8, tables.shape[1] * BLOCK_SIZE,
                               torch.cuda.get_device_properties(0).multi_processor_count)
    assert splits > 1
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 128 ** -0.5)
    expected = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 128 ** -0.5)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


def test_reference_equals_dense_attention_over_unpaged_sequences():
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    contexts = [5, 33]
    q, k_cache, v_cache, tables, lens = _paged_batch(
        "cpu", torch.float32, num_heads, num_kv_heads, head_dim, contexts, seed=4)
    out = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, 0.3)
    for i, n in enumerate(contexts):
        positions = torch.arange(n)
        blocks = tables[i, positions // BLOCK_SIZE].long()
        keys = k_cache[blocks, positions % BLOCK_SIZE].transpose(0, 1)  # [kv_heads, n, dim]
        values = v_cache[blocks, positions % BLOCK_SIZE].transpose(0, 1)
        dense = F.scaled_dot_product_attention(q[i][:, None, :], keys, values, scale=0.3,
                                               enable_gqa=True)
        torch.testing.assert_close(out[i], dense[:, 0, :], atol=1e-5, rtol=1e-5)


def test_split_policy():
    # Small batch, long context: split up to the SM count; never below 128 tokens a split.
    assert num_decode_splits(1, 8, 4096, 132) == 32
    assert num_decode_splits(1, 8, 512, 132) == 4
    assert num_decode_splits(256, 8, 4096, 132) == 1
    assert num_decode_splits(1, 8, 16, 132) == 1
    # 16 sequences x 8 KV heads want ceil(264 / 128) = 3 splits: a power of two, 2.
    assert num_decode_splits(16, 8, 4096, 132) == 2
    assert all(num_decode_splits(n, 8, c, 132) in SPLIT_COUNTS
               for n in range(1, 300, 7) for c in (16, 300, 2048, 9000))
