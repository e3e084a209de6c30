"""Grammar-constrained requests in an in-process engine on the default model: masked in
every step mode beside free requests (which stay exactly as they were), and resumed
elsewhere with the grammar kept (the matcher replays the tokens delivered so far)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from default_engine import PROMPTS, make_engine
from engine_runs import GREEDY, run

from protocol.grammar_spec import GrammarKind, GrammarSpec
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "people": {"type": "integer", "minimum": 0, "maximum": 99999999},
                         "kind": {"enum": ["town", "city", "village"]}},
          "required": ["city", "people", "kind"], "additionalProperties": False}
JSON = SamplingParams(max_tokens=48, temperature=0.0,
                      grammar=GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))


@pytest.mark.parametrize("mode", ["pipelined", "overlapped"])
def test_grammar_rows_beside_free_rows_in_every_step_mode(loaded, mode):
    engine = make_engine(loaded)
    encode = engine.tokenizer.encode
    requests = {f"free{i}": (encode(p), GREEDY) for i, p in enumerate(PROMPTS[:3])}
    requests["json"] = (encode("Paris is a city of two million people. As JSON:"), JSON)
    requests["json-sampled"] = (encode("Describe a town:"),
                                SamplingParams(max_tokens=48, temperature=1.0, seed=5,
                                               grammar=JSON.grammar))
    plain, _ = run(make_engine(loaded), requests, "plain")
    other, _ = run(engine, requests, mode)
    assert other == plain
    free_alone, _ = run(make_engine(loaded), {r: requests[r] for r in requests
                                              if r.startswith("free")}, "plain")
    for rid, seen in free_alone.items():  # the grammar rows changed nothing of theirs
        assert plain[rid].tokens == seen.tokens
    for rid in ("json", "json-sampled"):
        assert plain[rid].finish_reasons[-1] == "stop"
        jsonschema.validate(json.loads("".join(plain[rid].texts)), SCHEMA)


def test_a_resumed_request_keeps_its_grammar(loaded):
    engine = make_engine(loaded)
    prompt = engine.tokenizer.encode("A village of ninety people, as JSON:")
    whole = engine.generate([prompt], JSON)[0]
    assert whole.finish_reason == "stop"
    for k in (1, 5):
        resumed = make_engine(loaded)
        resumed.add_request("r", prompt, JSON, resumed_token_ids=whole.token_ids[:k])
        tokens = []
        while resumed.has_unfinished():
            tokens += [t for o in resumed.step() for t in o.new_token_ids]
            resumed.check_invariants()
        assert whole.token_ids[:k] + tokens == whole.token_ids
    off_grammar = engine.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(ValueError, match="grammar"):
        make_engine(loaded).add_request("bad", prompt, JSON, resumed_token_ids=off_grammar)


def test_a_grammar_that_does_not_compile_is_refused_when_added(loaded):
    engine = make_engine(loaded)
    bad = SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "(unclosed"))
    with pytest.raises(ValueError, match="unclosed"):
        engine.add_request("bad", engine.tokenizer.encode("x"), bad)
    assert not engine.has_unfinished()
    engine.check_invariants()
