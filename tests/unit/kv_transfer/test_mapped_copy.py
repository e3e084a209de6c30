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
