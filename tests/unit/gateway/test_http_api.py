"""The HTTP layer on a real aiohttp server (127.0.0.1, port 0) with a scripted backend."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest
from gateway_harness import MODEL, Harness, ScriptedBackend, default_limits

from gateway.admission.tiers import load_tier_config
from gateway.api.sse import SseDecoder

pytestmark = pytest.mark.timeout(30)

GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
GOOD_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 5}


def body(**fields) -> bytes:
    return json.dumps({**GOOD_CHAT, **fields}).encode()


def assert_openai_error(status: int, raw: bytes, expected_status: int, param=None, code=None):
    assert status == expected_status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def assert_still_serving(h: Harness) -> None:
    status, _, raw = h.call("POST", "/v1/chat/completions", data=json.dumps(GOOD_CHAT))
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] == "Hello world!"
    assert h.controller.num_running == 0 and h.controller.num_queued == 0
    h.controller.check_invariants()


BATTERY = [
    # (path, raw body, extra headers, status, param, code)
    ("/v1/chat/completions", b'{"model": "test-model", "messages": [', {}, 400, None, "invalid_json"),
    ("/v1/chat/completions", b"", {}, 400, None, "invalid_json"),
    ("/v1/chat/completions", b"null", {}, 400, None, "invalid_json"),
    ("/v1/chat/completions", b'"just a string"', {}, 400, None, "invalid_json"),
    ("/v1/chat/completions", b'{"model": "test-model", "messages": [{"role": "user", "content": "\xc3\x28"}]}',
     {}, 400, None, "invalid_json"),
    ("/v1/chat/completions", body(max_tokens="ten"), {}, 400, "max_tokens", None),
    ("/v1/chat/completions", body(messages="hi"), {}, 400, "messages", None),
    ("/v1/chat/completions", body(messages=[{"role": "user", "content": 5}]), {}, 400,
     "messages[0].content", None),
    ("/v1/chat/completions", body(max_tokens=-1), {}, 400, "max_tokens", None),
    ("/v1/chat/completions", body(max_tokens=10**30), {}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/chat/completions", body(max_tokens=0), {}, 400, "max_tokens", None),
    ("/v1/chat/completions", body(messages=[]), {}, 400, "messages", None),
    ("/v1/chat/completions", body(n=17), {}, 400, "n", None),
    ("/v1/chat/completions", body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), {}, 400,
     "messages[0].content[0].type", "unsupported_value"),
    ("/v1/chat/completions", body(model="gpt-17"), {}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", body(), {"x-pdserve-tier": "platinum"}, 400, "x-pdserve-tier", "invalid_tier"),
    ("/v1/chat/completions", body(messages=[{"role": "user", "content": "x" * 600}]), {}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "prompt": ""}).encode(), {}, 400, "prompt", None),
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "prompt": [1, 2, 10**6]}).encode(), {}, 400,
     "prompt[2]", None),
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "temperature": -1}).encode(), {}, 400,
     "temperature", None),
    ("/v1/completions", b"x" * (70 * 1024), {}, 413, None, "request_too_large"),
    ("/v1/embeddings", body(), {}, 404, None, "unknown_url"),
    # A browser's cross-site form post, and plain text: refused before the body is read.
    ("/v1/chat/completions", body(), {"Content-Type": "application/x-www-form-urlencoded"},
     415, None, "unsupported_media_type"),
    ("/v1/completions", json.dumps(GOOD_COMPLETION).encode(), {"Content-Type": "text/plain"},
     415, None, "unsupported_media_type"),
    # Integers past what the wire carries are 400s, not 500s.
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "top_k": 10**20}).encode(), {}, 400,
     "top_k", None),
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "seed": 2**64}).encode(), {}, 400,
     "seed", None),
    ("/v1/completions", json.dumps({**GOOD_COMPLETION, "stop_token_ids": [2**40]}).encode(), {},
     400, "stop_token_ids", None),
]


def test_bad_input_battery_gets_openai_errors_and_server_stays_healthy(harness_factory):
    h = harness_factory()
    for path, raw, headers, status, param, code in BATTERY:
        got_status, _, got = h.call("POST", path, data=raw, headers=headers)
        assert_openai_error(got_status, got, status, param, code)
    assert h.backend.requests == []  # nothing bad reached the backend
    assert_still_serving(h)


def test_oversize_chunked_body_is_413_without_reading_it_all(harness_factory):
    h = harness_factory()

    async def chunks():
        for _ in range(100):
            yield b"x" * 4096

    status, _, raw = h.call("POST", "/v1/completions", data=chunks())
    assert_openai_error(status, raw, 413)
    assert_still_serving(h)


def test_a_body_that_does_not_arrive_in_time_is_408_and_changes_nothing(harness_factory):
    h = harness_factory(body_timeout_s=0.3)

    async def trickle():
        yield b'{"model": "'
        await asyncio.sleep(2.0)  # the rest never comes in time
        yield b'x"}'

    started = time.monotonic()
    status, _, raw = h.call("POST", "/v1/completions", data=trickle())
    assert time.monotonic() - started < 1.5, "the slow body was waited for"
    assert_openai_error(status, raw, 408, code="request_timeout")
    assert h.backend.requests == []
    h.gate.check_invariants()
    assert h.controller.num_running == h.controller.num_queued == 0
    assert_still_serving(h)


def test_streamed_chat_is_openai_shaped_with_usage_and_done(harness_factory):
    h = harness_factory()
    status, headers, raw = h.call("POST", "/v1/chat/completions", data=body(
        stream=True, stream_options={"include_usage": True}))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = SseDecoder().feed(raw)
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == "Hello world!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert len({c["id"] for c in chunks}) == 1


def test_streamed_completion_finishes_with_length_and_no_usage_by_default(harness_factory):
    h = harness_factory()
    status, _, raw = h.call("POST", "/v1/completions",
                            data=json.dumps({**GOOD_COMPLETION, "max_tokens": 2, "stream": True}))
    events = SseDecoder().feed(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert status == 200 and events[-1] == b"[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " world"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_slow_first_token_keeps_the_stream_alive_for_a_client_that_strips_chunks(
        harness_factory):
    """Before the first token, headers and keep-alives go out; a client that strips every
    chunk it reads and splits the rest on blank lines (vLLM's benchmark client does) still
    sees every event: a keep-alive is whitespace only, never glued to the next event."""
    gate = asyncio.Event()
    h = harness_factory(backend=ScriptedBackend(gate=gate), first_byte_s=0.01,
                        keepalive_s=0.01)

    async def read() -> tuple[list[bytes], list[bytes]]:
        chunks: list[bytes] = []
        async with h.session.post(h.server.make_url("/v1/completions"), json={
                **GOOD_COMPLETION, "stream": True}) as resp:
            assert resp.status == 200  # headers came without a token
            async for chunk in resp.content.iter_any():
                chunks.append(chunk)
                if len(chunks) == 3:  # keep-alives only so far: the backend is held
                    assert not h.backend.num_finished
                    gate.set()
        # The naive reader: strip each chunk, split on blank lines, and take a buffer
        # that is one whole `data:` line (JSON that parses, or [DONE]) as a message.
        buffer, messages = "", []
        for chunk in chunks:
            if not chunk.strip():
                continue
            buffer += chunk.strip().decode()
            while "\n\n" in buffer:
                message, buffer = buffer.split("\n\n", 1)
                messages.append(message.strip().encode())
            content = buffer.removeprefix("data: ")
            if buffer.startswith("data: ") and (content == "[DONE]" or _is_json(content)):
                messages.append(buffer.encode())
                buffer = ""
        assert not buffer, buffer
        return chunks, messages

    chunks, messages = h.loop.run_until_complete(read())
    assert all(not c.strip() for c in chunks[:3])
    datas = [m.removeprefix(b"data: ") for m in messages if m]
    assert datas[-1] == b"[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in datas[:-1]) == "Hello world!"
    # The standard parser agrees.
    assert SseDecoder().feed(b"".join(chunks))[-1] == b"[DONE]"


def test_a_client_gone_while_its_first_token_is_awaited_stops_the_backend(harness_factory):
    """A keep-alive that finds the client gone ends the wait for the first token: the
    backend's generation is closed (its work stopped) although no token ever came."""
    gate = asyncio.Event()
    h = harness_factory(backend=ScriptedBackend(gate=gate), first_byte_s=0.01,
                        keepalive_s=0.01)

    async def hang_up() -> None:
        reader, writer = await asyncio.open_connection(h.server.host, h.server.port)
        body = json.dumps({**GOOD_COMPLETION, "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.transport.abort()  # gone, with keep-alives still to come
        for _ in range(500):
            if h.backend.num_closed:
                break
            await asyncio.sleep(0.01)

    h.loop.run_until_complete(hang_up())
    assert h.backend.num_closed == 1 and h.backend.num_finished == 0
    assert not gate.is_set()


def test_non_streamed_completion_with_token_ids_and_logprobs(harness_factory):
    h = harness_factory()
    status, _, raw = h.call("POST", "/v1/completions", data=json.dumps(
        {**GOOD_COMPLETION, "prompt": [5, 6, 7], "logprobs": 2, "seed": 3}))
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert answer["choices"][0]["logprobs"]["tokens"] == ["Hello", " world", "!"]
    assert answer["choices"][0]["logprobs"]["text_offset"] == [0, 5, 11]
    sent = h.backend.requests[0]
    assert sent.prompt_token_ids == (5, 6, 7) and sent.sampling.seed == 3
    assert sent.local_prefill is None  # the built-in tiers leave the plan to the router


def test_models_endpoint(harness_factory):
    status, _, raw = harness_factory().call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == [MODEL]


def test_api_keys_and_tier_header(harness_factory):
    tiers = load_tier_config(
        '[[keys]]\nkey = "sk-a"\ntier = "batch"\n'
        '[[keys]]\nkey = "sk-b"\ntier = "standard"\nallow_tier_header = true\n', {})
    h = harness_factory(tiers=tiers)
    status, _, raw = h.call("POST", "/v1/chat/completions", data=body())
    assert_openai_error(status, raw, 401, code="missing_api_key")
    status, _, raw = h.call("POST", "/v1/chat/completions", data=body(),
                            headers={"Authorization": "Bearer sk-wrong"})
    assert_openai_error(status, raw, 401, code="invalid_api_key")
    status, _, raw = h.call("POST", "/v1/chat/completions", data=body(),
                            headers={"Authorization": "Bearer sk-a", "x-pdserve-tier": "interactive"})
    assert_openai_error(status, raw, 400, code="tier_not_allowed")
    assert h.call("POST", "/v1/chat/completions", data=body(),
                  headers={"Authorization": "Bearer sk-a"})[0] == 200
    assert h.call("POST", "/v1/chat/completions", data=body(),
                  headers={"Authorization": "Bearer sk-b", "x-pdserve-tier": "interactive"})[0] == 200
    assert [r.tier for r in h.backend.requests] == ["batch", "interactive"]


def test_backend_unavailable_is_503_with_retry_after(harness_factory):
    h = harness_factory(backend=ScriptedBackend(fail_before_first=True))
    for stream in (False, True):
        status, headers, raw = h.call("POST", "/v1/chat/completions", data=body(stream=stream))
        assert_openai_error(status, raw, 503)
        assert headers["Retry-After"] == "2"
    assert h.controller.num_running == 0


def test_rate_limited_key_gets_429_with_retry_after(harness_factory):
    tiers = load_tier_config('[tiers.standard]\ntokens_per_min = 100\n'
                             '[[keys]]\nkey = "sk-a"\ntier = "standard"\n', {})
    h = harness_factory(tiers=tiers)
    auth = {"Authorization": "Bearer sk-a"}
    # Byte tokenizer: the chat prompt is ~20 tokens; 20 + 60 fits once in 100 per minute.
    assert h.call("POST", "/v1/chat/completions", data=body(max_tokens=60), headers=auth)[0] == 200
    # 3 tokens were generated, 57 refunded: 77 left; a second 80-token charge does not fit.
    status, headers, raw = h.call("POST", "/v1/chat/completions", data=body(max_tokens=60),
                                  headers=auth)
    assert_openai_error(status, raw, 429, code="rate_limit_exceeded")
    assert int(headers["Retry-After"]) >= 1


def test_queued_request_runs_after_a_slot_frees_and_a_late_one_is_refused(harness_factory):
    tiers = load_tier_config('[tiers.interactive]\nttft_ms = 200\n', {})
    backend = ScriptedBackend()
    h = harness_factory(tiers=tiers, backend=backend, max_running_total=1)

    async def scenario():
        backend.gate = asyncio.Event()
        first = asyncio.ensure_future(h.acall("POST", "/v1/chat/completions", data=body()))
        while not backend.requests:
            await asyncio.sleep(0.005)
        second = asyncio.ensure_future(h.acall("POST", "/v1/chat/completions", data=body()))
        late = await h.acall("POST", "/v1/chat/completions", data=body(),
                             headers={"x-pdserve-tier": "interactive"})
        await asyncio.sleep(0.05)
        assert h.controller.num_queued == 1  # `second` waits; `late` was refused, holds nothing
        backend.gate.set()
        return late, await first, await second

    late, first, second = h.loop.run_until_complete(scenario())
    assert_openai_error(late[0], late[2], 429)
    assert "Retry-After" in late[1]
    assert first[0] == 200 and second[0] == 200
    assert h.controller.num_running == 0 and h.controller.num_queued == 0


def test_client_disconnect_mid_stream_closes_the_backend_generator(harness_factory):
    backend = ScriptedBackend(reply=tuple(f"t{i} " for i in range(1000)), delay_s=0.01)
    h = harness_factory(backend=backend, limits=default_limits(max_model_len=2048))

    async def scenario():
        async with h.session.post(h.server.make_url("/v1/chat/completions"),
                                  data=body(stream=True, max_tokens=1000),
                                  headers={"Content-Type": "application/json"}) as resp:
            await resp.content.readany()
        # The connection is closed; the handler notices at its next write.
        for _ in range(200):
            if backend.num_closed:
                return
            await asyncio.sleep(0.01)

    h.loop.run_until_complete(scenario())
    assert backend.num_closed == 1 and backend.num_finished == 0
    assert h.controller.num_running == 0


def test_official_openai_client_streaming_and_not(harness_factory):
    openai = pytest.importorskip("openai")
    h = harness_factory()

    async def scenario():
        client = openai.AsyncOpenAI(base_url=str(h.server.make_url("/v1")), api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "hi"}], max_tokens=5)
        stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=5,
                                                 stream=True)
        pieces = [c.choices[0].text async for c in stream]
        try:
            await client.chat.completions.create(model="nope", messages=[
                {"role": "user", "content": "hi"}])
        except openai.NotFoundError as exc:
            not_found = exc
        await client.close()
        return chat, pieces, not_found

    chat, pieces, not_found = h.loop.run_until_complete(scenario())
    assert chat.choices[0].message.content == "Hello world!"
    assert chat.usage.completion_tokens == 3
    assert "".join(pieces) == "Hello world!"
    assert not_found.code == "model_not_found"


