"""benchmarks/block_copy.py: every kernel variant it times copies exactly the reference's
bytes (through Triton's interpreter here), and its check notices a wrong copy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.block_copy import check, main, pools, variants  # noqa: E402


def test_the_check_catches_a_copy_to_the_wrong_blocks() -> None:
    src, dst, src_ids, dst_ids = pools(4, torch.device("cpu"))
    shipped = variants(src, dst, src_ids, dst_ids, num_sms=2, quick=True)["shipped"]
    assert check(shipped, src, dst, src_ids, dst_ids)
    assert not check(shipped, src, dst, src_ids, dst_ids.flip(0))


def test_every_quick_variant_matches_the_reference(capsys) -> None:
    assert main(["--check-only", "--quick"]) == 0
    assert "every variant copies exactly" in capsys.readouterr().out
