"""Random JSON schemas for fuzzing the gateway's schema path: a seeded generator of valid,
invalid and pathological schemas (deep nesting, huge bounds, catastrophic patterns, broken
references, wrong types, wide unions). Deterministic for a seed; no I/O.
"""

from __future__ import annotations

import json
import random
from typing import Any

_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]
_FORMATS = ["date-time", "date", "time", "email", "uuid", "uri", "ipv4", "hostname", "nope"]
_PATTERNS = ["^[a-z]+$", "^[0-9]{3}-[0-9]{4}$", "(a+)+$", "(", "[z-a]", "\\", "^(a|aa)*$",
             "\\p{L}+", ".*", "^$", "a{1000000}", "(?=x)", "[^\\s]{2,5}"]
_WEIRD = [None, True, False, -1, 0, 1.5, 10**30, -10**30, "", "x", [], {}, [1, "a"],
          {"a": None}, "\u0000", "😀" * 3]


class SchemaGenerator:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def schema(self) -> Any:
        """One schema: about half valid, the rest invalid or pathological."""
        roll = self.rng.random()
        if roll < 0.5:
            return self.valid(depth=0)
        if roll < 0.8:
            return self.invalid()
        return self.pathological()

    # ---- valid -------------------------------------------------------------------------
    def valid(self, depth: int) -> dict[str, Any]:
        rng = self.rng
        kind = rng.choice(_TYPES if depth < 4 else _TYPES[2:])
        schema: dict[str, Any] = {"type": kind}
        if kind == "object":
            names = [self._name() for _ in range(rng.randint(0, 5))]
            schema["properties"] = {n: self.valid(depth + 1) for n in names}
            if names and rng.random() < 0.7:
                schema["required"] = rng.sample(names, rng.randint(1, len(set(names))))
                schema["required"] = sorted(set(schema["required"]))
            if rng.random() < 0.5:
                schema["additionalProperties"] = rng.random() < 0.3
        elif kind == "array":
            schema["items"] = self.valid(depth + 1)
            if rng.random() < 0.5:
                low = rng.randint(0, 3)
                schema["minItems"], schema["maxItems"] = low, low + rng.randint(0, 4)
        elif kind == "string":
            choice = rng.random()
            if choice < 0.2:
                schema["pattern"] = rng.choice(_PATTERNS[:2] + _PATTERNS[-1:])
            elif choice < 0.4:
                schema["maxLength"] = rng.randint(1, 30)
            elif choice < 0.5:
                schema["format"] = rng.choice(_FORMATS[:-1])
            elif choice < 0.6:
                return {"enum": [self._name() for _ in range(rng.randint(1, 5))]}
        elif kind in ("number", "integer"):
            if rng.random() < 0.5:
                low = rng.randint(-100, 100)
                schema["minimum"], schema["maximum"] = low, low + rng.randint(0, 100)
        if depth < 3 and rng.random() < 0.1:
            return {"anyOf": [schema, self.valid(depth + 1)]}
        if depth == 0 and rng.random() < 0.1:
            return {"$defs": {"item": schema}, "type": "object",
                    "properties": {"x": {"$ref": "#/$defs/item"}}, "required": ["x"]}
        return schema

    # ---- invalid -----------------------------------------------------------------------
    def invalid(self) -> Any:
        rng = self.rng
        base = self.valid(depth=1)
        mutation = rng.randrange(12)
        if mutation == 0:
            return {"type": rng.choice(["foo", 7, ["string", "nope"], None])}
        if mutation == 1:
            return {"type": "string", "pattern": rng.choice(_PATTERNS)}
        if mutation == 2:
            return {"type": "integer", "minimum": 10, "maximum": rng.randint(-10, 5)}
        if mutation == 3:
            return {"type": "object", "properties": rng.choice(_WEIRD)}
        if mutation == 4:
            return {"type": "object", "properties": {"a": {"type": "string"}},
                    "required": rng.choice(_WEIRD + [["b"]])}
        if mutation == 5:
            return {"$ref": rng.choice(["#/$defs/missing", "http://example.com/s.json", "#", ""])}
        if mutation == 6:
            return rng.choice(_WEIRD)
        if mutation == 7:
            return {"enum": rng.choice([[], 5, None, [{"a": [1]}]])}
        if mutation == 8:
            return {"allOf": [{"type": "string"}, {"type": "integer"}]}
        if mutation == 9:
            return {"type": "string", "format": "nope", "minLength": rng.choice(_WEIRD)}
        if mutation == 10:
            key = rng.choice(["minItems", "maxLength", "multipleOf", "minProperties"])
            return {**base, key: rng.choice(_WEIRD)}
        return {**base, rng.choice(["x-guidance", "$schema", "if", "not"]): rng.choice(_WEIRD)}

    # ---- pathological ------------------------------------------------------------------
    def pathological(self) -> Any:
        rng = self.rng
        kind = rng.randrange(8)
        if kind == 0:  # deep nesting
            schema: dict[str, Any] = {"type": "string"}
            for _ in range(rng.choice([50, 200, 400])):
                schema = {"type": "array", "items": schema}
            return schema
        if kind == 1:  # huge bounds
            return {"type": "array", "items": {"type": "string", "minLength": 10**9},
                    "minItems": 10**9}
        if kind == 2:  # a wide union
            return {"anyOf": [{"const": f"v{i}"} for i in range(rng.choice([100, 2000]))]}
        if kind == 3:  # catastrophic patterns
            return {"type": "string", "pattern": rng.choice(["(a+)+$", "(a|a)*b", "(x+x+)+y",
                                                             "((a*)*)*c"])}
        if kind == 4:  # self reference
            return {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                    "required": ["next"]}}, "$ref": "#/$defs/n"}
        if kind == 5:  # many properties
            return {"type": "object", "required": [f"p{i}" for i in range(300)],
                    "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
        if kind == 6:  # unsatisfiable
            return {"type": "object", "properties": {"a": False}, "required": ["a"]}
        return {"type": "string", "enum": ["x" * 5000] * rng.randint(1, 3)}

    def _name(self) -> str:
        rng = self.rng
        return rng.choice(["a", "name", "age", "é", "with space", "x" * 20, "$ref", "0", "🙂"]) \
            + str(rng.randint(0, 9))


def body_with(schema: object, way: int) -> bytes:
    """A chat body carrying `schema` one of three ways: 0 `response_format` json_schema,
    1 vLLM's `structured_outputs.json` (as JSON text), 2 a tool's parameters with
    `tool_choice` required."""
    base: dict[str, Any] = {"model": "m", "max_tokens": 8,
                            "messages": [{"role": "user", "content": "hi"}]}
    if way == 0:
        base["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "s", "schema": schema, "strict": True}}
    elif way == 1:
        base["structured_outputs"] = {"json": json.dumps(schema)}
    else:
        base["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        base["tool_choice"] = "required"
    return json.dumps(base).encode()
