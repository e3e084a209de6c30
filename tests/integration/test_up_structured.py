"""`pdserve up` (1 prefill + 1 decode worker, every prompt handed off P -> D, overlapped steps
asked for) answering structured-output, logit_bias, batched-prompt and n > 1 requests through
the official `openai` client.

The first token of a handed-off request is sampled on the prefill worker and the rest on the
decode worker, so an answer that parses and validates shows both sides constrained it, and
the decode side's matcher started after the first token. Bad constraints are 400s with an
OpenAI error body, while the gateway's /health stays fast.

Greedy answers are compared with an undisturbed greedy run of the same cluster, never with
hard-coded text.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request

import jsonschema
import pytest
from up_process import HANDOFF_TIER, UpProcess

import openai

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
