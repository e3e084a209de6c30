"""The Hermes / Qwen `<tool_call>` parser: whole answers and streamed pieces agree, text
outside the calls is kept, anything that is not a call stays text."""

from __future__ import annotations

import json
import random

import pytest

from text.tool_calls import (ArgumentsPiece, CallEnd, CallStart, ParsedToolCall, ToolCallStream,
                             parse_tool_calls)

NAMES = {"get_weather", "add"}


def test_a_hermes_answer_with_two_calls_and_text_around():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def test_a_call_cut_at_eos_before_its_closing_tag_still_counts():
    parsed = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)
    assert parsed.content is None and parsed.tool_calls[0].name == "add"


def test_qwen_parameters_key_and_string_arguments_are_read():
    parsed = parse_tool_calls('<tool_call>{"name": "add", "parameters": {"a": 3}}</tool_call>'
                              '<tool_call>{"name": "add", "arguments": "{\\"b\\": 4}"}</tool_call>',
                              NAMES)
    assert [json.loads(c.arguments) for c in parsed.tool_calls] == [{"a": 3}, {"b": 4}]


@pytest.mark.parametrize("text", [
    "no calls at all",
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>["add"]</tool_call>',
    "a < b and <tool_ is not a tag",
])
def test_what_is_not_a_known_call_stays_text(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.tool_calls == () and parsed.content == text


def assemble(pieces) -> tuple[list[tuple[str, str]], str]:
    calls, texts = [], []
    for piece in pieces:
        if isinstance(piece, str):
            texts.append(piece)
        elif isinstance(piece, ParsedToolCall):
            calls.append((piece.name, piece.arguments))
        elif isinstance(piece, CallStart):
            calls.append((piece.name, ""))
        elif isinstance(piece, ArgumentsPiece):
            calls[-1] = (calls[-1][0], calls[-1][1] + piece.text)
    return calls, "".join(texts)


def test_streamed_pieces_give_the_same_calls_and_text_as_the_whole():
    text = ('Sure <tool_call>{"name":"get_weather","arguments":{"city":"Ro}me"}}</tool_call> '
            'and <tool_call>{"arguments":{"a":5,"b":6}, "name":"add"}</tool_call> then '
            '<tool_call>\n{"name": "add", "arguments": {"a": {"b": 1}}}\n</tool_call> done <tool')
    whole = parse_tool_calls(text, NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Ro}me"}), ("add", {"a": 5, "b": 6}), ("add", {"a": {"b": 1}})]
    rng = random.Random(7)
    for _ in range(100):
        stream, out, i = ToolCallStream(NAMES), [], 0
        while i < len(text):
            j = min(len(text), i + rng.randint(1, 6))
            out += stream.feed(text[i:j])
            i = j
        out += stream.finish()
        calls, texts = assemble(out)
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
        assert texts == "Sure  and  then  done <tool"


def test_arguments_stream_before_the_call_closes():
    stream = ToolCallStream(NAMES)
    assert stream.feed('<tool_call>{"name": "get_weather", "arg') == []
    assert stream.feed('uments": {"city": "Os') == [CallStart("get_weather"),
                                                   ArgumentsPiece('{"city": "Os')]
    assert stream.feed('lo"}') == [ArgumentsPiece('lo"')]  # "}" may close the call
    assert stream.feed("}") == [ArgumentsPiece("}")]
    assert stream.feed("</tool_call>ok") == [CallEnd(), "ok"]
    assert stream.num_calls == 1


def test_text_is_released_as_soon_as_it_cannot_start_a_tag():
    stream = ToolCallStream(NAMES)
    assert stream.feed("Hello <to") == ["Hello "]
    assert stream.feed("ast>") == ["<toast>"]
