"""Tool calls in a model's output text: the Hermes / Qwen `<tool_call>` format.

    free text <tool_call>{"name": "f", "arguments": {...}}</tool_call> more text <tool_call>...

Families covered: models trained on the Hermes function-calling format (NousResearch Hermes
2 and 3, Qwen 2, 2.5 and 3, and templates derived from them), and whatever the gateway's own
tool block asks for (text/tool_prompt.py) and its grammar forces
(gateway/api/tool_request.py). Other formats (Llama 3's bare JSON, Mistral's
`[TOOL_CALLS]`, ...) stay text.

Two readers over the same format:

    parse_tool_calls(text)      the whole answer at once (JSON responses)
    ToolCallStream.feed(piece)  piece by piece (streams): text outside the calls is released
                                as soon as it cannot be the start of a `<tool_call>` tag; a
                                call is released once its `</tool_call>` (or the end) arrives

A call is kept only when its body is a JSON object with a string `name` among `known_names`
(when given) and an `arguments` (or `parameters`) object; anything else stays in the text.
Side-effect free apart from `ToolCallStream`'s own buffer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import msgspec

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    content: str | None  # the text outside the calls (None when there is none)
    tool_calls: tuple[ParsedToolCall, ...]


def parse_call_body(body: str, known_names: Collection[str] | None) -> ParsedToolCall | None:
    """A call from the JSON between the tags; None when it is not one."""
    try:
        value = msgspec.json.decode(body.strip())
    except msgspec.DecodeError:
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = msgspec.json.decode(arguments)
        except msgspec.DecodeError:
            return None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    if known_names is not None and name not in known_names:
        return None
    return ParsedToolCall(name, msgspec.json.encode(arguments).decode())


def parse_tool_calls(text: str, known_names: Collection[str] | None = None) -> ParsedAnswer:
    """The calls in a whole answer and the text around them."""
    stream = ToolCallStream(known_names)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls = tuple(p for p in pieces if isinstance(p, ParsedToolCall))
    if calls:
        content = content.strip()
    return ParsedAnswer(content or None, calls)


class ToolCallStream:
    """Splits streamed text into plain text and whole calls, in order.

    Invariant: every character fed comes out exactly once, as text or inside a call, once
    `finish()` has been called; what is held back is at most an unfinished call, or a tail
    that could still become `<tool_call>`.
    """

    def __init__(self, known_names: Collection[str] | None = None) -> None:
        self._known = known_names
        self._held = ""  # not yet released: an open call, or a possible tag start
        self.num_calls = 0

    def feed(self, piece: str) -> list[str | ParsedToolCall]:
        self._held += piece
        out: list[str | ParsedToolCall] = []
        while True:
            start = self._held.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag_len(self._held)
                text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                if text:
                    out.append(text)
                return out
            if start:
                out.append(self._held[:start])
                self._held = self._held[start:]
            end = self._held.find(CLOSE_TAG, len(OPEN_TAG))
            if end < 0:
                return out  # the call is still arriving
            body = self._held[len(OPEN_TAG):end]
            whole = self._held[:end + len(CLOSE_TAG)]
            self._held = self._held[end + len(CLOSE_TAG):]
            out.append(self._call_or_text(body, whole))

    def finish(self) -> list[str | ParsedToolCall]:
        """The end of the answer: a call cut before its closing tag still counts when its
        JSON is whole (models often stop at EOS right after it)."""
        held, self._held = self._held, ""
        if held.startswith(OPEN_TAG):
            return [self._call_or_text(held[len(OPEN_TAG):], held)]
        return [held] if held else []

    def _call_or_text(self, body: str, whole: str) -> str | ParsedToolCall:
        call = parse_call_body(body, self._known)
        if call is None:
            return whole
        self.num_calls += 1
        return call


def _partial_tag_len(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0
