"""`--dtype auto`: bf16 only where this machine measures it faster than float32."""

from __future__ import annotations

import re

import torch

from engine.dtype_choice import BF16_MIN_SPEEDUP, choose_dtype, measure_matmul_gflops, resolve_dtype


def test_the_policy_takes_bf16_only_when_it_measures_clearly_faster() -> None:
    assert choose_dtype("cpu", {"float32": 100.0, "bfloat16": 15.0}) == "float32"  # AVX2
    assert choose_dtype("cpu", {"float32": 100.0, "bfloat16": 300.0}) == "bfloat16"  # AMX
    edge = 100.0 * BF16_MIN_SPEEDUP
    assert choose_dtype("cpu", {"float32": 100.0, "bfloat16": edge}) == "bfloat16"
    assert choose_dtype("cpu", {"float32": 100.0, "bfloat16": edge - 0.01}) == "float32"
    assert choose_dtype("cpu", None) == choose_dtype("cpu", {"float32": 0.0}) == "float32"
    assert choose_dtype("cuda:1", None) == "bfloat16"


def test_auto_on_this_cpu_follows_its_own_measurement() -> None:
    chosen, why = resolve_dtype("auto", "cpu")
    assert chosen in ("float32", "bfloat16") and "GFLOP/s" in why
    # The rates it measured are in its reason (whole GFLOP/s): the choice is the policy's
    # over those (a second measurement may differ on a loaded host).
    found = re.search(r"float32 (\d+) GFLOP/s, bfloat16 (\d+) GFLOP/s", why)
    assert found, why
    rates = {"float32": float(found[1]), "bfloat16": float(found[2])}
    assert all(rate > 0 for rate in rates.values())
    ratio = rates["bfloat16"] / rates["float32"]
    if abs(ratio / BF16_MIN_SPEEDUP - 1) > 0.02:  # rounding cannot flip it
        assert chosen == choose_dtype("cpu", rates)
    assert measure_matmul_gflops(torch.float32) > 0
    assert resolve_dtype("float16", "cpu") == ("float16", "as given")
