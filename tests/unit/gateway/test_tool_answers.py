"""Tool calls through the HTTP layer, from a backend that writes a Hermes call: the JSON
message, and a stream the official client's own accumulator assembles into the same calls."""

from __future__ import annotations

import json

import pytest
from gateway_harness import MODEL, Harness, ScriptedBackend
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from gateway.api.sse import SseDecoder

pytestmark = pytest.mark.timeout(30)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
REPLY = ("I will look.", " <tool_", 'call>{"name": "get_weather", ', '"arguments": {"city": ',
         '"Oslo"}}</tool_call>', '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}')


@pytest.fixture
def harness():
    h = Harness(ScriptedBackend(reply=REPLY))
    yield h
    h.close()


def post(h: Harness, **fields):
    body = {"model": MODEL, "max_tokens": 50, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather?"}], **fields}
    return h.call("POST", "/v1/chat/completions", data=json.dumps(body))


def test_a_json_answer_carries_the_calls_and_the_text_outside_them(harness):
    status, _, raw = post(harness)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("function", "get_weather", {"city": "Oslo"}),
                                               ("function", "get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_the_official_client_assembles_the_streamed_calls(harness):
    status, _, raw = post(harness, stream=True)
    assert status == 200, raw
    state = ChatCompletionStreamState()
    decoder = SseDecoder()
    for data in decoder.feed(raw):
        if data != b"[DONE]":
            state.handle_chunk(ChatCompletionChunk.model_validate_json(data))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert final.message.content == "I will look. "
    calls = final.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]


def test_tool_choice_none_leaves_the_text_alone(harness):
    status, _, raw = post(harness, tool_choice="none")
    message = json.loads(raw)["choices"][0]["message"]
    assert status == 200 and "tool_calls" not in message and "<tool_call>" in message["content"]
    assert "get_weather" not in bytes(harness.backend.requests[-1].prompt_token_ids).decode()


def test_a_tool_round_trip_renders(harness):
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3C"}]
    status, _, raw = post(harness, messages=messages)
    assert status == 200, raw
    prompt = bytes(harness.backend.requests[-1].prompt_token_ids).decode()
    assert '<call get_weather {"city":"Oslo"}>' in prompt and "<tool>3C" in prompt


def test_an_unknown_named_function_is_a_400(harness):
    status, _, raw = post(harness, tool_choice={"type": "function",
                                                 "function": {"name": "nope"}})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "tool_choice.function.name"
