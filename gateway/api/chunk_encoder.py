"""Per-request encoders of streamed chunks into ready-to-write SSE events.

Every token of a stream becomes one event whose JSON differs from the previous one only
in the text. So each encoder serialises the constant part once, as a prefix and a
suffix around the text, and a token costs one `msgspec.json.encode(text)` plus two byte
concatenations:

    data: {"id":..,"choices":[{"index":0,"delta":{"content": <text> }, ... }]}\\n\\n
          |<--------------- prefix ------------------------->|       |<- suffix ->|

The bytes are identical to encoding the `openai_api` chunk Structs (a unit test holds
them to that); tokens with logprobs take the Struct path, since they are rare.
"""

from __future__ import annotations

import msgspec

from gateway.api.backend import TokenLogprob
from gateway.api.openai_api import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, ChatLogprobs,
                                    ChatTokenLogprob, CompletionChoice, CompletionChunk,
                                    CompletionLogprobs, TopLogprob, Usage)
from gateway.api.sse import encode_event

_MARK = "\x00pdserve-text\x00"  # stands in for the text while the template is encoded


def _split_template(chunk: msgspec.Struct) -> tuple[bytes, bytes]:
    encoded = msgspec.json.encode(chunk)
    mark = msgspec.json.encode(_MARK)
    prefix, found, suffix = encoded.partition(mark)
    if not found:
        raise AssertionError("text marker missing from the chunk template")
    return b"data: " + prefix, suffix + b"\n\n"


class CompletionChunkEncoder:
    """Events of one streamed /v1/completions response."""

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self._prefix, self._suffix = _split_template(self._chunk(_MARK, None, None))
        self._text_offset = 0

    def _chunk(self, text: str, finish_reason: str | None,
               logprobs: CompletionLogprobs | None) -> CompletionChunk:
        return CompletionChunk(id=self.response_id, created=self.created, model=self.model,
                               choices=[CompletionChoice(index=0, text=text, logprobs=logprobs,
                                                         finish_reason=finish_reason)])

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] | None = None,
             finish_reason: str | None = None) -> bytes:
        if logprobs is None and finish_reason is None:
            self._text_offset += len(text)
            return self._prefix + msgspec.json.encode(text) + self._suffix
        converted = None
        if logprobs is not None:
            converted = completion_logprobs(logprobs, self._text_offset)
        self._text_offset += len(text)
        return encode_event(msgspec.json.encode(self._chunk(text, finish_reason, converted)))

    def usage(self, usage: Usage) -> bytes:
        return encode_event(msgspec.json.encode(CompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)))


class ChatChunkEncoder:
    """Events of one streamed /v1/chat/completions response."""

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self.response_id, self.created, self.model = response_id, created, model
        self._prefix, self._suffix = _split_template(
            self._chunk(ChatDelta(content=_MARK), None, None))

    def _chunk(self, delta: ChatDelta, finish_reason: str | None,
               logprobs: ChatLogprobs | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model,
            choices=[ChatChunkChoice(index=0, delta=delta, logprobs=logprobs,
                                     finish_reason=finish_reason)])

    def role(self) -> bytes:
        """The first event: OpenAI announces the assistant role with empty content."""
        return encode_event(msgspec.json.encode(
            self._chunk(ChatDelta(role="assistant", content=""), None, None)))

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] | None = None,
             finish_reason: str | None = None) -> bytes:
        if logprobs is None and finish_reason is None:
            return self._prefix + msgspec.json.encode(text) + self._suffix
        converted = chat_logprobs(logprobs) if logprobs is not None else None
        # The finishing chunk carries the last text when there is some, else an empty delta.
        delta = ChatDelta(content=text) if text else ChatDelta()
        return encode_event(msgspec.json.encode(self._chunk(delta, finish_reason, converted)))

    def usage(self, usage: Usage) -> bytes:
        return encode_event(msgspec.json.encode(ChatCompletionChunk(
            id=self.response_id, created=self.created, model=self.model, choices=[], usage=usage)))


def completion_logprobs(logprobs: tuple[TokenLogprob, ...], text_offset: int) -> CompletionLogprobs:
    offsets, pos = [], text_offset
    for lp in logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return CompletionLogprobs(
        tokens=[lp.token for lp in logprobs],
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[dict(lp.top) for lp in logprobs],
        text_offset=offsets)


def chat_logprobs(logprobs: tuple[TokenLogprob, ...]) -> ChatLogprobs:
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=_utf8(lp.token),
                         top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_utf8(t))
                                       for t, v in lp.top])
        for lp in logprobs])


def _utf8(token: str) -> list[int]:
    # A token may end inside a multi-byte character; "replace" keeps the list well-formed.
    return list(token.encode("utf-8", "replace"))
