"""The benchmark's peers: the OpenAI-speaking stub and the plain proxy relay exactly what
the stub sends (what gateway_overhead's stream check then verifies)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp.test_utils import TestServer

from benchmarks.relay_peers import proxy_app, stub_app
from gateway.api.sse import SseDecoder


async def _stream(url: str, max_tokens: int) -> list[bytes]:
    decoder, events = SseDecoder(), []
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json={
                "model": "default", "prompt": [1, 2], "max_tokens": max_tokens,
                "stream": True}) as response:
            assert response.status == 200
            async for chunk in response.content.iter_any():
                events += decoder.feed(chunk)
    return events


def test_the_proxy_relays_the_stubs_events_unchanged() -> None:
    async def run() -> None:
        stub = TestServer(stub_app(num_tokens=5, interval_s=0.001), host="127.0.0.1", port=0)
        await stub.start_server()
        proxy = TestServer(proxy_app(str(stub.make_url("")).rstrip("/")), host="127.0.0.1",
                           port=0)
        await proxy.start_server()
        try:
            direct = await _stream(str(stub.make_url("")).rstrip("/"), 3)
            relayed = await _stream(str(proxy.make_url("")).rstrip("/"), 3)
        finally:
            await proxy.close()
            await stub.close()
        assert direct == relayed and direct[-1] == b"[DONE]"
        texts = [json.loads(e)["choices"][0]["text"] for e in direct[:-1]]
        assert texts == ["word", " word", " word"]  # max_tokens caps the reply
        assert json.loads(direct[-2])["choices"][0]["finish_reason"] == "length"

    asyncio.run(run())
