"""Random bodies through the real HTTP layer: never a 5xx, always an OpenAI error body."""

from __future__ import annotations

import json

import pytest
from gateway_harness import MODEL, Harness, ScriptedBackend
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=10), children, max_size=4),
                           max_leaves=20)

FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs", "n", "best_of",
          "user", "stream", "stream_options", "ignore_eos", "min_tokens", "echo", "suffix",
          "logit_bias", "tools", "tool_choice", "parallel_tool_calls", "response_format",
          "include_stop_str_in_output"]
BASE = {"/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"model": MODEL, "prompt": "hi"}}
paths = st.sampled_from(sorted(BASE))

# A valid body with some fields replaced by random values (the likeliest mistakes), a
# random JSON document, or random bytes.
mutated = st.tuples(paths, st.dictionaries(st.sampled_from(FIELDS), json_values, min_size=1,
                                           max_size=4)).map(
    lambda pf: (pf[0], json.dumps({**BASE[pf[0]], **pf[1]}).encode()))
message_mutated = st.tuples(st.just("/v1/chat/completions"), json_values).map(
    lambda pm: (pm[0], json.dumps({"model": MODEL, "messages": [pm[1]]}).encode()))
random_doc = st.tuples(paths, json_values.map(lambda v: json.dumps(v).encode()))
random_bytes = st.tuples(paths, st.binary(max_size=300))
inputs = mutated | message_mutated | random_doc | random_bytes


@pytest.fixture(scope="module")
def harness():
    h = Harness(ScriptedBackend())
    yield h
    h.close()


def check_response(status: int, raw: bytes) -> None:
    assert status < 500, raw
    if status == 200:
        return
    assert 400 <= status < 500
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=inputs)
def test_random_inputs_never_cause_5xx(harness, case):
    path, raw = case
    status, _, body = harness.call("POST", path, data=raw)
    check_response(status, body)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated)
def test_random_streamed_requests_never_cause_5xx(harness, case):
    path, raw = case
    doc = json.loads(raw)
    doc["stream"] = True
    status, _, body = harness.call("POST", path, data=json.dumps(doc).encode())
    check_response(status, body)


def test_server_serves_after_the_fuzzing(harness):
    status, _, raw = harness.call("POST", "/v1/chat/completions",
                                  data=json.dumps(BASE["/v1/chat/completions"]))
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "Hello world!"
    assert harness.controller.num_running == 0 and harness.controller.num_queued == 0
    harness.controller.check_invariants()
