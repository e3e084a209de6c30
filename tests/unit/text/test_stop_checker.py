"""Stop rules: tokens, lengths, and stop strings split over streamed pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.finish_reason import FinishReason
from protocol.sampling_params import SamplingParams
from text.stop_checker import StopCheck, check_stop, find_stop_string

EOS = 2


def stream(pieces: list[str], params: SamplingParams, token_ids: list[int] | None = None):
    """Feeds one piece of text per token like the engine does; returns (streamed, check)."""
    token_ids = token_ids or [100 + i for i in range(len(pieces))]
    text, emitted, streamed = "", 0, []
    check = StopCheck(None, None, 0)
    for n, (token_id, piece) in enumerate(zip(token_ids, pieces), start=1):
        text += piece
        check = check_stop(params, (EOS,), token_ids[:n], text, len(piece))
        assert check.emit_end >= emitted or check.finished  # streamed text is never retracted
        if check.finished and check.finish_reason is FinishReason.STOP and isinstance(check.stop_reason, str):
            streamed.append(text[emitted:check.emit_end])
            return "".join(streamed), check
        streamed.append(text[emitted:check.emit_end])
        emitted = max(emitted, check.emit_end)
        if check.finished:
            break
    return "".join(streamed), check


def test_stop_string_split_across_tokens_is_caught_and_not_emitted() -> None:
    params = SamplingParams(max_tokens=50, stop=("STOP",))
    out, check = stream(["Hello ", "S", "T", "OP", " never"], params)
    assert out == "Hello "
    assert check.finish_reason is FinishReason.STOP and check.stop_reason == "STOP"


def test_include_stop_str_in_output() -> None:
    params = SamplingParams(max_tokens=50, stop=("STOP",), include_stop_str_in_output=True)
    out, check = stream(["Hello ", "ST", "OP!"], params)
    assert out == "Hello STOP"
    assert check.emit_end == len("Hello STOP")


def test_partial_prefix_is_held_then_released_when_disambiguated() -> None:
    params = SamplingParams(max_tokens=50, stop=("world",))
    text = "Hello wor"
    check = check_stop(params, (EOS,), [5, 6], text, 3)
    assert not check.finished and check.emit_end == len("Hello ")  # "wor" held
    check = check_stop(params, (EOS,), [5, 6, 7], text + "m", 1)
    assert not check.finished and check.emit_end == len("Hello worm")


def test_the_stop_string_completing_first_wins() -> None:
    # "b" completes before "abcdef" although "abcdef" starts earlier: a stream cut after
    # "xxab" would already have stopped at "b", so a single piece must agree.
    params = SamplingParams(max_tokens=50, stop=("cd", "abcdef", "b"))
    check = check_stop(params, (EOS,), [1], "xxabcdef", 8)
    assert check.stop_reason == "b" and check.emit_end == 3
    params = SamplingParams(max_tokens=50, stop=("bc", "abc"))  # same end: the longer one
    assert check_stop(params, (EOS,), [1], "xabcd", 5).stop_reason == "abc"


def test_held_text_released_on_length() -> None:
    params = SamplingParams(max_tokens=2, stop=("world",))
    out, check = stream(["Hello ", "wor"], params)
    assert check.finish_reason is FinishReason.LENGTH and out == "Hello wor"


def test_eos_stops_unless_ignored() -> None:
    check = check_stop(SamplingParams(max_tokens=10), (EOS,), [5, EOS], "ab", 0)
    assert check.finish_reason is FinishReason.STOP and check.stop_reason == EOS
    check = check_stop(SamplingParams(max_tokens=10, ignore_eos=True), (EOS,), [5, EOS], "ab", 0)
    assert not check.finished


def test_stop_token_ids() -> None:
    params = SamplingParams(max_tokens=10, stop_token_ids=(42,))
    check = check_stop(params, (EOS,), [1, 42], "x", 0)
    assert check.finish_reason is FinishReason.STOP and check.stop_reason == 42


def test_max_tokens_is_length() -> None:
    params = SamplingParams(max_tokens=3)
    assert not check_stop(params, (EOS,), [1, 1], "aa", 1).finished
    check = check_stop(params, (EOS,), [1, 1, 1], "aaa", 1)
    assert check.finish_reason is FinishReason.LENGTH and check.emit_end == 3


def test_min_tokens_suppresses_every_stop_rule() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, stop=("x",), stop_token_ids=(42,))
    assert not check_stop(params, (EOS,), [EOS], "", 0).finished
    assert not check_stop(params, (EOS,), [5, 42], "", 0).finished
    assert not check_stop(params, (EOS,), [5, 6], "ax", 2).finished
    # From min_tokens on, rules apply again.
    assert check_stop(params, (EOS,), [5, 6, EOS], "ax", 0).finish_reason is FinishReason.STOP
    check = check_stop(params, (EOS,), [5, 6, 7], "axbx", 2)
    assert check.stop_reason == "x" and check.emit_end == 3  # the early "x" stands


def test_min_tokens_still_holds_back_a_partial_stop_string() -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, stop=("END",))
    check = check_stop(params, (EOS,), [5], "abcEN", 5)
    assert not check.finished and check.emit_end == 3


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abcST OP", max_size=40),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
       stops=st.lists(st.text(alphabet="abcSTOP", min_size=1, max_size=4), min_size=1, max_size=3))
def test_streaming_equals_whole_text_search(text: str, cuts: list[int], stops: list[str]) -> None:
    """However the text is cut into tokens, the streamed output is the text before the first
    stop string, the same as searching the whole text at once."""
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    params = SamplingParams(max_tokens=len(pieces), stop=tuple(stops))
    out, check = stream(pieces, params)
    # Reference: the occurrence that ends first, then starts first.
    first = min(((text.find(s) + len(s), text.find(s), s) for s in stops if s in text), default=None)
    if first is None:
        assert out == text and check.finish_reason is FinishReason.LENGTH
    else:
        assert out == text[:first[1]]
        assert check.finish_reason is FinishReason.STOP and check.stop_reason == first[2]


def test_find_stop_string_without_stops_emits_everything() -> None:
    assert find_stop_string("abc", (), 3, False) == StopCheck(None, None, 3)


def test_check_stop_needs_a_token() -> None:
    with pytest.raises(ValueError):
        check_stop(SamplingParams(), (EOS,), [], "", 0)
