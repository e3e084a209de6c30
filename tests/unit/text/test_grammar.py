"""Grammars compiled over the default model's vocabulary: what they allow, errors, the cache."""

from __future__ import annotations

import json
import threading

import pytest

from protocol.grammar_spec import GrammarKind, GrammarSpec
from text.default_model import default_model_path
from text.gguf_metadata import read_gguf_tokenizer_data
from text.grammar import GrammarCompiler, GrammarError, to_lark
from text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "c": {"enum": ["red", "blue"]}},
          "required": ["n", "c"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tok, tok.vocab_size, cache_size=4)


def allowed(matcher, vocab_size: int) -> set[int]:
    import torch
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    matcher.write_mask(row.data_ptr(), row.numel() * 4)
    bits = (row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.reshape(-1)[:vocab_size].nonzero().flatten().tolist())


def test_a_valid_document_is_accepted_then_only_eos(tok, compiler):
    matcher = compiler.new_matcher(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    for t in tok.encode('{"n":12,"c":"blue"}', add_special_tokens=False):
        assert t in allowed(matcher, tok.vocab_size) and matcher.accept(t)
    assert allowed(matcher, tok.vocab_size) == set(tok.eos_token_ids)
    assert matcher.accept(tok.eos_token_ids[0]) and not matcher.is_usable


def test_a_token_outside_the_grammar_is_refused(tok, compiler):
    matcher = compiler.new_matcher(GrammarSpec(GrammarKind.REGEX, "(yes)|(no)"))
    first = allowed(matcher, tok.vocab_size)
    assert tok.encode("yes", add_special_tokens=False)[0] in first
    bad = tok.encode("maybe", add_special_tokens=False)[0]
    assert bad not in first and not matcher.accept(bad) and not matcher.is_usable


def test_replay_moves_a_fresh_matcher_to_the_same_place(tok, compiler):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA))
    ids = tok.encode('{"n":3', add_special_tokens=False)
    stepwise, replayed = compiler.new_matcher(spec), compiler.new_matcher(spec)
    for t in ids:
        stepwise.accept(t)
    replayed.accept_all(ids)
    assert allowed(stepwise, tok.vocab_size) == allowed(replayed, tok.vocab_size)
    with pytest.raises(GrammarError):
        compiler.new_matcher(spec).accept_all(tok.encode("nope", add_special_tokens=False))


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type": "objec"}'), "objec"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"type":'), "not valid"),
    (GrammarSpec(GrammarKind.JSON_SCHEMA, '{"allOf": [{"type": "string"}, {"type": "integer"}]}'),
     "nsatisfiable"),
    (GrammarSpec(GrammarKind.REGEX, "(ab"), "unclosed"),
    (GrammarSpec(GrammarKind.LARK, "start: foo"), "foo"),
])
def test_bad_grammars_raise_naming_the_problem_and_are_cached(compiler, spec, words):
    for _ in range(2):
        with pytest.raises(GrammarError, match=words):
            compiler.compile(spec)
    compiler.check_invariants()


def test_cache_hits_and_bounded(compiler):
    before = compiler.num_compiles
    specs = [GrammarSpec(GrammarKind.REGEX, f"a{{{i}}}") for i in range(1, 7)]
    for spec in specs:
        compiler.compile(spec)
    compiler.compile(specs[-1])
    assert compiler.num_compiles == before + 6
    compiler.compile(specs[0])  # evicted (4 entries)
    assert compiler.num_compiles == before + 7
    compiler.check_invariants()


def test_concurrent_compiles_of_one_spec_agree(compiler, tok):
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({**SCHEMA, "title": "threads"}))
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(spec)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    masks = {frozenset(allowed(r.new_matcher(), tok.vocab_size)) for r in results}
    assert len(masks) == 1


def test_gbnf_converts_and_garbage_does_not():
    assert "start" in to_lark('root ::= "a" | "b"')
    assert to_lark('start: "a"') == 'start: "a"'
    with pytest.raises(GrammarError):
        to_lark("root ::= (((")
