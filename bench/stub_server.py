"""An OpenAI-compatible streaming server with injected latencies and faults (no model).

Serves /v1/models, /v1/completions and /v1/chat/completions (stream=true only). Each reply
has exactly max_tokens one-token chunks: the first `ttft_ms` after the request got a slot,
then one every `tpot_ms` (scheduled on absolute times, so delays do not drift), then a usage
chunk when stream_options.include_usage is set, then `data: [DONE]`.

Capacity: with `max_concurrency` set, a request waits for one of that many slots before its
TTFT clock starts, so TTFT grows with load the way a saturated server's does.

Faults cycle by request number through `faults` (e.g. ok,bad_json,http_500,drop,
missing_done,stream_error): bad_json sends a broken chunk after the first token,
http_500 answers 500 at once, drop cuts the connection after the first token,
missing_done ends the stream cleanly without [DONE], stream_error sends an error object.

Lifecycle of a request: received -> waiting for a slot -> streaming -> ended (slot freed).
Invariants: 0 <= num_active <= max_concurrency (when set); num_received counts every
completion request, faulty ones included.

Run alone: python -m bench.stub_server --port 0 --ttft-ms 100 --tpot-ms 20
(prints `listening on http://127.0.0.1:<port>` once it accepts connections).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

FAULTS = ("ok", "bad_json", "http_500", "drop", "missing_done", "stream_error")


class StubState:
    def __init__(self, ttft_ms: float, tpot_ms: float, max_concurrency: int | None,
                 faults: tuple[str, ...], model_id: str):
        unknown = set(faults) - set(FAULTS)
        if unknown or not faults:
            raise ValueError(f"faults must be a non-empty list of {FAULTS}, got {faults}")
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.max_concurrency = max_concurrency
        self.slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self.faults = faults
        self.model_id = model_id
        self.num_received = 0
        self.num_active = 0
        self.tiers_seen: dict[str, int] = {}

    def check_invariants(self) -> None:
        if self.num_active < 0 or (self.max_concurrency is not None
                                   and self.num_active > self.max_concurrency):
            raise AssertionError(f"num_active {self.num_active} out of bounds")


STATE = web.AppKey("stub_state", StubState)


def _sse(obj: dict | str) -> bytes:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"data: {body}\n\n".encode()


def _token_chunk(chat: bool, index: int, model: str) -> dict:
    choice = ({"index": 0, "delta": {"content": f"t{index} "}, "finish_reason": None} if chat
              else {"index": 0, "text": f"t{index} ", "finish_reason": None})
    return {"id": "stub", "object": "chat.completion.chunk" if chat else "text_completion",
            "model": model, "choices": [choice]}


async def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def _stream(request: web.Request, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    body = await request.json()
    fault = state.faults[state.num_received % len(state.faults)]
    state.num_received += 1
    tier = request.headers.get("x-pdserve-tier", "")
    state.tiers_seen[tier] = state.tiers_seen.get(tier, 0) + 1
    if fault == "http_500":
        return web.json_response({"error": {"message": "injected failure"}}, status=500)
    max_tokens = int(body.get("max_tokens") or 16)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    if state.slots is not None:
        await state.slots.acquire()
    state.num_active += 1
    state.check_invariants()
    try:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        start_t = time.perf_counter()
        for i in range(max_tokens):
            await _sleep_until(start_t + (state.ttft_ms + i * state.tpot_ms) / 1e3)
            await response.write(_sse(_token_chunk(chat, i, state.model_id)))
            if i == 0 and fault == "bad_json":
                await response.write(b'data: {"choices": [\n\n')
            elif i == 0 and fault == "stream_error":
                await response.write(_sse({"error": {"message": "injected", "code": 500}}))
            elif i == 0 and fault == "drop":
                request.transport.close()  # type: ignore[union-attr]
                return response
        if include_usage:
            await response.write(_sse({"id": "stub", "choices": [], "usage": {
                "prompt_tokens": len(str(body.get("prompt") or body.get("messages")).split()),
                "completion_tokens": max_tokens, "total_tokens": max_tokens}}))
        if fault != "missing_done":
            await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response
    finally:
        state.num_active -= 1
        if state.slots is not None:
            state.slots.release()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _stream(request, chat=False)


async def _chat(request: web.Request) -> web.StreamResponse:
    return await _stream(request, chat=True)


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [
        {"id": request.app[STATE].model_id, "object": "model"}]})


def build_app(ttft_ms: float, tpot_ms: float, max_concurrency: int | None = None,
              faults: tuple[str, ...] = ("ok",), model_id: str = "stub-model") -> web.Application:
    app = web.Application()
    app[STATE] = StubState(ttft_ms, tpot_ms, max_concurrency, faults, model_id)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat)
    return app


async def _serve(args: argparse.Namespace) -> None:
    app = build_app(args.ttft_ms, args.tpot_ms, args.max_concurrency,
                    tuple(args.faults.split(",")))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"listening on http://{host}:{port}", flush=True)
    try:
        await asyncio.Event().wait()  # until the process is signalled
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--ttft-ms", type=float, default=100.0,
                        help="delay before the first token (default 100)")
    parser.add_argument("--tpot-ms", type=float, default=20.0,
                        help="delay between later tokens (default 20)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="requests served at once; more wait for a slot "
                             "(default: no limit)")
    parser.add_argument("--faults", default="ok", help=f"comma list cycled per request: {FAULTS}")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
