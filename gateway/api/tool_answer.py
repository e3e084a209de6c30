"""A chat choice's tool calls in the answer: `message.tool_calls` (JSON) or tool-call deltas
(SSE), from the calls text/tool_calls.py finds in the generated text.

    JSON   message = {"role": "assistant", "content": text outside the calls or null,
                      "tool_calls": [{"id": "call_…", "type": "function",
                                      "function": {"name", "arguments": JSON text}}]}
    SSE    text outside the calls as `content` deltas; each call as deltas of
           `tool_calls[index]`: {index, id, type, function: {name, arguments: ""}} once its
           name is known, then {index, function: {arguments: the next piece}} as the
           arguments arrive (all at once for a call not written name first), which the
           official client assembles

`finish_reason` is "tool_calls" when the choice made a call and ended normally ("stop");
a choice cut by `max_tokens` keeps "length".
"""

from __future__ import annotations

import uuid
from collections.abc import Collection

from gateway.api.openai_api import (ChatResponseMessage, ToolCall, ToolCallDelta, ToolCallFunction,
                                    ToolCallFunctionDelta)
from protocol.finish_reason import FinishReason
from text.tool_calls import (ArgumentsPiece, CallStart, ParsedToolCall, ToolCallStream,
                             parse_tool_calls)

TOOL_CALLS = "tool_calls"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def answer_finish_reason(finish_reason: FinishReason | None, num_calls: int) -> str | None:
    if num_calls and finish_reason is FinishReason.STOP:
        return TOOL_CALLS
    return finish_reason


def tool_message(text: str, known_names: Collection[str]) -> tuple[ChatResponseMessage, int]:
    """The message of a whole answer, and how many calls it holds."""
    parsed = parse_tool_calls(text, known_names)
    if not parsed.tool_calls:
        return ChatResponseMessage(role="assistant", content=text), 0
    calls = [ToolCall(id=new_call_id(), function=ToolCallFunction(name=c.name,
                                                                   arguments=c.arguments))
             for c in parsed.tool_calls]
    return ChatResponseMessage(role="assistant", content=parsed.content, tool_calls=calls), \
        len(calls)


class ToolDeltas:
    """One streamed choice: its text in, content and tool-call deltas out."""

    def __init__(self, known_names: Collection[str]) -> None:
        self._stream = ToolCallStream(known_names)
        self._num_started = 0

    @property
    def num_calls(self) -> int:
        return self._stream.num_calls

    def feed(self, text: str, last: bool) -> tuple[str, list[ToolCallDelta]]:
        """The content to send now and the call deltas (each its own event); `last`: the
        choice ends with this text."""
        pieces = self._stream.feed(text)
        if last:
            pieces += self._stream.finish()
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(piece)
            elif isinstance(piece, ParsedToolCall):
                deltas.append(_named(self._num_started, piece.name))
                deltas.append(_arguments(self._num_started, piece.arguments))
                self._num_started += 1
            elif isinstance(piece, CallStart):
                deltas.append(_named(self._num_started, piece.name))
                self._num_started += 1
            elif isinstance(piece, ArgumentsPiece):
                deltas.append(_arguments(self._num_started - 1, piece.text))
        return "".join(content), deltas


def _named(index: int, name: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=new_call_id(), type="function",
                         function=ToolCallFunctionDelta(name=name, arguments=""))


def _arguments(index: int, text: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=ToolCallFunctionDelta(arguments=text))
