"""A conversation with tools, as the messages and `tools` a chat template renders.

Side-effect free. Two ways, chosen by the template:

    the template knows tools (its source uses `tools`): messages as `transformers` passes
        them (assistant `tool_calls` with `function.arguments` as an object, `tool` messages
        with `tool_call_id`), and `tools` as the OpenAI list of function definitions
    it does not (SmolLM2, many small models): everything folded into text, Hermes style:
        system   + a block listing the tools in <tools></tools>, and how to call them
        assistant  its content, then <tool_call>{"name": .., "arguments": {..}}</tool_call>
                   for each call
        tool       a user turn <tool_response>...</tool_response> (consecutive results
                   share one turn)
    so any template that renders system / user / assistant text renders a tool round trip,
    and the model is asked for exactly the format text/tool_calls.py parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from text.tool_calls import CLOSE_TAG, OPEN_TAG


@dataclass(frozen=True, slots=True)
class ToolFunction:
    """A function the model may call (OpenAI's `tools[i].function`)."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema for the arguments object


@dataclass(frozen=True, slots=True)
class TurnToolCall:
    """A call an assistant turn made (earlier in the conversation)."""

    call_id: str
    name: str
    arguments: str  # JSON text, as the client sends it back


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str  # system, user, assistant or tool
    content: str
    tool_calls: tuple[TurnToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool turn: the call it answers


def template_knows_tools(template: str) -> bool:
    """Whether a chat template renders `tools` itself (as `transformers` would pass them)."""
    return "tools" in template


def tools_block(functions: tuple[ToolFunction, ...]) -> str:
    """The system prompt's tool section for templates without tool support."""
    listed = "\n".join(msgspec.json.encode(_openai_tool(f)).decode() for f in functions)
    return ("# Tools\n\nYou may call one or more of the functions below to answer the user. "
            "Their signatures are given as JSON schemas inside <tools></tools>:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with one JSON object per call, each inside "
            f"{OPEN_TAG}{CLOSE_TAG} tags:\n"
            f'{OPEN_TAG}{{"name": <function name>, "arguments": <arguments object>}}{CLOSE_TAG}')


def folded_messages(turns: tuple[ChatTurn, ...], functions: tuple[ToolFunction, ...]
                    ) -> list[dict[str, object]]:
    """The conversation as system / user / assistant text (the Hermes-style fold)."""
    messages: list[dict[str, object]] = []
    for turn in turns:
        if turn.role == "tool":
            response = f"<tool_response>\n{turn.content}\n</tool_response>"
            last = messages[-1] if messages else None
            if last is not None and last.get("tool_responses"):
                last["content"] = f"{last['content']}\n{response}"
            else:
                messages.append({"role": "user", "content": response, "tool_responses": True})
            continue
        content = turn.content
        if turn.tool_calls:
            calls = "\n".join(f"{OPEN_TAG}{_call_json(c)}{CLOSE_TAG}" for c in turn.tool_calls)
            content = f"{content}\n{calls}" if content else calls
        messages.append({"role": turn.role, "content": content})
    for m in messages:
        m.pop("tool_responses", None)
    if functions:
        block = tools_block(functions)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages


def template_messages(turns: tuple[ChatTurn, ...]) -> list[dict[str, object]]:
    """The conversation as `transformers` hands it to a template that knows tools."""
    messages: list[dict[str, object]] = []
    for turn in turns:
        message: dict[str, object] = {"role": turn.role, "content": turn.content}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.call_id, "type": "function",
                 "function": {"name": c.name, "arguments": _arguments_object(c.arguments)}}
                for c in turn.tool_calls]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        messages.append(message)
    return messages


def template_tools(functions: tuple[ToolFunction, ...]) -> list[dict[str, object]] | None:
    return [_openai_tool(f) for f in functions] or None


def _openai_tool(function: ToolFunction) -> dict[str, object]:
    body: dict[str, object] = {"name": function.name}
    if function.description:
        body["description"] = function.description
    body["parameters"] = function.parameters
    return {"type": "function", "function": body}


def _arguments_object(arguments: str) -> object:
    try:
        return msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return arguments  # not JSON: passed on as the client wrote it


def _call_json(call: TurnToolCall) -> str:
    arguments = _arguments_object(call.arguments)
    return msgspec.json.encode({"name": call.name, "arguments": arguments}).decode()
