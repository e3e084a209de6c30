"""The pure policies of engine/mixed_graphs.py: which steps are captured, at what padding."""

from __future__ import annotations

from engine.mixed_graphs import (DEFAULT_DECODE_SIZES, DEFAULT_TOKEN_SIZES, MAX_PREFILL_CHUNKS,
                                 MixedShape, captured_decode_sizes, logits_rows, mixed_token_sizes,
                                 padded_shape)


def test_token_sizes_end_at_the_engines_step_budget():
    assert mixed_token_sizes(512) == DEFAULT_TOKEN_SIZES
    assert mixed_token_sizes(100) == (16, 32, 64, 100)
    assert mixed_token_sizes(16) == (16,)
    assert mixed_token_sizes(2048) == DEFAULT_TOKEN_SIZES  # longer steps stay eager
    assert mixed_token_sizes(1) == ()


def test_a_step_takes_the_smallest_shape_that_holds_it():
    sizes, decodes = DEFAULT_TOKEN_SIZES, DEFAULT_DECODE_SIZES
    assert padded_shape(130, 0, sizes, decodes) == MixedShape(192, 0)
    assert padded_shape(129, 1, sizes, decodes) == MixedShape(192, 4)
    assert padded_shape(200, 65, sizes, decodes) == MixedShape(256, 256)
    # The decode rows alone may need more rows than the tokens: T grows to hold D.
    assert padded_shape(20, 17, sizes, decodes) == MixedShape(64, 64)
    assert padded_shape(512, 100, sizes, decodes) == MixedShape(512, 256)


def test_steps_past_the_largest_shape_have_none():
    sizes, decodes = DEFAULT_TOKEN_SIZES, DEFAULT_DECODE_SIZES
    assert padded_shape(513, 1, sizes, decodes) is None
    assert padded_shape(400, 257, sizes, decodes) is None


def test_the_static_logits_hold_the_largest_decode_rows_and_every_prefill_chunk():
    assert captured_decode_sizes((16, 32)) == (0, 4, 16)
    assert captured_decode_sizes(DEFAULT_TOKEN_SIZES) == DEFAULT_DECODE_SIZES
    assert logits_rows(512) == 256 + MAX_PREFILL_CHUNKS
    assert logits_rows(64) == 16 + MAX_PREFILL_CHUNKS
    assert logits_rows(1) == 0
