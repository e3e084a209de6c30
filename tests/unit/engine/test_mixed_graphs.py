"""The pure policies of engine/mixed_graphs.py: which steps are captured, at what padding."""

from __future__ import annotations

from engine.cuda_graphs import DEFAULT_BATCH_SIZES, decode_batch_sizes
from engine.mixed_graphs import (DEFAULT_DECODE_SIZES, DEFAULT_TOKEN_SIZES, MAX_PREFILL_CHUNKS,
                                 MixedShape, captured_decode_sizes, logits_rows,
                                 mixed_decode_sizes, mixed_prefill_chunks, mixed_token_sizes,
                                 padded_shape)


def test_token_sizes_end_at_the_engines_step_budget():
    assert mixed_token_sizes(512) == DEFAULT_TOKEN_SIZES
    assert mixed_token_sizes(100) == (16, 32, 64, 100)
    assert mixed_token_sizes(16) == (16,)
    assert mixed_token_sizes(1) == ()


def test_a_budget_past_512_tokens_is_captured_too_up_to_4096():
    assert mixed_token_sizes(2048) == DEFAULT_TOKEN_SIZES + (
        640, 768, 896, 1024, 1280, 1536, 1792, 2048)
    assert mixed_token_sizes(700) == DEFAULT_TOKEN_SIZES + (640, 700)
    assert mixed_token_sizes(1100) == DEFAULT_TOKEN_SIZES + (640, 768, 896, 1024, 1100)
    assert mixed_token_sizes(10_000)[-1] == 4096  # longer steps stay eager
    # Each holds a prefill chunk per 64 tokens past 512 (short prompts fill a long step).
    assert [mixed_prefill_chunks(t) for t in (64, 512, 1024, 2048, 10_000)] == [8, 8, 16, 32, 32]


def test_decode_batches_past_256_seats_are_captured_up_to_1024():
    assert decode_batch_sizes(64) == decode_batch_sizes(256) == DEFAULT_BATCH_SIZES
    assert decode_batch_sizes(512) == DEFAULT_BATCH_SIZES + (320, 384, 448, 512)
    assert decode_batch_sizes(300) == DEFAULT_BATCH_SIZES + (300,)
    assert decode_batch_sizes(5000)[-1] == 1024
    assert mixed_decode_sizes(512) == DEFAULT_DECODE_SIZES + (512,)
    assert mixed_decode_sizes(128) == DEFAULT_DECODE_SIZES
    assert padded_shape(2000, 400, mixed_token_sizes(2048), mixed_decode_sizes(512)) == \
        MixedShape(2048, 512)


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
    assert logits_rows(2048, 512) == 512 + 32
