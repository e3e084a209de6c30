"""Test harness of the gateway: a byte-level tokenizer, a scripted backend, and a real
aiohttp server on 127.0.0.1 (port 0) driven from a private event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.admission.admission import AdmissionController
from gateway.admission.rate_limit import TokenRateLimiter
from gateway.admission.refusals import RefusalLog
from gateway.admission.tiers import TierConfig, load_tier_config
from gateway.api.admission_gate import AdmissionGate
from gateway.api.backend import BackendUnavailable, GenerationRequest, TokenDelta, TokenLogprob
from gateway.api.http_api import ApiSettings, create_app
from gateway.api.http_server import GatewayRunner
from gateway.api.metrics import GatewayMetrics
from gateway.api.request_parsing import RequestLimits
from gateway.ops.ops_api import METRICS, REFUSALS, count_middleware
from protocol.finish_reason import FinishReason
from telemetry.tracing import NO_TRACING, Tracing
from text.tool_prompt import ChatTurn, ToolFunction

MODEL = "test-model"


class ByteTokenizer:
    """One token per UTF-8 byte: lengths are predictable in tests."""

    max_token_chars = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        rendered = "".join(f"<{role}>{text}\n" for role, text in messages) + "<assistant>"
        return self.encode(rendered)

    def encode_tool_chat(self, turns: Sequence[ChatTurn],
                         functions: tuple[ToolFunction, ...]) -> list[int]:
        tools = "".join(f"<tool {f.name}>" for f in functions)
        return self.encode_chat([(t.role, t.content + "".join(
            f"<call {c.name} {c.arguments}>" for c in t.tool_calls)) for t in turns]) + \
            self.encode(tools)


@dataclass
class ScriptedBackend:
    """Streams `reply` one word per delta (or `fail_before_first` / `delay_s` per token)."""

    reply: tuple[str, ...] = ("Hello", " world", "!")
    delay_s: float = 0.0
    fail_before_first: bool = False
    gate: asyncio.Event | None = None  # when set, each request waits for it before its first token
    requests: list[GenerationRequest] = field(default_factory=list)
    num_closed: int = 0
    num_finished: int = 0
    kv_cache_tokens: int | None = None  # what context_limit() reports

    def context_limit(self) -> int | None:
        return self.kv_cache_tokens

    async def generate_batches(self, request: GenerationRequest
                               ) -> AsyncGenerator[list[TokenDelta], None]:
        """One delta per batch."""
        async with contextlib.aclosing(self._deltas(request)) as deltas:
            async for delta in deltas:
                yield [delta]

    async def _deltas(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        self.requests.append(request)
        try:
            if self.fail_before_first:
                raise BackendUnavailable("no decode worker is available", retry_after_s=2)
            if self.gate is not None:
                await self.gate.wait()
            words = self.reply[: request.sampling.max_tokens]
            for i, word in enumerate(words):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(words) - 1
                finish = None
                if last:
                    finish = (FinishReason.LENGTH if len(words) == request.sampling.max_tokens
                              else FinishReason.STOP)
                logprobs = None
                if request.sampling.logprobs is not None:
                    top = tuple((f"alt{k}", -1.0 - k) for k in range(request.sampling.logprobs))
                    logprobs = (TokenLogprob(token=word, logprob=-0.5, top=top),)
                yield TokenDelta(text=word, num_tokens=1, finish_reason=finish, logprobs=logprobs)
            self.num_finished += 1
        finally:
            self.num_closed += 1


class GatewayTestServer(TestServer):
    """aiohttp's test server with the gateway's own runner (gateway/api/http_server.py)."""

    async def _make_runner(self, **kwargs) -> GatewayRunner:
        return GatewayRunner(self.app, **kwargs)


def default_limits(**overrides) -> RequestLimits:
    values = dict(max_model_len=512, vocab_size=1000, max_body_bytes=64 * 1024)
    values.update(overrides)
    return RequestLimits(**values)


class Harness:
    """A running gateway app; `call` performs one HTTP request and returns (status, headers, body)."""

    def __init__(self, backend: ScriptedBackend, tiers: TierConfig | None = None,
                 limits: RequestLimits | None = None, max_running_total: int = 64,
                 max_queued_total: int = 64, body_timeout_s: float = 30.0,
                 first_byte_s: float = 2.0, keepalive_s: float = 10.0,
                 count: bool = False, tracing: Tracing = NO_TRACING,
                 install: Callable[[web.Application], None] | None = None) -> None:
        """`install(app)` adds routes before the server starts."""
        self.loop = asyncio.new_event_loop()
        self.backend = backend
        self.tiers = tiers or load_tier_config(None, {})
        clock = self.loop.time
        self.controller = AdmissionController(list(self.tiers.tiers.values()), max_running_total,
                                              max_queued_total, clock)
        self.gate = gate = AdmissionGate(self.controller, TokenRateLimiter(clock))
        settings = ApiSettings(served_models=(MODEL,), limits=limits or default_limits(),
                               created_at=1_700_000_000, body_timeout_s=body_timeout_s,
                               first_byte_s=first_byte_s, keepalive_s=keepalive_s)
        self.app = create_app(settings, self.tiers, backend, ByteTokenizer(), gate,
                              tracing=tracing)
        self.metrics = GatewayMetrics()
        if count:  # the counting middleware of gateway/ops/ops_api.py, without its routes
            self.app[METRICS], self.app[REFUSALS] = self.metrics, RefusalLog()
            self.app.middlewares.insert(0, count_middleware)
        if install is not None:
            install(self.app)
        self.server = GatewayTestServer(self.app, host="127.0.0.1", port=0)
        self.loop.run_until_complete(self.server.start_server())
        self.session = self.loop.run_until_complete(self._session())

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))

    @property
    def base_url(self) -> str:
        return str(self.server.make_url(""))

    async def acall(self, method: str, path: str, **kwargs) -> tuple[int, dict, bytes]:
        if method == "POST":  # what OpenAI clients send, unless a test says otherwise
            kwargs["headers"] = {"Content-Type": "application/json", **kwargs.get("headers", {})}
        async with self.session.request(method, self.server.make_url(path), **kwargs) as resp:
            return resp.status, dict(resp.headers), await resp.read()

    def call(self, method: str, path: str, **kwargs) -> tuple[int, dict, bytes]:
        return self.loop.run_until_complete(self.acall(method, path, **kwargs))

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.run_until_complete(self.server.close())
        self.loop.close()
