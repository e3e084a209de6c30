"""The FP8 KV cache's format (engine/kv_quant.py) and its pool (engine/kv_storage.py)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from engine.kv_quant import FP8_MAX, QuantizedCache, dequantize, fp8_block_bytes, quantize
from engine.kv_storage import KVLayout, KVStorage


def test_a_vector_comes_back_within_fp8s_rounding_of_its_largest_value():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    values, scales = quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (64, 4)
    back = dequantize(values, scales, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of the value, at most amax / 16.
    bound = x.abs().amax(dim=-1, keepdim=True) / 16
    assert bool(((back - x).abs() <= bound * 1.0001).all())
    assert torch.allclose(values.float().abs().amax(dim=-1), torch.full((64, 4), FP8_MAX))


def test_a_zero_vector_gets_scale_one_and_zeros():
    values, scales = quantize(torch.zeros(3, 2, 8))
    assert bool((scales == 1).all()) and bool((values.float() == 0).all())


def test_an_fp8_pool_keeps_each_blocks_values_then_scales_in_one_run_of_bytes():
    layout = KVLayout(dtype="fp8_e4m3", num_layers=2, num_blocks=5, block_size=4,
                      num_kv_heads=2, head_dim=8)
    assert layout.block_bytes == fp8_block_bytes(4, 2, 8) == 4 * 2 * (8 + 4)
    storage = KVStorage(layout)
    assert storage.quantized and storage.kv.dtype == torch.uint8
    assert storage.num_bytes == 2 * 2 * 5 * layout.block_bytes
    k, v = storage.layer(1)
    assert isinstance(k, QuantizedCache) and isinstance(v, QuantizedCache)
    assert k.values.shape == (5, 4, 2, 8) and k.scales.shape == (5, 4, 2)
    k.values[3, 2, 1, 5] = 1.0
    v.scales[3, 0, 0] = 2.0
    block = storage.kv[1, 0, 3]  # layer 1, K, block 3: values [slot, head, dim], then scales
    assert block[(2 * 2 + 1) * 8 + 5] == 0x38  # 1.0 in e4m3
    assert storage.kv[1, 1, 3, 64:68].view(torch.float32).item() == 2.0
    assert int(storage.kv.count_nonzero()) == 1 + 1  # 2.0f is 00 00 00 40: one byte


@pytest.mark.parametrize("head_dim, at_least", [(64, 1.88), (128, 1.93)])
def test_an_fp8_pool_holds_nearly_twice_the_blocks_of_bf16(head_dim, at_least):
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=512,
                         intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=2,
                         head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    budget = 1 << 30
    bf16 = EngineConfig.blocks_for_bytes(config, budget, 16, torch.bfloat16)
    fp8 = EngineConfig.blocks_for_bytes(config, budget, 16, torch.float8_e4m3fn)
    assert at_least <= fp8 / bf16 < 2


def test_a_kv_dtype_outside_the_four_is_refused():
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype=torch.int8)


def test_pools_of_two_kv_dtypes_refuse_each_other_naming_both():
    fields = dict(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8)
    fp8, bf16 = KVLayout(dtype="fp8_e4m3", **fields), KVLayout(dtype="bfloat16", **fields)
    assert fp8.compatible_with(bf16) == "dtype fp8_e4m3 here, bfloat16 at the peer"
    assert fp8.compatible_with(KVLayout(dtype="fp8_e4m3", **{**fields, "num_blocks": 9})) \
        is None
