"""The host copies of a mapped transfer: the inline (numpy) copy writes exactly what the
threaded (torch) one writes, for every pool dtype, and only small copies run inline."""

import pytest
import torch

from kv_transfer.layout import plan_runs
from kv_transfer.mapped_copy import (INLINE_COPY_BYTES, _as_numpy, copies_inline, copy_runs,
                                     copy_runs_inline)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_inline_copy_writes_what_the_threaded_one_does(dtype) -> None:
    shape = (4, 2, 12, 4, 2, 8)  # [layer, K|V, block, slot, head, dim]
    src = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    runs = plan_runs([0, 1, 2, 7, 5], [9, 10, 11, 3, 0])
    want = torch.full(shape, -7.0).to(dtype)
    got = want.clone()
    copy_runs(src, want, runs, range(1, 3))
    copy_runs_inline(_as_numpy(src), _as_numpy(got), runs, range(1, 3))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got[0], torch.full(shape[1:], -7.0).to(dtype))  # layer 0 untouched


def test_only_small_copies_run_on_the_loop() -> None:
    assert copies_inline(1) and copies_inline(INLINE_COPY_BYTES)
    assert not copies_inline(INLINE_COPY_BYTES + 1)


@pytest.mark.parametrize("inline_bytes", [0, 1 << 30], ids=["copy_thread", "inline"])
def test_a_host_mapped_copy_lands_bitwise_on_either_path(monkeypatch, inline_bytes) -> None:
    """MappedCopy.copy on the host, forced onto each path (the real sizes decide in use)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from kv_transfer import mapped_copy
    from kv_transfer.interface import TransferSpec

    monkeypatch.setattr(mapped_copy, "INLINE_COPY_BYTES", inline_bytes)
    shape = (3, 2, 10, 4, 2, 8)
    src = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    dst = torch.zeros(shape, dtype=torch.bfloat16)
    spec = TransferSpec(request_id="r", src_block_ids=[1, 2, 6], dst_block_ids=[7, 8, 0],
                        layer_begin=0, layer_end=3)
    executor = ThreadPoolExecutor(1, thread_name_prefix="kv-copy-test")
    calls = []
    real_copy_runs = mapped_copy.copy_runs
    monkeypatch.setattr(mapped_copy, "copy_runs",
                        lambda *a: (calls.append("thread"), real_copy_runs(*a)))
    try:
        copy = mapped_copy.MappedCopy(spec, src, dst,
                                      mapped_copy.CopyContext(torch.device("cpu"), executor))
        asyncio.run(copy.copy(range(0, 2)))
        asyncio.run(copy.copy(range(2, 3)))
    finally:
        executor.shutdown(wait=True)
    assert calls == (["thread", "thread"] if inline_bytes == 0 else [])
    for s, d in zip(spec.src_block_ids, spec.dst_block_ids):
        assert torch.equal(dst[:, :, d].view(torch.int16), src[:, :, s].view(torch.int16))
    untouched = [b for b in range(shape[2]) if b not in spec.dst_block_ids]
    assert not torch.count_nonzero(dst[:, :, untouched].view(torch.int16))
