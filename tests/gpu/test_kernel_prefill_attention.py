"""prefill_attention: chunked prefill over a cached prefix, against the torch reference,
against dense causal attention, and against decode attention for one-token chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.kv_cache_write import write_kv_cache_
from engine.kernels.paged_decode_attention import paged_decode_attention_reference
from engine.kernels.prefill_attention import (prefill_attention, prefill_attention_reference,
                                              prefill_attention_triton)

pytestmark = pytest.mark.timeout(120)
BLOCK_SIZE = 16


class ChunkedBatch:
    """Whole sequences of random K/V and queries, of which the prefix is already in a paged
    cache and the chunk is written this step, the way the model runner does it."""

    def __init__(self, device, dtype, num_heads, num_kv_heads, head_dim,
                 chunks: list[tuple[int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device, dtype)

        self.chunks = chunks  # (start_pos, chunk_len) per sequence
        lengths = [start + n for start, n in chunks]
        max_blocks = max(-(-n // BLOCK_SIZE) for n in lengths)
        num_blocks = len(chunks) * max_blocks + 2
        ids = torch.randperm(num_blocks, generator=gen)[:len(chunks) * max_blocks]
        self.block_tables = ids.view(len(chunks), max_blocks).to(torch.int32).to(device)
        self.k_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.v_cache = randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.full_q = [randn(n, num_heads, head_dim) for n in lengths]
        self.full_k = [randn(n, num_kv_heads, head_dim) for n in lengths]
        self.full_v = [randn(n, num_kv_heads, head_dim) for n in lengths]
        self.context_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        cu = [0]
        for _, n in chunks:
            cu.append(cu[-1] + n)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
        self.max_query_len = max(n for _, n in chunks)
        self.q = torch.cat([q[start:] for q, (start, _) in zip(self.full_q, chunks)])
        # The prefix is in the cache from earlier steps; the chunk is written now.
        self._write(prefix=True)
        self._write(prefix=False)

    def _slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        table = self.block_tables[seq].long().cpu()
        return table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE

    def _write(self, prefix: bool) -> None:
        slots, ks, vs = [], [], []
        for seq, (start, n) in enumerate(self.chunks):
            lo, hi = (0, start) if prefix else (start, start + n)
            slots.append(self._slots(seq, torch.arange(lo, hi)))
            ks.append(self.full_k[seq][lo:hi])
            vs.append(self.full_v[seq][lo:hi])
        device = self.k_cache.device
        write_kv_cache_(torch.cat(ks), torch.cat(vs), self.k_cache, self.v_cache,
                        torch.cat(slots).to(device))

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.cu_seqlens_q,
                self.context_lens)


SHAPES = [(9, 3, 64), (32, 8, 128)]  # SmolLM2-135M, Llama-3-8B
# (cached prefix, chunk): fresh prompts, chunks after a prefix, a one-token chunk, and chunks
# that start and end mid-block.
CHUNKS = [(0, 5), (16, 17), (33, 1), (7, 25)]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", SHAPES)
def test_triton_matches_reference(target, num_heads, num_kv_heads, head_dim):
    batch = ChunkedBatch(target.device, target.dtype, num_heads, num_kv_heads, head_dim, CHUNKS)
    scale = head_dim ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    prefill_attention_triton(*batch.args(), scale, batch.max_query_len, out=out)
    expected = prefill_attention_reference(*batch.args(), scale)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         SHAPES if torch.cuda.is_available() else SHAPES[:1])  # interpreter: CI time
def test_an_fp8_cache_is_read_as_the_reference_reads_it(target, num_heads, num_kv_heads,
                                                        head_dim):
    from engine.kv_quant import QuantizedCache, quantize

    batch = ChunkedBatch(target.device, target.dtype, num_heads, num_kv_heads, head_dim, CHUNKS)
    k8, v8 = QuantizedCache(*quantize(batch.k_cache)), QuantizedCache(*quantize(batch.v_cache))
    args = (batch.q, k8, v8, *batch.args()[3:])
    scale = head_dim ** -0.5
    out = torch.full_like(batch.q, float("nan"))
    prefill_attention_triton(*args, scale, batch.max_query_len, out=out)
    torch.testing.assert_close(out, prefill_attention_reference(*args, scale),
                               atol=target.atol, rtol=target.rtol)
    exact = prefill_attention_reference(*batch.args(), scale)
    assert float((out.float() - exact.float()).abs().max()) < 0.25  # see the decode test


def test_softcap_and_window_match_reference(target):
    """Gemma 2's options: a cap that bites on these random scores, and a window of 20,
    shorter than most chunks and prefixes here (and not a multiple of any tile)."""
    batch = ChunkedBatch(target.device, target.dtype, 8, 2, 64, CHUNKS, seed=5)
    options = dict(softcap=2.0, window=20)
    out = torch.full_like(batch.q, float("nan"))
    prefill_attention_triton(*batch.args(), 0.125, batch.max_query_len, out=out, **options)
    expected = prefill_attention_reference(*batch.args(), 0.125, **options)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)
    plain = prefill_attention_reference(*batch.args(), 0.125)
    assert not torch.allclose(expected, plain, atol=1e-2)


def test_windowed_reference_equals_dense_attention_with_a_band_mask():
    batch = ChunkedBatch("cpu", torch.float32, 6, 2, 32, [(0, 9), (20, 13)], seed=2)
    out = prefill_attention_reference(*batch.args(), 0.25, window=5)
    offset = 0
    for seq, (start, n) in enumerate(batch.chunks):
        q = batch.full_q[seq].transpose(0, 1)
        k, v = batch.full_k[seq].transpose(0, 1), batch.full_v[seq].transpose(0, 1)
        pos = torch.arange(start + n)
        band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 5)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=band, scale=0.25,
                                               enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[offset:offset + n], dense[start:], atol=1e-5, rtol=1e-5)
        offset += n


def test_long_prompt_on_cuda(target, on_cuda):
    if not on_cuda:
        pytest.skip("a 2k-token prompt is minutes under the interpreter")
    batch = ChunkedBatch(target.device, target.dtype, 32, 8, 128,
                         [(0, 2048), (1500, 548), (3000, 100)])
    out = prefill_attention(*batch.args(), 128 ** -0.5, batch.max_query_len)
    expected = prefill_attention_reference(*batch.args(), 128 ** -0.5)
    torch.testing.assert_close(out, expected, atol=target.atol, rtol=target.rtol)


def test_reference_equals_dense_causal_attention_on_the_whole_sequence():
    batch = ChunkedBatch("cpu", torch.float32, 6, 2, 32, [(0, 9), (20, 13)], seed=2)
    out = prefill_attention_reference(*batch.args(), 0.25)
    offset = 0
    for seq, (start, n) in enumerate(batch.chunks):
        q = batch.full_q[seq].transpose(0, 1)  # [heads, positions, dim]
        k, v = batch.full_k[seq].transpose(0, 1), batch.full_v[seq].transpose(0, 1)
        dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25,
                                               enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[offset:offset + n], dense[start:], atol=1e-5, rtol=1e-5)
        offset += n


def test_one_token_chunks_equal_decode_attention(target):
    batch = ChunkedBatch(target.device, target.dtype, 9, 3, 64, [(30, 1), (0, 1), (64, 1)])
    out = prefill_attention_triton(*batch.args(), 0.125, batch.max_query_len)
    decode = paged_decode_attention_reference(batch.q, batch.k_cache, batch.v_cache,
                                              batch.block_tables, batch.context_lens, 0.125)
    torch.testing.assert_close(out, decode, atol=target.atol, rtol=target.rtol)
