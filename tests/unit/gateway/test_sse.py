from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.backend import TokenLogprob
from gateway.api.chunk_encoder import ChatChunkEncoder, CompletionChunkEncoder
from gateway.api.openai_api import (ChatChunkChoice, ChatCompletionChunk, ChatDelta,
                                    CompletionChoice, CompletionChunk, Usage)
from gateway.api.sse import DONE_EVENT, SseDecoder, encode_event

texts = st.text(min_size=0, max_size=20)


def test_encode_event_and_done():
    assert encode_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert DONE_EVENT == b"data: [DONE]\n\n"
    with pytest.raises(ValueError):
        encode_event(b"two\nlines")


def test_decoder_handles_crlf_comments_and_multiline_data():
    decoder = SseDecoder()
    stream = b": keep-alive\r\n\r\ndata: a\r\ndata: b\r\n\r\nevent: x\ndata:c\n\ndata: [DONE]\r\r"
    # The final \r may be the first half of \r\n: the event completes with the next byte.
    assert decoder.feed(stream) == [b"a\nb", b"c"]
    assert decoder.has_partial_event
    assert decoder.feed(b"\n") == [b"[DONE]"]
    assert not decoder.has_partial_event


@settings(max_examples=200, deadline=None)
@given(payloads=st.lists(texts.map(lambda t: msgspec.json.encode(t)), max_size=10),
       cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_no_event_is_merged_split_or_reordered_whatever_the_framing(payloads, cuts):
    stream = b"".join(encode_event(p) for p in payloads) + DONE_EVENT
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = SseDecoder()
    events = []
    for start, end in zip(points, points[1:]):
        events += decoder.feed(stream[start:end])
    assert events == payloads + [b"[DONE]"]


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_fast_chat_chunk_bytes_equal_struct_encoding(text):
    enc = ChatChunkEncoder("chatcmpl-1", 123, "m")
    expected = ChatCompletionChunk(id="chatcmpl-1", created=123, model="m", choices=[
        ChatChunkChoice(index=0, delta=ChatDelta(content=text))])
    assert enc.text(text) == encode_event(msgspec.json.encode(expected))


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_fast_completion_chunk_bytes_equal_struct_encoding(text):
    enc = CompletionChunkEncoder("cmpl-1", 123, "m")
    expected = CompletionChunk(id="cmpl-1", created=123, model="m",
                               choices=[CompletionChoice(index=0, text=text)])
    assert enc.text(text) == encode_event(msgspec.json.encode(expected))


def test_chat_role_finish_usage_and_logprob_chunks_decode_as_openai_shapes():
    enc = ChatChunkEncoder("chatcmpl-1", 123, "m")
    role = msgspec.json.decode(enc.role()[6:-2])
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finish = msgspec.json.decode(enc.text("", finish_reason="stop")[6:-2])
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "stop"
    usage = msgspec.json.decode(enc.usage(Usage(prompt_tokens=3, completion_tokens=2,
                                                total_tokens=5))[6:-2])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    lp = msgspec.json.decode(enc.text("hi", logprobs=(TokenLogprob(token="hi", logprob=-0.1,
                                                                   top=(("ho", -2.0),)),))[6:-2])
    content = lp["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "hi" and content["top_logprobs"][0]["token"] == "ho"
    assert content["bytes"] == list(b"hi")


def test_completion_logprob_text_offsets_follow_the_stream():
    enc = CompletionChunkEncoder("cmpl-1", 1, "m")
    enc.text("abc")
    chunk = msgspec.json.decode(enc.text("de", logprobs=(TokenLogprob(token="d", logprob=-1.0),
                                                         TokenLogprob(token="e", logprob=-2.0)))[6:-2])
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [3, 4]
