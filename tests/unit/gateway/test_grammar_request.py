"""Output constraints and logit_bias, from every field that names them, to SamplingParams."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from gateway.api.errors import ApiError
from gateway.api.grammar_request import choice_regex
from gateway.api.request_parsing import (RequestLimits, build_sampling_params, parse_chat,
                                         parse_completion)
from protocol.grammar_spec import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec
from protocol.sampling_params import SamplingParams

LIMITS = RequestLimits(max_model_len=100, vocab_size=1000)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                **fields})


def completion(**fields) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": "hi", **fields})


def grammar_of(body: bytes, parse=parse_chat) -> GrammarSpec | None:
    return build_sampling_params(parse(body, LIMITS), 5, LIMITS).grammar


def error_of(body: bytes, parse=parse_chat) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, LIMITS)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize("fields, kind, source", [
    ({"response_format": {"type": "json_object"}}, GrammarKind.JSON_SCHEMA, {"type": "object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, GrammarKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, GrammarKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"json_object": True}}, GrammarKind.JSON_SCHEMA, {"type": "object"}),
    ({"guided_json": SCHEMA}, GrammarKind.JSON_SCHEMA, SCHEMA),
    ({"structured_outputs": {"regex": "[0-9]+"}}, GrammarKind.REGEX, "[0-9]+"),
    ({"guided_regex": "[0-9]+"}, GrammarKind.REGEX, "[0-9]+"),
    ({"guided_choice": ["yes", "no"]}, GrammarKind.REGEX, "(yes)|(no)"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, GrammarKind.LARK, 'start: "a"+'),
])
def test_every_constraint_field_becomes_one_spec(fields, kind, source):
    for parse, body in ((parse_chat, chat(**fields)), (parse_completion, completion(**fields))):
        spec = grammar_of(body, parse)
        assert spec is not None and spec.kind is kind
        got = json.loads(spec.source) if kind is GrammarKind.JSON_SCHEMA else spec.source
        assert got == source


def test_text_format_and_no_fields_are_unconstrained():
    assert grammar_of(chat(response_format={"type": "text"})) is None
    assert grammar_of(chat()) is None


def test_gbnf_grammar_is_converted_to_lark():
    spec = grammar_of(chat(guided_grammar='root ::= "yes" | "no"'))
    assert spec is not None and spec.kind is GrammarKind.LARK and "start" in spec.source


def test_choice_regex_escapes_every_special_character():
    choices = ["a.b", "(x|y)", "1+1=2?", "back\\slash", "[set]{2}^$"]
    pattern = re.compile(choice_regex(choices))
    for c in choices:
        assert pattern.fullmatch(c)
    assert not pattern.fullmatch("aXb") and not pattern.fullmatch("x")


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": {}}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"guided_json": {"type": "object", "description": "x" * MAX_GRAMMAR_CHARS}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_constraints_are_400_naming_the_field(fields, param):
    assert error_of(chat(**fields)).param == param


def test_logit_bias_is_parsed_sorted_and_reaches_sampling_params():
    params = build_sampling_params(parse_chat(chat(logit_bias={"9": -100, "3": 2.5}), LIMITS), 5,
                                   LIMITS)
    assert params.logit_bias == ((3, 2.5), (9, -100.0))


@pytest.mark.parametrize("bias, param", [
    ({"5": 101}, "logit_bias.5"), ({"5": -100.5}, "logit_bias.5"), ({"5": "1"}, "logit_bias.5"),
    ({"5": True}, "logit_bias.5"), ({"x": 1}, "logit_bias.x"), ({"-1": 1}, "logit_bias.-1"),
    ({"1000": 1}, "logit_bias.1000"), ({"7": 1, "07": 2}, "logit_bias"),
])
def test_bad_logit_bias_is_400(bias, param):
    assert error_of(chat(logit_bias=bias)).param == param


def test_sampling_params_refuse_bad_bias_and_grammar_with_ignore_eos():
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=((5, 1.0), (3, 1.0)))
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=((5, float("nan")),))
    with pytest.raises(ValueError):
        SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "a"), ignore_eos=True)
    with pytest.raises(msgspec.ValidationError):  # bounded while decoding
        msgspec.msgpack.decode(msgspec.msgpack.encode(
            {"grammar": ["regex", "a" * (MAX_GRAMMAR_CHARS + 1)]}), type=SamplingParams)
