"""Grammars over a tokenizer's vocabulary: a `GrammarSpec` compiled once, matched per request.

    GrammarSpec --GrammarCompiler.compile (cached by spec.key)--> CompiledGrammar
    CompiledGrammar.new_matcher() --> GrammarMatcher, one per request:
        write_mask (the tokens allowed next) --> the sampler masks and samples -->
        accept(token) --> ... --> EOS allowed and sampled: the request stops

The engine is llguidance: its matcher builds its lexer and parser lazily, so a compile costs
milliseconds even for wide schemas and a mask tens of microseconds
(benchmarks/grammar_compare.py; docs/performance.md "Structured outputs"). Its resource
limits (`LLParserLimits`' defaults: lexer fuel, Earley items per step, grammar size) bound
the work of every compile and every mask, so no grammar can stall a worker; the gateway
also puts a wall-clock deadline on its compiles (gateway/api/grammar_check.py).

The token table (`llguidance.LLTokenizer`, built from the tokenizer's JSON) costs about a
second for a large vocabulary: built on the first compile, then shared.

Thread safety: `GrammarCompiler.compile` may be called from several threads at once (the
gateway's compile pool, a worker's event loop thread and its engine thread); a matcher
belongs to one request and is used by one thread at a time.

Invariants: a cached entry is either a grammar that compiled and allows some first token,
or the `GrammarError` it raised (so a bad grammar sent again fails at once); the cache holds
at most `cache_size` entries, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from protocol.grammar_spec import GrammarKind, GrammarSpec
from text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON output without optional whitespace: a small model cannot wander off into blank
# lines, and every answer is as short as its content allows. A schema may override it
# with llguidance's "x-guidance" options.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar cannot be compiled, or allows no output at all; the message says why."""


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "_eos_token_ids")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._eos_token_ids = eos_token_ids

    @property
    def is_usable(self) -> bool:
        """False once the grammar has ended (EOS accepted) or a token broke it: the only
        sensible next token is then EOS (`eos_token_ids`)."""
        return not (self._matcher.is_error() or self._matcher.is_stopped())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def write_mask(self, address: int, num_bytes: int) -> None:
        """The allowed next tokens as a bitmask (bit t of 32-bit word t // 32 set: token t
        allowed) into `num_bytes` bytes at `address` (a contiguous int32 row). Only while
        `is_usable`."""
        self._matcher.unsafe_compute_mask_ptr(address, num_bytes)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar did not allow it (the matcher
        is then unusable)."""
        return bool(self._matcher.consume_token(token_id))

    def accept_all(self, token_ids: list[int]) -> None:
        """Replay output sampled before (elsewhere, or by the prefill side); GrammarError
        if the grammar does not allow it."""
        if token_ids and not self._matcher.consume_tokens(token_ids):
            raise GrammarError(f"the output so far does not match the grammar: "
                               f"{self._matcher.get_error()}")


class CompiledGrammar:
    """A grammar ready to match: each request starts from a copy of its initial state."""

    __slots__ = ("spec", "_prototype", "_eos_token_ids")

    def __init__(self, spec: GrammarSpec, prototype: llguidance.LLMatcher,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.spec = spec
        self._prototype = prototype
        self._eos_token_ids = eos_token_ids

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self._eos_token_ids)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and a model's vocabulary width; caches them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._table: llguidance.LLTokenizer | None = None
        self.num_compiles = 0  # compiles run (cache misses)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (from the cache when it has it); GrammarError if it does not
        compile or allows no output."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self._compile(spec)
            except GrammarError as exc:
                hit = exc
            except (ValueError, TypeError, RuntimeError) as exc:  # llguidance's own, unforeseen
                hit = GrammarError(_clean(f"{type(exc).__name__}: {exc}"))
            with self._lock:
                self.num_compiles += 1
                self._cache[key] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit

    def new_matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return self.compile(spec).new_matcher()

    def check_invariants(self) -> None:
        with self._lock:
            assert len(self._cache) <= self._cache_size, "cache over its size"
            for key, entry in self._cache.items():
                assert isinstance(entry, GrammarError) or entry.spec.key == key

    # ---- internals ----------------------------------------------------------------------

    def _token_table(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._table is None:
                self._table = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
            return self._table

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = _grammar_text(spec)
        matcher = llguidance.LLMatcher(self._token_table(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))
        first = matcher.compute_bitmask()  # the lazy part of the compile, and a check
        if matcher.is_error():
            raise GrammarError(_clean(matcher.get_error()))
        if not any(first):
            raise GrammarError("the grammar allows no output")
        return CompiledGrammar(spec, matcher, tuple(self._tokenizer.eos_token_ids))


def to_lark(source: str) -> str:
    """A grammar in Lark syntax (as given) or GBNF (`root ::= ...`, converted to Lark);
    GrammarError where it is neither."""
    try:
        return any_to_lark(source)
    except Exception as exc:  # the converter raises its own error types, and ValueError
        raise GrammarError(_clean(str(exc)) or type(exc).__name__) from exc


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec; GrammarError where the source is malformed."""
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema is not valid: {_clean(str(exc))}") from exc
    if spec.kind is GrammarKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def _clean(message: str) -> str:
    """llguidance's messages, one line and bounded, for an API error body."""
    text = " ".join(message.split())
    return text if len(text) <= 500 else text[:497] + "..."
