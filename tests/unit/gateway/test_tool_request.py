"""`tools` / `tool_choice` -> ToolUse, the forcing grammar (compiled against the default
model's vocabulary), and the answer's tool calls (JSON and streamed deltas)."""

from __future__ import annotations

import json

import pytest

from gateway.api.errors import ApiError
from gateway.api.tool_answer import ToolDeltas, answer_finish_reason, tool_message
from gateway.api.tool_request import ToolChoice, tool_use_from_request
from protocol.finish_reason import FinishReason
from text.default_model import default_model_path
from text.gguf_metadata import read_gguf_tokenizer_data
from text.grammar import GrammarCompiler
from text.tokenizer import Tokenizer
from text.tool_prompt import ChatTurn, TurnToolCall, folded_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}, "b": {"$ref": "#/$defs/n"}},
        "required": ["a", "b"], "$defs": {"n": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def default_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))


def test_defaults_and_choices():
    assert tool_use_from_request(None, None, None) is None
    assert tool_use_from_request(None, "none", None) is None
    auto = tool_use_from_request([WEATHER], None, None)
    assert auto is not None and auto.choice is ToolChoice.AUTO and auto.grammar() is None
    none = tool_use_from_request([WEATHER], "none", None)
    assert none is not None and none.in_prompt == () and not none.parses_output
    named = tool_use_from_request([WEATHER, ADD], {"type": "function", "function": {"name": "add"}},
                                  False)
    assert named is not None and named.named == "add" and named.grammar() is not None


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (None, "required", "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None,
     "tools[0].function.parameters"),
    (["x"], None, "tools[0]"),
    ([WEATHER] * 129, None, "tools"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(ApiError) as caught:
        tool_use_from_request(tools, choice, None)
    assert caught.value.status == 400 and caught.value.param == param


def _accepts(compiler, spec, tokenizer, text: str) -> bool:
    matcher = compiler.compile(spec).new_matcher()
    try:
        matcher.accept_all(tokenizer.encode(text, add_special_tokens=False))
    except Exception:
        return False
    return True


def test_the_required_grammar_admits_exactly_calls_of_the_tools(default_tokenizer):
    compiler = GrammarCompiler(default_tokenizer, default_tokenizer.vocab_size)
    use = tool_use_from_request([WEATHER, ADD], "required", None)
    assert use is not None
    spec = use.grammar()
    assert spec is not None
    good = ('<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>\n'
            '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>')
    assert _accepts(compiler, spec, default_tokenizer, good)
    for bad in ['<tool_call>{"name":"sub","arguments":{}}</tool_call>',
                '<tool_call>{"name":"add","arguments":{"a":"x","b":2}}</tool_call>',
                'Sure! <tool_call>', '{"name":"add","arguments":{"a":1,"b":2}}']:
        assert not _accepts(compiler, spec, default_tokenizer, bad), bad
    single = tool_use_from_request([WEATHER, ADD], "required", False)
    assert single is not None and single.grammar() is not None
    assert not _accepts(compiler, single.grammar(), default_tokenizer, good)


def test_the_answer_message_and_finish_reason():
    message, num_calls = tool_message(
        'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        {"get_weather"})
    assert num_calls == 1 and message.content == "ok" and message.tool_calls is not None
    call = message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert answer_finish_reason(FinishReason.STOP, 1) == "tool_calls"
    assert answer_finish_reason(FinishReason.LENGTH, 1) == "length"
    assert answer_finish_reason(FinishReason.STOP, 0) == "stop"


def test_streamed_deltas_name_each_call_then_carry_its_arguments():
    deltas = ToolDeltas({"add"})
    text = 'x<tool_call>{"name":"add","arguments":{"a":1}}</tool_call><tool_call>{"name":"add","arguments":{}}'
    content, calls = deltas.feed(text[:20], False)
    assert content == "x" and calls == []
    content, calls = deltas.feed(text[20:], True)
    assert content == "" and [c.index for c in calls] == [0, 0, 1, 1]
    assert calls[0].id and calls[0].function.name == "add" and calls[1].function.arguments == '{"a":1}'
    assert deltas.num_calls == 2


def test_a_round_trip_folds_into_system_user_and_assistant_text():
    use = tool_use_from_request([WEATHER], "auto", None)
    assert use is not None
    turns = (ChatTurn("system", "Be brief."), ChatTurn("user", "Weather in Oslo?"),
             ChatTurn("assistant", "", (TurnToolCall("call_1", "get_weather", '{"city":"Oslo"}'),)),
             ChatTurn("tool", "3C", (), "call_1"), ChatTurn("tool", "windy", (), "call_1"))
    messages = folded_messages(turns, use.in_prompt)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "Be brief." in str(messages[0]["content"]) and "<tools>" in str(messages[0]["content"])
    assert messages[2]["content"] == ('<tool_call>{"name":"get_weather","arguments":'
                                      '{"city":"Oslo"}}</tool_call>')
    assert str(messages[3]["content"]).count("<tool_response>") == 2
