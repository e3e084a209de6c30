"""Tool calls in a model's output text: the Hermes / Qwen `<tool_call>` format.

    free text <tool_call>{"name": "f", "arguments": {...}}</tool_call> more text <tool_call>...

Families covered: models trained on the Hermes function-calling format (NousResearch Hermes
2 and 3, Qwen 2, 2.5 and 3, and templates derived from them), and whatever the gateway's own
tool block asks for (text/tool_prompt.py) and its grammar forces
(gateway/api/tool_request.py). Other formats (Llama 3's bare JSON, Mistral's
`[TOOL_CALLS]`, ...) stay text.

One reader, `ToolCallStream`, fed piece by piece (streams); `parse_tool_calls` runs it over
a whole answer (JSON responses), so both give the same calls. Text outside the calls is
released as soon as it cannot be the start of a `<tool_call>` tag. A call written name
first (`{"name": "<a known tool>", "arguments": {...`, the Hermes order, and the only one
the gateway's grammar allows) streams: its start as soon as its name is known, then its
arguments as the model writes them (their text is the model's own). Any other call is
read whole at its `</tool_call>` (or the end): kept when its body is a JSON object with a
string `name` among `known_names` (when given) and an `arguments` (or `parameters`)
object, else left in the text. A streamed call is a call whatever follows its start (its
arguments are not parsed: a model may write invalid JSON there, as OpenAI's may).
Side-effect free apart from `ToolCallStream`'s own buffer.
"""

from __future__ import annotations

import re
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
    """The calls in a whole answer and the text around them (exactly what the stream
    reader gives, assembled)."""
    stream = ToolCallStream(known_names)
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    started: CallStart | None = None
    arguments: list[str] = []
    for piece in stream.feed(text) + stream.finish():
        if isinstance(piece, str):
            content.append(piece)
        elif isinstance(piece, ParsedToolCall):
            calls.append(piece)
        elif isinstance(piece, CallStart):
            started, arguments = piece, []
        elif isinstance(piece, ArgumentsPiece):
            arguments.append(piece.text)
        else:
            assert started is not None
            calls.append(ParsedToolCall(started.name, "".join(arguments)))
    joined = "".join(content)
    return ParsedAnswer((joined.strip() if calls else joined) or None, tuple(calls))


@dataclass(frozen=True, slots=True)
class CallStart:
    """A call whose arguments follow as `ArgumentsPiece`s, then `CallEnd`."""

    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsPiece:
    text: str  # the next characters of the arguments object, as the model wrote them


@dataclass(frozen=True, slots=True)
class CallEnd:
    pass


Piece = str | ParsedToolCall | CallStart | ArgumentsPiece | CallEnd
# The start of a call body whose arguments can stream: name first, then an object.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class ToolCallStream:
    """Splits streamed text into plain text and calls, in order.

    A call that starts `{"name": "<a known tool>", "arguments": {` streams: `CallStart`
    as soon as that much has arrived, then its arguments as they come (`ArgumentsPiece`;
    only the last `}` seen is held back, since it may close the call's outer object), then
    `CallEnd` at `</tool_call>` or the end of the answer. Any other call comes whole
    (`ParsedToolCall`) at its closing tag, or as text when it is not one.

    Invariant: every character fed comes out exactly once, once `finish()` has been
    called: as text, inside a call, or as a call's JSON punctuation; what is held back is
    at most an unfinished call, or a tail that could still become `<tool_call>`.
    """

    def __init__(self, known_names: Collection[str] | None = None) -> None:
        self._known = known_names
        self._held = ""  # not yet released: an open call, or a possible tag start
        self._arguments_at: int | None = None  # streaming a call: where its arguments start
        self._num_sent = 0  # of those arguments
        self.num_calls = 0

    def feed(self, piece: str) -> list[Piece]:
        self._held += piece
        out: list[Piece] = []
        while True:
            if self._arguments_at is not None:
                if not self._stream_arguments(out):
                    return out
                continue
            start = self._held.find(OPEN_TAG)
            if start < 0:
                keep = _partial_tag_len(self._held)
                cut = len(self._held) - keep
                if cut:
                    out.append(self._held[:cut])
                self._held = self._held[cut:]
                return out
            if start:
                out.append(self._held[:start])
                self._held = self._held[start:]
            self._try_header(out)
            if self._arguments_at is not None:
                continue  # written name first: it streams
            end = self._held.find(CLOSE_TAG, len(OPEN_TAG))
            if end < 0:
                return out  # the call is still arriving
            body = self._held[len(OPEN_TAG):end]
            whole = self._held[:end + len(CLOSE_TAG)]
            self._held = self._held[end + len(CLOSE_TAG):]
            out.append(self._call_or_text(body, whole))

    def finish(self) -> list[Piece]:
        """The end of the answer: a call cut before its closing tag still counts when its
        JSON is whole (models often stop at EOS right after it)."""
        if self._arguments_at is not None:
            out: list[Piece] = []
            self._end_arguments(len(self._held), out)
            self._held = ""
            return out
        held, self._held = self._held, ""
        if held.startswith(OPEN_TAG):
            return [self._call_or_text(held[len(OPEN_TAG):], held)]
        return [held] if held else []

    def _try_header(self, out: list[Piece]) -> None:
        """An open call whose name and the start of its arguments object have arrived
        starts streaming."""
        match = _HEADER.match(self._held, len(OPEN_TAG))
        if match is None or match.end() >= len(self._held) or self._held[match.end()] != "{":
            return
        if self._known is not None and match.group(1) not in self._known:
            return
        self.num_calls += 1
        out.append(CallStart(match.group(1)))
        self._arguments_at, self._num_sent = match.end(), 0

    def _stream_arguments(self, out: list[Piece]) -> bool:
        """Releases what is safe of a streaming call; True when the call ended."""
        assert self._arguments_at is not None
        end = self._held.find(CLOSE_TAG, self._arguments_at)
        if end >= 0:
            self._end_arguments(end, out)
            self._held = self._held[end + len(CLOSE_TAG):]
            return True
        last_brace = self._held.rfind("}", self._arguments_at)
        safe = last_brace if last_brace >= 0 else len(self._held)
        self._send(safe, out)
        return False

    def _end_arguments(self, end: int, out: list[Piece]) -> None:
        """The call's text ends at `end`: its arguments end before the last `}` (the
        call's own object closes there)."""
        assert self._arguments_at is not None
        close = self._held.rfind("}", self._arguments_at, end)
        self._send(close if close >= 0 else end, out, final=True)
        out.append(CallEnd())
        self._arguments_at = None

    def _send(self, stop: int, out: list[Piece], final: bool = False) -> None:
        assert self._arguments_at is not None
        begin = self._arguments_at + self._num_sent
        text = self._held[begin:stop]
        if final:
            text = text.rstrip()
        if text:
            out.append(ArgumentsPiece(text))
            self._num_sent += len(text)

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
