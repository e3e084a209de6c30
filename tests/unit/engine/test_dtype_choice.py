"""`--dtype auto`: bf16 only where this machine measures it faster than float32."""

from __future__ import annotations

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
    rates = {name: measure_matmul_gflops(getattr(torch, name)) for name in ("float32", "bfloat16")}
    assert all(rate > 0 for rate in rates.values())
    # Far from the threshold the decision cannot flip between two measurements.
    ratio = rates["bfloat16"] / rates["float32"]
    if not 0.8 * BF16_MIN_SPEEDUP < ratio < 1.25 * BF16_MIN_SPEEDUP:
        assert chosen == choose_dtype("cpu", rates)
    assert resolve_dtype("float16", "cpu") == ("float16", "as given")
