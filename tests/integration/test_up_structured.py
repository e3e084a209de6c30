"""`pdserve up` (1 prefill + 1 decode worker, every prompt handed off P -> D, overlapped steps
asked for) answering structured-output, logit_bias, batched-prompt, n > 1 and tool-calling requests
through the official `openai` client (one cluster for all: each start costs CI time).

The first token of a handed-off request is sampled on the prefill worker and the rest on the
decode worker, so an answer that parses and validates shows both sides constrained it, and
the decode side's matcher started after the first token. Bad constraints are 400s with an
OpenAI error body, while the gateway's /health stays fast.

Greedy answers are compared with an undisturbed greedy run of the same cluster, never with
hard-coded text.

Tool calls: forced calls (`required`, a named function) parse and validate against the
tool's schema, streamed or not; a full round trip (the assistant's calls and the tool's
result sent back) renders and is answered; bad tools are 400s with an OpenAI error body.
The default model (SmolLM2-135M-Instruct) has no tool support in its template: the tools
are folded into its system prompt (text/tool_prompt.py). It does not call tools on its own
reliably, so `auto` is shown by the parser's unit tests (tests/unit/text/test_tool_calls.py)
and here only to answer 200 with either text or well-formed calls.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from up_process import HANDOFF_TIER, UpProcess

from testing.random_schemas import SchemaGenerator, body_with

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SPLIT = {"x-pdserve-tier": "handoff"}  # every prompt prefilled on P, decoded on D
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
        "home": {"type": "object",
                 "properties": {"city": {"type": "string", "maxLength": 10},
                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                 "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colour", "tags", "home"],
    "additionalProperties": False,
}
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

QUESTIONS = ["Describe a person as JSON.", "Who lives next door? Answer in JSON."]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)
    process = UpProcess("--prefill", "1", "--decode", "1", "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("up-logs"),
                        env={"PDSERVE_PIPELINED_STEPS": "overlap"})
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client, model, question, max_tokens=96, **kwargs):
    return client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, extra_headers=SPLIT,
        messages=[{"role": "user", "content": question}], **kwargs)


def _split_count(up: UpProcess) -> float:
    with urllib.request.urlopen(f"{up.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    line = 'pdserve_gateway_plans_total{kind="split",how="rule",tier="handoff"}'
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(line))


def test_json_schema_strict_answers_validate_streamed_and_not(client, model, up) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                   "strict": True}}
    splits = _split_count(up)
    for question in QUESTIONS:
        reply = _chat(client, model, question, response_format=fmt)
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        chunks = list(_chat(client, model, question, response_format=fmt, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content  # greedy: the same answer
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert _split_count(up) == splits + 2 * len(QUESTIONS)


def test_json_object_parses(client, model) -> None:
    reply = _chat(client, model, 'Reply with a JSON object with one key, "city", set to the '
                  "capital of France.", 64, response_format={"type": "json_object"})
    content = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content), dict)


def test_regex_and_choice_from_extra_body_match(client, model) -> None:
    phone = _chat(client, model, "What is your phone number?",
                  extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone.choices[0].message.content)
    assert phone.choices[0].finish_reason == "stop"
    for body in ({"guided_choice": ["Paris", "London", "Rome"]},
                 {"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}):
        city = _chat(client, model, "Which city is the capital of Italy?", extra_body=body)
        assert city.choices[0].message.content in ("Paris", "London", "Rome")
    completion = client.completions.create(
        model=model, prompt="The answer is", max_tokens=16, temperature=0, extra_headers=SPLIT,
        extra_body={"structured_outputs": {"grammar": 'start: " yes" | " no"'}})
    assert completion.choices[0].text in (" yes", " no")


def test_logit_bias_bans_the_greedy_first_token(client, model) -> None:
    from text.default_model import default_model_path
    from text.gguf_metadata import read_gguf_tokenizer_data
    from text.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))
    prompt = "The capital of France is"
    args = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                extra_headers=SPLIT)
    free = client.completions.create(**args)
    first = free.choices[0].logprobs.tokens[0]
    [banned] = tokenizer.encode(first, add_special_tokens=False)
    biased = client.completions.create(**args, logit_bias={str(banned): -100})
    assert first not in biased.choices[0].logprobs.tokens
    assert biased.choices[0].text != free.choices[0].text


def test_bad_constraints_are_400_with_an_openai_body_and_health_stays_fast(up, client,
                                                                           model) -> None:
    huge = {"type": "object", "description": "x" * (1 << 20)}
    bad = [
        dict(response_format={"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objec"}}}),
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}),
        dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}),
        dict(logit_bias={"abc": 1}),
        dict(logit_bias={"5": 1000}),
    ]

    def send(kwargs):
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, model, "hi", 8, **kwargs)
        return info.value

    def health_ms() -> float:
        started = time.perf_counter()
        with urllib.request.urlopen(f"{up.url}/health", timeout=10) as response:
            assert response.status == 200
        return (time.perf_counter() - started) * 1000

    with concurrent.futures.ThreadPoolExecutor(len(bad) * 2) as pool:
        futures = [pool.submit(send, kwargs) for kwargs in bad * 2]
        probes = [health_ms() for _ in range(5)]
        errors = [f.result(timeout=60) for f in futures]
    for error in errors:
        assert error.status_code == 400
        body = error.body
        assert body["type"] == "invalid_request_error" and body["message"]
    assert "objec" in errors[0].body["message"]
    assert errors[1].body["code"] == "grammar_too_large"
    assert errors[3].body["param"] == "logit_bias.abc"
    assert max(probes) < 1000, probes
    # Still serving after all that.
    assert _chat(client, model, "Say hi.", 4).choices[0].message.content


def test_batched_prompts_match_single_runs_in_order(client, model) -> None:
    prompts = ["The capital of France is", "One, two, three,", "My favourite food is"]
    args = dict(model=model, max_tokens=8, temperature=0, extra_headers=SPLIT)
    singles = [client.completions.create(prompt=p, **args) for p in prompts]
    batch = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **args):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {i: s.choices[0].text for i, s in enumerate(singles)}


def test_n_samples_each_keep_the_constraint(client, model) -> None:
    args = dict(model=model, max_tokens=8, temperature=1.0, seed=11, n=3, extra_headers=SPLIT,
                messages=[{"role": "user", "content": "Pick a colour."}],
                extra_body={"guided_choice": ["red", "green", "blue", "black", "white"]})
    reply = client.chat.completions.create(**args)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert {c.message.content for c in reply.choices} <= {"red", "green", "blue", "black", "white"}
    assert all(c.finish_reason == "stop" for c in reply.choices)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**{**args, "n": 17})


# Tool calls

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
