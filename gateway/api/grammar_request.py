"""A request's output constraint, from whichever field names it, as one `GrammarSpec`.

Side-effect free. The fields, all on both endpoints (OpenAI names `response_format` on
chat only; vLLM takes it on completions too):

    response_format: {"type": "text"}                  -> no grammar
                     {"type": "json_object"}           -> JSON_SCHEMA {"type": "object"}
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
                                                       -> JSON_SCHEMA schema
    structured_outputs (vLLM): {"json": schema}        -> JSON_SCHEMA
                               {"json_object": true}   -> JSON_SCHEMA {"type": "object"}
                               {"regex": "..."}        -> REGEX
                               {"choice": ["a", "b"]}  -> REGEX (a)|(b), escaped
                               {"grammar": "..."}      -> LARK (Lark, or GBNF converted)
    guided_json, guided_regex, guided_choice, guided_grammar (vLLM before 0.12): the same

At most one of them may constrain a request (two are a 400, as is any other vLLM option:
`structural_tag`, `whitespace_pattern`). Whether the grammar compiles is checked later,
off the event loop (gateway/api/grammar_check.py).

Tool calling reuses the same path: `tool_choice: "required"` (or a named function) becomes a
LARK spec (gateway/api/tool_request.py), `<tool_call>` tags around each tool's
`{"name": const, "arguments": parameters}` schema, and the answer's text is parsed into
`tool_calls` (gateway/api/tool_answer.py); the workers need nothing new.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.api.errors import ApiError, invalid_request, unsupported
from gateway.api.openai_api import SamplingFields
from protocol.grammar_spec import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec
from text.grammar import GrammarError, to_lark

JSON_OBJECT_SCHEMA = '{"type":"object"}'
MAX_CHOICES = 1024
# Characters that mean something in a regex; escaped in a `choice` alternative.
_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$#&-~")


def grammar_from_request(fields: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The request's grammar and the field that gave it (None: unconstrained); ApiError(400)
    naming the field."""
    found: list[tuple[str, GrammarSpec]] = []
    fmt = fields.response_format
    if fmt is not None:
        spec = _from_response_format(fmt.type, fmt.json_schema)
        if spec is not None:
            found.append(("response_format", spec))
    so = fields.structured_outputs
    if so is not None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(so, name) is not None:
                raise unsupported(f"`structured_outputs.{name}` is not supported.",
                                  f"structured_outputs.{name}")
        options = [(f"structured_outputs.{name}", value) for name, value in
                   (("json", so.json), ("regex", so.regex), ("choice", so.choice),
                    ("grammar", so.grammar)) if value is not None]
        if so.json_object:
            options.append(("structured_outputs.json_object", None))
        found += [(param, _from_option(param, value)) for param, value in options]
    if fields.guided_whitespace_pattern is not None:
        raise unsupported("`guided_whitespace_pattern` is not supported.",
                          "guided_whitespace_pattern")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(fields, name)
        if value is not None:
            found.append((name, _from_option(name, value)))
    if len(found) > 1:
        raise invalid_request(f"Only one output constraint per request: `{found[0][0]}` and "
                              f"`{found[1][0]}` both given.", found[1][0])
    return (found[0][1], found[0][0]) if found else None


def _from_response_format(kind: str, json_schema: Any) -> GrammarSpec | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        if json_schema is None:
            raise invalid_request("`response_format.json_schema` is required when the type is "
                                  "`json_schema`.", "response_format.json_schema",
                                  code="missing_required_parameter")
        if json_schema.schema is None:
            # OpenAI: a missing schema means any JSON object... with no schema, just "JSON".
            return GrammarSpec(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA)
        return _json_spec(json_schema.schema, "response_format.json_schema.schema")
    raise unsupported(f"response_format `{kind}` is not supported; use text, json_object or "
                      "json_schema.", "response_format.type")


def _from_option(param: str, value: Any) -> GrammarSpec:
    name = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if name == "json_object":
        return GrammarSpec(GrammarKind.JSON_SCHEMA, JSON_OBJECT_SCHEMA)
    if name == "json":
        return _json_spec(value, param)
    if name == "regex":
        if not isinstance(value, str) or not value:
            raise invalid_request(f"`{param}` must be a non-empty string.", param)
        return GrammarSpec(GrammarKind.REGEX, _bounded(value, param))
    if name == "choice":
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise invalid_request(f"`{param}` must be a list of 1 to {MAX_CHOICES} non-empty "
                                  "strings.", param)
        return GrammarSpec(GrammarKind.REGEX, _bounded(choice_regex(value), param))
    assert name == "grammar", name
    if not isinstance(value, str) or not value.strip():
        raise invalid_request(f"`{param}` must be a non-empty grammar (Lark or GBNF).", param)
    try:
        lark = to_lark(_bounded(value, param))
    except GrammarError as exc:
        raise invalid_request(f"`{param}` is not a valid grammar: {exc}", param,
                              code="invalid_grammar") from exc
    return GrammarSpec(GrammarKind.LARK, _bounded(lark, param))


def _json_spec(schema: Any, param: str) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(_bounded(schema, param))
        except msgspec.DecodeError as exc:
            raise invalid_request(f"`{param}` is not valid JSON: {exc}.", param) from exc
    if not isinstance(schema, (dict, bool)):
        raise invalid_request(f"`{param}` must be a JSON schema (an object).", param)
    source = msgspec.json.encode(schema).decode()
    return GrammarSpec(GrammarKind.JSON_SCHEMA, _bounded(source, param))


def _bounded(source: str, param: str) -> str:
    if len(source) > MAX_GRAMMAR_CHARS:
        raise invalid_request(f"`{param}` has {len(source)} characters; at most "
                              f"{MAX_GRAMMAR_CHARS} are allowed.", param, code="grammar_too_large")
    return source


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (each taken literally)."""
    return "|".join("(" + "".join("\\" + c if c in _REGEX_SPECIAL else c for c in choice) + ")"
                    for choice in choices)


def grammar_error(message: str, spec: GrammarSpec, param: str) -> ApiError:
    """The 400 for a grammar that does not compile (`message` says why)."""
    what = {GrammarKind.JSON_SCHEMA: "JSON schema", GrammarKind.REGEX: "regex",
            GrammarKind.LARK: "grammar"}[spec.kind]
    return invalid_request(f"The {what} in `{param}` cannot be used: {message}", param,
                           code="invalid_grammar")
