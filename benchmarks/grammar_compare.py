"""Grammar engines for structured outputs, side by side on the default model's vocabulary.

Two figures per engine, on this machine's CPU:

1. compile: a JSON schema of `--properties` properties (strings, integers, enums, a nested
   object and an array, alternating) turned into something that can mask tokens, for the
   default model's 49k vocabulary; the tokenizer table is built once beforehand and not
   counted (both engines cache it).
2. mask: the token masks of a batch of `--batch` requests at one decode step, each
   request at a different point of its schema (it has consumed a different number of
   tokens of a valid document), sequentially on one thread, as the sampler fills them.

    python benchmarks/grammar_compare.py [--properties 200] [--batch 64] [--repeats 5]

llguidance builds its lexer and parser lazily (the mask does the work on demand);
outlines-core builds the whole token index of the schema's regex up front.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def wide_schema(num_properties: int) -> dict[str, Any]:
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 20},
        {"type": "integer"},
        {"enum": ["red", "green", "blue"]},
        {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}},
         "required": ["x", "y"], "additionalProperties": False},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(num_properties)}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def sample_document(num_properties: int) -> str:
    values = ['"abc"', "7", '"red"', '{"x":1,"y":true}', "[1,2]"]
    body = ",".join(f'"field_{i}":{values[i % len(values)]}' for i in range(num_properties))
    return "{" + body + "}"


def load_tokenizer() -> Any:
    from text.default_model import default_model_path
    from text.gguf_metadata import read_gguf_tokenizer_data
    from text.tokenizer import Tokenizer
    return Tokenizer.from_gguf_fields(read_gguf_tokenizer_data(default_model_path()))


def bench_llguidance(tokenizer: Any, schema: dict[str, Any], document: str, batch: int,
                     repeats: int) -> tuple[list[float], list[float]]:
    import llguidance
    import llguidance.torch
    import torch
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                   eos_token=list(tokenizer.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False})
    compile_s = []
    matcher = None
    for _ in range(repeats):
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        matcher.compute_bitmask()  # the lazy part of a compile: the first mask
        compile_s.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
    assert matcher is not None
    tokens = tokenizer.encode(document, add_special_tokens=False)
    rows = []
    for i in range(batch):
        m = llguidance.LLMatcher(lltok, grammar)
        assert m.consume_tokens(tokens[: (i * len(tokens)) // batch]), m.get_error()
        rows.append(m)
    bitmask = llguidance.torch.allocate_token_bitmask(batch, tokenizer.vocab_size)
    mask_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        for i, m in enumerate(rows):
            llguidance.torch.fill_next_token_bitmask(m, bitmask, i)
        mask_s.append(time.perf_counter() - started)
    del torch
    return compile_s, mask_s


def bench_outlines(tokenizer: Any, schema: dict[str, Any], document: str, batch: int,
                   repeats: int) -> tuple[list[float], list[float]]:
    import outlines_core
    import torch
    table = tokenizer.token_bytes()
    eos = tokenizer.eos_token_ids[0]
    by_bytes: dict[bytes, list[int]] = {}
    for token_id in range(len(table.table)):
        if token_id in tokenizer.eos_token_ids or not table.table[token_id]:
            continue
        by_bytes.setdefault(table.table[token_id], []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
    compile_s = []
    index = None
    for _ in range(repeats):
        started = time.perf_counter()
        index = outlines_core.Index(regex, vocabulary)
        compile_s.append(time.perf_counter() - started)
    assert index is not None
    tokens = tokenizer.encode(document, add_special_tokens=False)
    rows = []
    for i in range(batch):
        guide = outlines_core.Guide(index)
        for t in tokens[: (i * len(tokens)) // batch]:
            guide.advance(t)
        rows.append(guide)
    width = (tokenizer.vocab_size + 31) // 32
    bitmask = torch.zeros(batch, width, dtype=torch.int32)
    mask_s = []
    for _ in range(repeats):
        started = time.perf_counter()
        for i, g in enumerate(rows):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), row.element_size())
        mask_s.append(time.perf_counter() - started)
    return compile_s, mask_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--properties", type=int, default=200,
                        help="properties of the generated schema (default 200)")
    parser.add_argument("--batch", type=int, default=64,
                        help="requests whose masks one step computes (default 64)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each figure; the median is reported (default 5)")
    parser.add_argument("--skip-outlines", action="store_true",
                        help="time llguidance only (outlines-core's compile takes seconds)")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    schema = wide_schema(args.properties)
    document = sample_document(args.properties)
    json.loads(document)
    engines = [("llguidance", bench_llguidance)]
    if not args.skip_outlines:
        engines.append(("outlines-core", bench_outlines))
    print(f"{args.properties}-property schema, batch {args.batch}, vocabulary "
          f"{tokenizer.vocab_size}, median of {args.repeats}")
    print("| engine | compile ms | mask ms, whole batch | mask us per row |")
    print("|---|---:|---:|---:|")
    for name, bench in engines:
        compile_s, mask_s = bench(tokenizer, schema, document, args.batch, args.repeats)
        c, m = statistics.median(compile_s), statistics.median(mask_s)
        print(f"| {name} | {c * 1e3:.1f} | {m * 1e3:.2f} | {m / args.batch * 1e6:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