def test_a_prompt_that_fits_the_model_but_not_the_kv_cache_is_a_clear_400(harness_factory):
    backend = ScriptedBackend(kv_cache_tokens=100)
    h = harness_factory(backend=backend)  # the model takes 512
    status, _, raw = h.call("POST", "/v1/completions", data=json.dumps(
        {**GOOD_COMPLETION, "prompt": "x" * 150, "max_tokens": 4}))
    assert_openai_error(status, raw, 400, "prompt", "context_length_exceeded")
    assert "KV cache holds 100 tokens" in json.loads(raw)["error"]["message"]
    # The default max_tokens of a chat fills what the KV cache leaves, not the model.
    status, _, raw = h.call("POST", "/v1/chat/completions", data=body(stream=False))
    assert status == 200, raw
    assert backend.requests[-1].sampling.max_tokens < 100
    assert_still_serving(h)


def test_a_prompt_too_long_in_any_tokenization_is_refused_by_its_length(harness_factory):
    h = harness_factory()
    started = time.monotonic()
    status, _, raw = h.call("POST", "/v1/completions", data=json.dumps(
        {**GOOD_COMPLETION, "prompt": "y" * 60_000}))
    assert time.monotonic() - started < 2.0
    assert_openai_error(status, raw, 400, "prompt", "context_length_exceeded")
    assert "characters" in json.loads(raw)["error"]["message"]
    assert_still_serving(h)


