"""`pdserve up` (1 prefill + 1 decode worker, every prompt handed off P -> D) answering tool
calls through the official `openai` client: forced calls (`required`, a named function)
parse and validate against the tool's schema, streamed or not; a full round trip (the
assistant's calls and the tool's result sent back) renders and is answered; bad tools are
400s with an OpenAI error body.

The default model (SmolLM2-135M-Instruct) has no tool support in its template: the tools
are folded into its system prompt (text/tool_prompt.py). It does not call tools on its own
reliably, so `auto` is shown by the parser's unit tests (tests/unit/text/test_tool_calls.py)
and here only to answer 200 with either text or well-formed calls.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import pytest
from up_process import HANDOFF_TIER, UpProcess

import openai
from testing.random_schemas import SchemaGenerator, body_with

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SPLIT = {"x-pdserve-tier": "handoff"}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD_PARAMETERS = {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The current weather in a city.",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers.",
                                      "parameters": ADD_PARAMETERS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)
    process = UpProcess("--prefill", "1", "--decode", "1", "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("up-logs"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_required_round_trip(client, model) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=96,
        temperature=0, extra_headers=SPLIT)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and _valid_calls(calls)
    # Send the calls back with a result for each: the template renders them, the model answers.
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}
        for call in calls]
    answer = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=32, temperature=0,
        extra_headers=SPLIT)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage is not None and answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_a_named_function_streamed_matches_the_json_answer(client, model) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    kwargs = dict(model=model, tools=TOOLS, tool_choice=named, max_tokens=64, temperature=0,
                  parallel_tool_calls=False, extra_headers=SPLIT,
                  messages=[{"role": "user", "content": "What is 2 plus 40?"}])
    whole = client.chat.completions.create(**kwargs)
    calls = whole.choices[0].message.tool_calls or []
    assert [name for name, _ in _valid_calls(calls)] == ["add"]
    argument_pieces = []
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "chunk" and event.chunk.choices:
                for call in event.chunk.choices[0].delta.tool_calls or ():
                    if call.function is not None and call.function.arguments:
                        argument_pieces.append(call.function.arguments)
        final = stream.get_final_completion().choices[0]
    assert len(argument_pieces) > 1  # the arguments stream as the model writes them
    assert final.finish_reason == "tool_calls"
    streamed = final.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_auto_answers_text_or_calls(client, model) -> None:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, max_tokens=48, temperature=0,
        extra_headers=SPLIT)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and _valid_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "multiply"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "broken", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "pattern": "(unclosed"}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools[0].function.name"),
])
def test_bad_tools_are_400_with_an_openai_body(client, model, kwargs, param) -> None:
    body = {"tools": TOOLS, "tool_choice": "required", **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, **body)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and error["message"]


def test_random_schemas_through_the_gateway_are_200_or_400(up) -> None:
    """10 of the unit fuzz's schemas (tests/unit/gateway/test_schema_fuzz.py) over HTTP:
    answered or refused with an OpenAI error body, never a 5xx."""
    generator = SchemaGenerator(seed=30)
    statuses = []
    for i in range(10):
        body = {**json.loads(body_with(generator.schema(), i % 3)), "model": "default",
                "max_tokens": 4}
        request = urllib.request.Request(
            f"{up.url}/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                statuses.append(response.status)
                assert json.loads(response.read())["choices"]
        except urllib.error.HTTPError as exc:
            statuses.append(exc.code)
            error = json.loads(exc.read())["error"]
            assert exc.code == 400 and error["message"] and error["param"], error
    assert 200 in statuses and 400 in statuses, statuses
    with urllib.request.urlopen(f"{up.url}/health", timeout=5) as response:
        assert response.status == 200
