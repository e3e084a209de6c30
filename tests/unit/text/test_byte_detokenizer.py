"""Byte-level streaming (text/byte_detokenizer.py, text/token_bytes.py) with the real
SmolLM2 vocabulary, against the tokenizer's own decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models

from tests.unit.text.test_detokenizer import BYTE_IDS, SPECIAL_IDS, TOK, byte_ids, mixed_ids
from text.byte_detokenizer import ByteDetokenizer
from text.detokenizer import IncrementalDetokenizer, new_detokenizer
from text.token_bytes import TokenBytes

TABLE = TOK.token_bytes()


def run(ids: list[int]) -> list[str]:
    assert TABLE is not None
    detok = ByteDetokenizer(TABLE)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        detok.check_invariants()
    deltas.append(detok.flush())
    detok.check_invariants()
    return deltas


def test_a_byte_level_vocabulary_gets_a_table_that_the_engine_uses() -> None:
    assert TABLE is not None and len(TABLE) == TOK.vocab_size
    assert TOK.token_bytes() is TABLE  # built once
    assert isinstance(new_detokenizer(TOK, TOK.encode("hi")), ByteDetokenizer)
    assert TABLE.table[SPECIAL_IDS[1]] == b""  # <|im_start|>: skipped, as a decode skips it


token_ids = st.one_of(
    st.integers(min_value=0, max_value=TOK.vocab_size - 1),
    st.sampled_from([i for b, i in BYTE_IDS.items() if b >= 0x80]),  # lone lead/continuation
    st.sampled_from(SPECIAL_IDS),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(token_ids, max_size=40))
def test_deltas_concatenate_to_the_tokenizers_decode(ids: list[int]) -> None:
    assert "".join(run(ids)) == TOK.decode(ids) == TABLE.text(ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("aé中🤖ß€ \n𝄞Ω"), max_size=30),
       mixed=st.lists(st.booleans(), max_size=30))
def test_split_characters_are_never_emitted_broken(text: str, mixed: list[bool]) -> None:
    deltas = run(mixed_ids(text, mixed))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(token_ids, max_size=30))
def test_the_window_decode_streams_the_same_text(ids: list[int]) -> None:
    window = IncrementalDetokenizer(TOK, [])
    text = "".join(window.add(i) for i in ids) + window.flush()
    assert "".join(run(ids)) == text


def test_each_character_appears_once_complete() -> None:
    deltas = run(byte_ids("é中🤖"))
    assert [d for d in deltas if d] == ["é", "中", "🤖"]
    assert deltas[:2] == ["", "é"]  # the lead byte alone emits nothing


def test_invalid_bytes_come_out_as_soon_as_they_are_known_invalid() -> None:
    ids = [BYTE_IDS[0xE4], *TOK.encode("A"), BYTE_IDS[0x80], BYTE_IDS[0xF0]]
    deltas = run(ids)
    assert "".join(deltas) == TOK.decode(ids) == "\ufffdA\ufffd\ufffd"
    # A lone continuation byte is invalid at once; a lead byte waits for its followers.
    assert deltas == ["", "\ufffdA", "\ufffd", "", "\ufffd"]


def test_ids_past_the_vocabulary_have_no_text() -> None:
    assert run([*TOK.encode("ok"), TOK.vocab_size + 5]) == ["ok", "", ""]


def test_misuse_raises() -> None:
    assert TABLE is not None
    detok = ByteDetokenizer(TABLE)
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add(5)
    with pytest.raises(RuntimeError):
        detok.flush()


def test_a_decoder_that_is_not_plain_byte_level_keeps_the_window_decode() -> None:
    """A SentencePiece-style decoder (space marker, byte fallback) gets no table."""
    vocab = {"<unk>": 0, "▁hi": 1, "<0xE4>": 2}
    backend = RustTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    assert TokenBytes.try_build(backend) is None
