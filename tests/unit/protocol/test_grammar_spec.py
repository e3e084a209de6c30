"""Grammar specs and logit biases on the wire: they travel inside the sampling parameters of
PrefillRequest and DecodeRequest, bounded while decoding."""

from __future__ import annotations

import msgspec
import pytest

from protocol.grammar_spec import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec
from protocol.messages import DecodeRequest, PrefillRequest, decode, encode
from protocol.sampling_params import MAX_LOGIT_BIAS_TOKENS, SamplingParams

SPEC = GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}')
PARAMS = SamplingParams(grammar=SPEC, logit_bias=((3, -100.0), (7, 2.5)))


@pytest.mark.parametrize("message", [
    PrefillRequest(request_id="r", prompt_token_ids=[1, 2], sampling=PARAMS, timeout_ms=1000),
    DecodeRequest(request_id="r", prompt_token_ids=[1, 2], sampling=PARAMS, timeout_ms=1000,
                  resume_token_ids=[5, 6]),
])
def test_requests_carry_the_grammar_and_bias_unchanged(message):
    decoded = decode(encode(message), type(message))
    assert decoded == message and decoded.sampling.grammar == SPEC


def test_key_names_the_spec():
    assert SPEC.key == GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"object"}').key
    assert SPEC.key != GrammarSpec(GrammarKind.REGEX, '{"type":"object"}').key
    assert SPEC.key != GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":"array"}').key


@pytest.mark.parametrize("sampling", [
    {"grammar": ["json_schema", "x" * (MAX_GRAMMAR_CHARS + 1)]},
    {"grammar": ["json_schema", ""]},
    {"grammar": ["python", "x"]},
    {"logit_bias": [[i, 1.0] for i in range(MAX_LOGIT_BIAS_TOKENS + 1)]},
    {"logit_bias": [[2, 1.0], [1, 1.0]]},
    {"logit_bias": [[1, 101.0]]},
])
def test_a_peer_cannot_send_unbounded_or_malformed_constraints(sampling):
    with pytest.raises((msgspec.ValidationError, ValueError)):
        msgspec.msgpack.decode(msgspec.msgpack.encode(sampling), type=SamplingParams)
