"""The relays pdserve's gateway is measured against, and the OpenAI-speaking stub they relay:

    python -m benchmarks.relay_peers stub --num-tokens 64 --token-interval-ms 10
        an OpenAI-compatible completions server that computes nothing: every streamed
        request gets `--num-tokens` SSE events of " word" (one per token, paced), then
        [DONE]; /health and /v1/models answer for routers' health checks
    python -m benchmarks.relay_peers proxy --upstream URL
        a plain aiohttp pass-through proxy: POST /v1/completions to the upstream,
        iter_any() -> write(), no decoding and no per-request logic: the floor of any
        aiohttp relay on the host

Each prints "listening on URL" on its first line of stdout. vllm-router (Rust, from PyPI)
is the third peer; benchmarks/gateway_overhead.py starts it when it is on the PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import aiohttp
from aiohttp import web


def _event(text: str, finish: str | None) -> bytes:
    body = {"id": "cmpl-stub", "object": "text_completion", "model": "default",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def stub_app(num_tokens: int, interval_s: float) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = min(num_tokens, int(body.get("max_tokens") or num_tokens))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        for i in range(count):
            if interval_s and i:
                await asyncio.sleep(interval_s)
            await response.write(_event("word" if i == 0 else " word",
                                        "length" if i == count - 1 else None))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "default", "object": "model", "owned_by": "stub"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app


def proxy_app(upstream: str) -> web.Application:
    session_key = web.AppKey("session", aiohttp.ClientSession)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app[session_key].post(
                upstream + "/v1/completions", data=body,
                headers={"Content-Type": "application/json"}) as answer:
            response = web.StreamResponse(status=answer.status, headers={
                "Content-Type": answer.headers.get("Content-Type", "text/event-stream")})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def session(app: web.Application):
        app[session_key] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[session_key].close()

    app = web.Application()
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/completions", completions)
    return app


async def _serve(app: web.Application) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    stub = sub.add_parser("stub", help="the OpenAI-speaking stub server")
    stub.add_argument("--num-tokens", type=int, default=64, help="tokens per request")
    stub.add_argument("--token-interval-ms", type=float, default=0.0,
                      help="pause between tokens (0: back to back)")
    proxy = sub.add_parser("proxy", help="the plain aiohttp pass-through proxy")
    proxy.add_argument("--upstream", required=True, help="base URL of the OpenAI server")
    args = parser.parse_args(argv)
    if args.what == "stub":
        app = stub_app(args.num_tokens, args.token_interval_ms / 1000)
    else:
        app = proxy_app(args.upstream.rstrip("/"))
    try:
        import uvloop
        uvloop.run(_serve(app))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
