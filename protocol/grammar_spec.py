"""What a constrained request's output must match: one `GrammarSpec`, from the HTTP body to
the sampler of every worker that samples for the request.

The gateway normalises every way a client can ask for structure (OpenAI's `response_format`,
vLLM's `structured_outputs` and the older `guided_*` fields; gateway/api/grammar_request.py)
into one of three kinds, so a worker knows only these:

    JSON_SCHEMA  a JSON schema, as JSON text (`json_object` is the schema `{"type": "object"}`)
    REGEX        a regular expression the whole output matches (a `choice` list becomes an
                 alternation of its escaped strings)
    LARK         a context-free grammar in Lark syntax (GBNF is converted by the gateway)

It travels inside `SamplingParams` (PrefillRequest, DecodeRequest), so a prefill worker
constrains the first token, the decode worker the rest, and a migrated request the tokens
after those it replays. `key` is its identity for the compile caches on both sides.

Invariants: `source` is non-empty and at most MAX_GRAMMAR_CHARS characters (checked while
decoding, so no peer can make a worker compile without bound).
"""

from __future__ import annotations

import enum
import hashlib
from typing import Annotated

import msgspec

# The largest grammar source a request may carry (a JSON schema, a regex, a Lark grammar).
MAX_GRAMMAR_CHARS = 64 * 1024


class GrammarKind(enum.StrEnum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"


class GrammarSpec(msgspec.Struct, frozen=True, array_like=True):
    kind: GrammarKind
    source: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]

    @property
    def key(self) -> str:
        """A digest naming this grammar in compile caches (same spec, same key)."""
        digest = hashlib.sha256(self.kind.value.encode())
        digest.update(b"\0")
        digest.update(self.source.encode("utf-8", "surrogatepass"))
        return digest.hexdigest()