MALFORMED = [
    b"Content-Type: application/json\x7f\r\n",  # a control character in a header value
    b"Bad Header: y\r\n",  # a space in a header name
    b"Transfer-Encoding: chunked\r\n",  # beside Content-Length
    b"X-Long: " + b"a" * 9000 + b"\r\n",  # a header line over aiohttp's limit
]


@pytest.mark.parametrize("header", MALFORMED)
def test_a_request_the_http_parser_refuses_gets_a_json_400_and_no_traceback(
        harness_factory, caplog, header: bytes):
    h = harness_factory()
    caplog.set_level(logging.DEBUG)
    host, port = h.server.host, h.server.port
    payload = json.dumps(GOOD_COMPLETION).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + header +
               b"Content-Length: %d\r\n\r\n" % len(payload) + payload)

    def send() -> bytes:
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):  # until the gateway closes the connection
                answer += chunk
            return answer

    answer = h.loop.run_until_complete(asyncio.to_thread(send))
    head, _, raw = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") or head.startswith(b"HTTP/1.0 400"), answer[:300]
    assert b"Content-Type: application/json" in head
    assert_openai_error(400, raw, 400, code="bad_http_request")
    assert b"\\u007f" not in raw and b"aaaa" not in raw  # the client's bytes are not echoed
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert any("malformed HTTP request" in r.getMessage() for r in caplog.records)
    assert h.backend.requests == []
    assert_still_serving(h)
