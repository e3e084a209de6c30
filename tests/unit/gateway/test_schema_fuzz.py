"""1,000 random JSON schemas (valid, invalid, pathological; testing/random_schemas.py)
through the gateway's own schema path: the body parsed (`parse_chat`), then every schema
compiled against the default model's vocabulary within a deadline
(`GrammarCheck.check_request`), as `response_format`, as vLLM's `structured_outputs.json`
(JSON text), and as a tool's parameters with `tool_choice` required. Each must come out
accepted or as a 400 with an OpenAI error body: never another exception, never a 5xx."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import pytest

from gateway.api.errors import ApiError
from gateway.api.grammar_check import GrammarCheck
from gateway.api.request_parsing import RequestLimits, parse_chat
from testing.random_schemas import SchemaGenerator, body_with
from text.default_model import default_model_path
from text.gguf_metadata import read_gguf_tokenizer_data
from text.grammar import GrammarCompiler
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)
NUM_SCHEMAS = 1000
LIMITS = RequestLimits(max_model_len=2048, vocab_size=49152)


async def outcome(check: GrammarCheck, body: bytes) -> str:
    try:
        validated = parse_chat(body, LIMITS)
        await check.check_request(validated)
    except ApiError as exc:
        assert exc.status == 400, exc
        error = json.loads(exc.body_bytes())["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        return "400 " + (error["code"] or "")
    return "ok"


def test_random_schemas_are_accepted_or_400_never_an_error():
    tokenizer = Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))
    check = GrammarCheck(GrammarCompiler(tokenizer, tokenizer.vocab_size, cache_size=256),
                         deadline_s=5.0)
    generator = SchemaGenerator(seed=48)
    counts: collections.Counter[str] = collections.Counter()
    slowest = (0.0, None)

    async def run() -> None:
        nonlocal slowest
        for i in range(NUM_SCHEMAS):
            schema = generator.schema()
            body = body_with(schema, i % 3)
            started = time.perf_counter()
            counts[await outcome(check, body)] += 1
            slowest = max(slowest, (time.perf_counter() - started, i))

    try:
        asyncio.run(run())
    finally:
        check.close()
    assert sum(counts.values()) == NUM_SCHEMAS
    # The generator's mix shows in the outcomes (a fuzz that only ever passed, or only ever
    # failed, would test little).
    assert counts["ok"] >= 300 and sum(n for k, n in counts.items() if k != "ok") >= 200, counts
    assert slowest[0] < 6.0, slowest
