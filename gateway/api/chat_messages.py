"""A chat request's `messages` -> `ChatTurn`s, or an ApiError(400) naming the message.

Side-effect free. Roles: system (and OpenAI's `developer`, read as system), user, assistant
(with `content`, `tool_calls`, or both) and tool (a call's result, `tool_call_id` naming
the call). Content is a string or a list of text parts (joined by newlines); other part
types are refused (the models served read text only).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.api.errors import invalid_request, unsupported
from gateway.api.openai_api import ChatMessage
from text.tool_prompt import ChatTurn, TurnToolCall

CHAT_ROLES: dict[str, str] = {"system": "system", "developer": "system", "user": "user",
                              "assistant": "assistant", "tool": "tool"}


def validate_messages(messages: list[ChatMessage]) -> tuple[ChatTurn, ...]:
    if not messages:
        raise invalid_request("`messages` must contain at least one message.", "messages")
    turns = []
    for i, m in enumerate(messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise unsupported(f"Message role `{m.role}` is not supported; use system, user, "
                              "assistant or tool.", f"messages[{i}].role")
        calls = _turn_tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        if calls and role != "assistant":
            raise invalid_request("Only assistant messages carry `tool_calls`.",
                                  f"messages[{i}].tool_calls")
        if m.content is None:
            if role != "assistant":
                raise invalid_request(f"A {m.role} message needs `content`.", f"messages[{i}].content")
            text = ""
        elif isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for j, part in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise unsupported(f"Content parts of type `{part.type}` are not supported "
                                      "(this model reads text only).", f"{where}.type")
                if part.text is None:
                    raise invalid_request("A text content part needs `text`.", f"{where}.text",
                                          code="missing_required_parameter")
                parts.append(part.text)
            text = "\n".join(parts)
        turns.append(ChatTurn(role, text, calls,
                              m.tool_call_id if role == "tool" else None))
    if turns[-1].role == "assistant" and len(turns) == 1:
        raise invalid_request("`messages` needs at least one system or user message.", "messages")
    return tuple(turns)


def _turn_tool_calls(calls: list[Any] | None, where: str) -> tuple[TurnToolCall, ...]:
    """An assistant message's `tool_calls`, as OpenAI returned them."""
    out = []
    for j, call in enumerate(calls or ()):
        here = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_request("A tool call needs `function.name`.", f"{here}.function",
                                  code="missing_required_parameter")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):  # an object is taken too (some clients send one)
            arguments = msgspec.json.encode(arguments).decode()
        call_id = call.get("id")
        out.append(TurnToolCall(call_id if isinstance(call_id, str) else f"call_{j}",
                                function["name"], arguments))
    return tuple(out)
