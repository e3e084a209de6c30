"""A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls` -> one `ToolUse`.

Side-effect free. What each choice means here:

    tool_choice   the prompt         the output                     the answer
    none          no tools           unconstrained                  text
    auto          the tools          unconstrained                  calls parsed from the text
    (default with tools)                                            (text/tool_calls.py)
    required      the tools          forced: one call or more       the calls
    {"type": "function", "function": {"name": f}}
                  the tools          forced: calls of f             the calls

Forced calls use the structured-output path (protocol/grammar_spec.py): a Lark grammar whose
calls embed each tool's parameter schema (llguidance's `%json`), so a worker needs nothing
new and a migrated request replays its calls through the same grammar:

    start: call ("\\n" call)*           (just `call` with parallel_tool_calls false)
    call:  "<tool_call>" (fn_0 | fn_1 | ...) "</tool_call>"
    fn_i:  %json {"name": const tool i, "arguments": tool i's parameters}

Every tool's parameter schema is compiled at the gateway before routing (a schema that does
not compile is a 400 naming `tools[i].function.parameters`), whatever the choice.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.api.errors import invalid_request, unsupported
from protocol.grammar_spec import MAX_GRAMMAR_CHARS, GrammarKind, GrammarSpec
from text.tool_calls import CLOSE_TAG, OPEN_TAG
from text.tool_prompt import ToolFunction

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"  # one function, by name


@dataclass(frozen=True, slots=True)
class ToolUse:
    functions: tuple[ToolFunction, ...]
    choice: ToolChoice
    parallel: bool = True
    named: str | None = None  # ToolChoice.NAMED: the function

    @property
    def in_prompt(self) -> tuple[ToolFunction, ...]:
        """The tools the model is shown (none with tool_choice none)."""
        return () if self.choice is ToolChoice.NONE else self.functions

    @property
    def parses_output(self) -> bool:
        return self.choice is not ToolChoice.NONE and bool(self.functions)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    def grammar(self) -> GrammarSpec | None:
        """The grammar forcing the calls (required, named); None for none and auto."""
        if self.choice not in (ToolChoice.REQUIRED, ToolChoice.NAMED):
            return None
        chosen = [f for f in self.functions if self.named in (None, f.name)]
        return tool_call_grammar(tuple(chosen), self.parallel)


def tool_use_from_request(tools: list[object] | None, tool_choice: object,
                          parallel_tool_calls: bool | None) -> ToolUse | None:
    """The request's tools and how they may be used; None when it has none and asks for
    none. ApiError(400) naming the field. `tools` and `tool_choice` are the body's JSON
    values, unchecked: their shapes are checked here."""
    functions = _functions(tools) if tools is not None else ()
    choice, named = _choice(tool_choice, functions)
    if not functions and choice is ToolChoice.NONE:
        return None
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolUse(functions, choice, parallel, named)


def parameters_spec(function: ToolFunction) -> GrammarSpec:
    """A tool's parameter schema alone, to check that it compiles."""
    return GrammarSpec(GrammarKind.JSON_SCHEMA, msgspec.json.encode(function.parameters).decode())


def tool_call_grammar(functions: tuple[ToolFunction, ...], parallel: bool) -> GrammarSpec:
    """The Lark grammar of one or more `<tool_call>` calls of `functions` (module docstring)."""
    rules = [f"fn_{i}: %json {msgspec.json.encode(_call_schema(f)).decode()}"
             for i, f in enumerate(functions)]
    alternatives = " | ".join(f"fn_{i}" for i in range(len(functions)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    source = "\n".join([start, f'call: "{OPEN_TAG}" ({alternatives}) "{CLOSE_TAG}"', *rules])
    if len(source) > MAX_GRAMMAR_CHARS:
        raise invalid_request(f"The tools' schemas make a grammar of {len(source)} characters; "
                              f"at most {MAX_GRAMMAR_CHARS} are allowed.", "tools",
                              code="grammar_too_large")
    return GrammarSpec(GrammarKind.LARK, source)


def _call_schema(function: ToolFunction) -> dict[str, Any]:
    """{"name": const, "arguments": parameters}, with the parameters' definitions moved to
    the root so their `#/$defs/...` references still resolve."""
    parameters = dict(function.parameters)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}
    for key in ("$defs", "definitions"):
        if key in parameters:
            schema[key] = parameters.pop(key)
    return schema


def _functions(tools: list[object]) -> tuple[ToolFunction, ...]:
    if len(tools) > MAX_TOOLS:
        raise invalid_request(f"At most {MAX_TOOLS} tools per request; got {len(tools)}.", "tools")
    functions: list[ToolFunction] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_request(f"`{where}` must be an object.", where, code="invalid_type")
        if tool.get("type", "function") != "function":
            raise unsupported(f"Tool type `{tool.get('type')}` is not supported; only "
                              "`function` is.", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid_request(f"`{where}.function` must be an object.", f"{where}.function",
                                  code="missing_required_parameter")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid_request("A function name must be 1 to 64 letters, digits, `_` or "
                                  f"`-`; got {name!r}.", f"{where}.function.name")
        if any(f.name == name for f in functions):
            raise invalid_request(f"Two tools are named `{name}`.", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid_request("`description` must be a string.",
                                  f"{where}.function.description", code="invalid_type")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise invalid_request("`parameters` must be a JSON schema (an object).",
                                  f"{where}.function.parameters", code="invalid_type")
        if "$ref" in parameters:
            raise unsupported("A `$ref` at the root of `parameters` is not supported; inline "
                              "the object schema.", f"{where}.function.parameters")
        functions.append(ToolFunction(name, description, parameters or _EMPTY_PARAMETERS))
    return tuple(functions)


def _choice(value: object, functions: tuple[ToolFunction, ...]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return (ToolChoice.AUTO if functions else ToolChoice.NONE), None
    if isinstance(value, str):
        try:
            choice = ToolChoice(value)
        except ValueError:
            choice = ToolChoice.NAMED
        if choice is ToolChoice.NAMED:
            raise invalid_request("`tool_choice` must be none, auto, required or "
                                  '{"type": "function", "function": {"name": ...}}; got '
                                  f"{value!r}.", "tool_choice")
        if choice is ToolChoice.REQUIRED and not functions:
            raise invalid_request("`tool_choice` required needs `tools`.", "tool_choice")
        return choice, None
    if not isinstance(value, dict) or value.get("type") != "function" \
            or not isinstance(value.get("function"), dict):
        raise invalid_request('`tool_choice` must be none, auto, required or {"type": '
                              '"function", "function": {"name": ...}}.', "tool_choice")
    name = value["function"].get("name")
    if not isinstance(name, str) or not any(f.name == name for f in functions):
        raise invalid_request(f"`tool_choice` names the function {name!r}, which is not among "
                              "`tools`.", "tool_choice.function.name")
    return ToolChoice.NAMED, name
