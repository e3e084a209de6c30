"""The OpenAI-compatible HTTP surface: routes, request handling, OpenAI-style errors.

`create_app` builds an aiohttp application around a `CompletionBackend` (workers in
production, a fake in tests). A request goes through, in order:

    draining? (503) -> auth + tier header (401/400) -> Content-Type (415)
    -> body, size-limited (413) and time-limited (408) -> JSON + schema (400) -> model (404)
    -> an output grammar compiled off the loop, within a deadline (400; grammar_check.py)
    -> length by characters, then tokenized off the loop (gateway/api/tokenize_pool.py), context
       fit against the model and the workers' KV cache, SamplingParams (400)
    -> rate limit + admission (429 + Retry-After) -> backend (503 when it cannot serve)
    -> SSE stream or one JSON body (gateway/api/responses.py)

Every failure becomes an `ApiError` rendered by `error_middleware`, including aiohttp's
own (unknown route, wrong method); anything else is a bug, logged with its traceback and
answered as an OpenAI-style 500. What aiohttp's parser refuses before any handler runs (a
malformed header) is answered the same way by the server itself (gateway/api/http_server.py). A failing request touches no shared state beyond the
admission gate, which it leaves in `finally`.

Every request runs inside the drain's tracking (gateway/api/drain.py): a shutdown waits for it,
then ends it with an error rather than cutting it silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from gateway.admission.tiers import TIER_HEADER, TierConfig, TierError, TierSpec, classify, resolve
from gateway.api.admission_gate import AdmissionGate
from gateway.api.backend import CompletionBackend, GenerationRequest, PromptTokenizer
from gateway.api.drain import Drain
from gateway.api.errors import (ApiError, body_too_large, internal_error, invalid_request,
                                method_not_allowed, model_not_found, overloaded, route_not_found)
from gateway.api.grammar_check import GrammarCheck
from gateway.api.multi_choice import (choice_sampling, json_choices_answer, merged_choices,
                                      stream_choices_answer)
from gateway.api.openai_api import ModelCard, ModelList
from gateway.api.request_parsing import (Endpoint, RequestLimits, ValidatedRequest,
                                         build_sampling_params, parse_chat, parse_completion)
from gateway.api.request_trace import RequestTrace
from gateway.api.responses import (SLO_TIMING, TRACE, StreamTiming, json_answer, keep_refusal,
                                   shutting_down)
from gateway.api.shared_prefill import SharedPrefill
from gateway.api.slo_accounting import RequestTiming, timed_batches
from gateway.api.stream_writer import DirectTokens, stream_answer
from gateway.api.tokenize_pool import TokenizePool, TokenizerBusy
from telemetry.log_format import REQUEST_ID, TRACE_ID
from telemetry.tracing import NO_TRACING, Tracing

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ApiSettings:
    served_models: tuple[str, ...]  # the first is the canonical name
    limits: RequestLimits
    created_at: int  # unix seconds, shown by /v1/models
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (else 408)
    write_timeout_s: float = 30.0  # a client that takes no bytes this long is treated as gone
    first_byte_s: float = 2.0  # stream headers wait this long for the first token at most
    keepalive_s: float = 10.0  # then a keep-alive blank line this often until it comes


SETTINGS = web.AppKey("settings", ApiSettings)
TIERS = web.AppKey("tiers", TierConfig)
BACKEND = web.AppKey("backend", CompletionBackend)
TOKENIZE = web.AppKey("tokenize_pool", TokenizePool)
GATE = web.AppKey("admission_gate", AdmissionGate)
DRAIN = web.AppKey("drain", Drain)
TRACING = web.AppKey("tracing", Tracing)
GRAMMARS = web.AppKey("grammars", GrammarCheck)
JSON_CONTENT_TYPE = "application/json"


def create_app(settings: ApiSettings, tiers: TierConfig, backend: CompletionBackend,
               tokenizer: PromptTokenizer, gate: AdmissionGate,
               drain: Drain | None = None, tracing: Tracing = NO_TRACING,
               grammars: GrammarCheck | None = None) -> web.Application:
    """`grammars`: where requests' output grammars are compiled before routing; None: they
    are not checked here (the workers refuse one that does not compile)."""
    # client_max_size backs up our own limit for any handler that calls request.read().
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=settings.limits.max_body_bytes)
    app[SETTINGS], app[TIERS], app[BACKEND] = settings, tiers, backend
    app[GATE], app[DRAIN], app[TRACING] = gate, drain or Drain(), tracing
    pool = app[TOKENIZE] = TokenizePool(tokenizer)

    if grammars is not None:
        app[GRAMMARS] = grammars

    async def close_pool(_: web.Application) -> None:
        pool.close()
        if grammars is not None:
            grammars.close()

    app.on_cleanup.append(close_pool)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_get("/v1/models", handle_models)
    return app


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        response = error_response(exc)
        keep_refusal(request, exc)
        if exc.status == 408 and request.protocol is not None:
            # The rest of the body is not worth waiting for: answer, then close at once
            # (aiohttp would otherwise keep reading it for up to ten seconds).
            response.force_close()
            await response.prepare(request)
            await response.write_eof()
            request.protocol.force_close()
        return response
    except web.HTTPException as exc:
        return error_response(_from_http_exception(exc, request))
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(internal_error())


def error_response(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body_bytes(),
                        content_type="application/json", headers=exc.headers())


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    if exc.status == 404:
        return route_not_found(request.method, request.path)
    if exc.status == 405:
        return method_not_allowed(request.method, request.path)
    if exc.status == 413:
        return body_too_large(request.app[SETTINGS].limits.max_body_bytes)
    return ApiError(exc.status if exc.status in (400, 401, 422) else 400, exc.reason)


async def handle_models(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    models = ModelList(data=[ModelCard(id=name, created=settings.created_at,
                                       max_model_len=settings.limits.max_model_len)
                             for name in settings.served_models])
    return web.Response(body=msgspec.json.encode(models), content_type="application/json")


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.COMPLETIONS)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.CHAT)


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    drain = request.app[DRAIN]
    if drain.draining:
        raise shutting_down()
    with drain.track():
        try:
            return await _serve_tracked(request, endpoint)
        except asyncio.CancelledError:
            if drain.was_cut():  # the gateway is stopping: say so instead of vanishing
                raise shutting_down() from None
            raise


async def _serve_tracked(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    arrived_s, arrived_unix_ns = time.monotonic(), time.time_ns()  # before the body is read
    app = request.app
    settings = app[SETTINGS]
    caller = resolve(bearer_key(request), request.headers.get(TIER_HEADER), app[TIERS])
    if isinstance(caller, TierError):
        raise ApiError(caller.kind.status, caller.message, code=caller.kind.value,
                       param=TIER_HEADER if caller.kind.status == 400 else None)
    if request.content_type != JSON_CONTENT_TYPE:
        # Also what keeps a web page from posting here cross-site without a CORS preflight.
        raise ApiError(415, f"Content-Type must be {JSON_CONTENT_TYPE}, got "
                            f"{request.content_type!r}.", code="unsupported_media_type")
    body = await read_body(request, settings.limits.max_body_bytes, settings.body_timeout_s)
    parse = parse_chat if endpoint is Endpoint.CHAT else parse_completion
    validated = parse(body, settings.limits)
    if validated.unknown_fields:
        log.info("ignoring unknown request fields: %s", ", ".join(validated.unknown_fields))
    if validated.model not in settings.served_models:
        raise model_not_found(validated.model)
    grammars = app.get(GRAMMARS)
    if grammars is not None:
        await grammars.check_request(validated)
    backend = app[BACKEND]
    limits = _context_limits(settings.limits, backend.context_limit())
    prompts = await _tokenize_all(app[TOKENIZE], validated, limits)
    samplings = [build_sampling_params(validated, len(p), limits) for p in prompts]
    prompt_ids, sampling = prompts[0], samplings[0]
    decision = classify(caller, max(len(p) for p in prompts),
                        max(s.max_tokens for s in samplings), app[TIERS])
    tier, key_id = decision.tier, decision.key_id
    prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
    request_id = prefix + uuid.uuid4().hex
    REQUEST_ID.set(request_id)  # this handler's log lines carry it (log_format.py)
    trace = request[TRACE] = RequestTrace.begin(
        app[TRACING], endpoint.value, validated.model, request_id, tier.name,
        request.headers.get("traceparent"), arrived_s, arrived_unix_ns, len(prompt_ids),
        sampling.max_tokens)
    if trace.span.trace_id is not None:
        TRACE_ID.set(trace.span.trace_id)
    slo_timing = request[SLO_TIMING] = RequestTiming(tier, arrived_s)
    # Several choices, or tool calls to find in the answer: the merged path, which parses
    # calls out of each choice's text (no direct token writes there).
    parses_tools = validated.tool_use is not None and validated.tool_use.parses_output
    if len(prompts) > 1 or validated.n > 1 or parses_tools:
        # n > 1: each prompt's first choice prefills, the others reuse its KV (one prefill).
        shares = [SharedPrefill(f"{request_id}-{p * validated.n}") if validated.n > 1 else None
                  for p in range(len(prompts))]
        generations = [GenerationRequest(
            request_id=f"{request_id}-{p * validated.n + j}", model=validated.model,
            prompt_token_ids=prompts[p], sampling=choice_sampling(samplings[p], j),
            tier=tier.name, key_id=key_id, local_prefill=decision.local_prefill,
            targets=decision.targets, priority=decision.wire_priority, trace=trace,
            shared_prefill=shares[p])
            for p in range(len(prompts)) for j in range(validated.n)]
        return await _serve_choices(request, validated, request_id, generations,
                                    [len(p) for p in prompts], tier, key_id, slo_timing)
    direct = DirectTokens(slo_timing) if validated.stream else None
    generation = GenerationRequest(
        request_id=request_id, model=validated.model, prompt_token_ids=prompt_ids,
        sampling=sampling, tier=tier.name, key_id=key_id,
        local_prefill=decision.local_prefill, targets=decision.targets,
        priority=decision.wire_priority, trace=trace, sink=direct)
    gate = app[GATE]
    await gate.enter(request_id, tier, key_id, len(prompt_ids) + sampling.max_tokens)
    trace.admitted(time.monotonic())
    num_generated = 0
    try:
        batches = timed_batches(backend.generate_batches(generation), slo_timing)
        if direct is not None:
            timing = StreamTiming(settings.write_timeout_s, settings.first_byte_s,
                                  settings.keepalive_s)
            response, num_generated = await stream_answer(request, validated, generation,
                                                          batches, timing, app[DRAIN], direct)
        else:
            response, num_generated = await json_answer(validated, generation, batches)
        return response
    finally:
        # The charge was prompt + max_tokens; what was not generated goes back.
        gate.leave(request_id, tier, key_id, sampling.max_tokens - num_generated)


async def _serve_choices(request: web.Request, validated: ValidatedRequest, request_id: str,
                         generations: list[GenerationRequest], prompt_lengths: list[int],
                         tier: TierSpec, key_id: str | None, slo_timing: RequestTiming
                         ) -> web.StreamResponse:
    """Several choices (prompts x n): one admission for all, one generation each
    (gateway/api/multi_choice.py)."""
    app = request.app
    settings, gate = app[SETTINGS], app[GATE]
    charge = sum(len(g.prompt_token_ids) + g.sampling.max_tokens for g in generations)
    max_tokens = sum(g.sampling.max_tokens for g in generations)
    await gate.enter(request_id, tier, key_id, charge)
    request[TRACE].admitted(time.monotonic())
    num_generated = 0
    merged = merged_choices(app[BACKEND], generations, slo_timing)
    try:
        if validated.stream:
            timing = StreamTiming(settings.write_timeout_s, settings.first_byte_s,
                                  settings.keepalive_s)
            response, num_generated = await stream_choices_answer(
                request, validated, request_id, merged, len(generations), prompt_lengths,
                timing, app[DRAIN])
            return response
        answer, num_generated = await json_choices_answer(
            validated, request_id, merged, len(generations), prompt_lengths)
        return answer
    finally:
        gate.leave(request_id, tier, key_id, max_tokens - num_generated)


def _context_limits(limits: RequestLimits, capacity: int | None) -> RequestLimits:
    """The limits with the context capped to what the backend's KV cache can hold."""
    if capacity is None or capacity >= limits.max_model_len:
        return limits
    return dataclasses.replace(limits, max_model_len=max(2, capacity), limited_by_kv_cache=True)


def bearer_key(request: web.Request) -> str | None:
    """The API key of `Authorization: Bearer <key>`, if any."""
    header = request.headers.get("Authorization")
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def read_body(request: web.Request, limit_bytes: int, timeout_s: float) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `limit_bytes`, and
    (408) when it has not all arrived within `timeout_s`."""
    length = request.content_length
    if length is not None and length > limit_bytes:
        raise body_too_large(limit_bytes)
    content = request.content
    if content.is_eof():  # all of it came with the headers (most requests): nothing to wait for
        body = content.read_nowait()
        if len(body) > limit_bytes:
            raise body_too_large(limit_bytes)
        return body
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit_bytes:
                    raise body_too_large(limit_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"The request body was not received within {timeout_s:g} s.",
                       code="request_timeout") from None
    return b"".join(chunks)


async def _tokenize_all(pool: TokenizePool, validated: ValidatedRequest,
                        limits: RequestLimits) -> list[tuple[int, ...]]:
    """Every prompt's tokens, in order (one unless a batch of prompts)."""
    if validated.batch_prompts is None:
        return [await _tokenize(pool, validated, limits)]
    return [p if isinstance(p, tuple) else tuple(await _encode(pool, p, limits, f"prompt[{i}]"))
            for i, p in enumerate(validated.batch_prompts)]


async def _encode(pool: TokenizePool, text: str, limits: RequestLimits, param: str) -> list[int]:
    if pool.min_tokens(len(text)) > limits.prompt_token_limit:
        raise invalid_request(
            f"The prompt has {len(text)} characters, more than {limits.prompt_token_limit} "
            f"tokens can hold ({limits.context_description}).", param,
            code="context_length_exceeded")
    try:
        return await pool.encode(text)
    except TokenizerBusy as exc:
        raise overloaded(f"The gateway is busy tokenizing prompts ({exc}); retry in a "
                         "moment.", retry_after_s=1) from exc


async def _tokenize(pool: TokenizePool, validated: ValidatedRequest,
                    limits: RequestLimits) -> tuple[int, ...]:
    if validated.prompt_token_ids is not None:
        return validated.prompt_token_ids
    if validated.tool_turns is not None:
        num_chars = sum(len(t.content) + sum(len(c.arguments) for c in t.tool_calls)
                        for t in validated.tool_turns)
    elif validated.chat_turns is not None:
        num_chars = sum(len(text) for _, text in validated.chat_turns)
    else:
        assert validated.prompt_text is not None
        num_chars = len(validated.prompt_text)
    param = "messages" if validated.chat_turns is not None else "prompt"
    if pool.min_tokens(num_chars) > limits.prompt_token_limit:
        raise invalid_request(
            f"The prompt has {num_chars} characters, more than {limits.prompt_token_limit} "
            f"tokens can hold ({limits.context_description}).", param,
            code="context_length_exceeded")
    try:
        if validated.tool_turns is not None:
            functions = validated.tool_use.in_prompt if validated.tool_use is not None else ()
            return tuple(await pool.encode_tool_chat(validated.tool_turns, functions))
        if validated.chat_turns is not None:
            return tuple(await pool.encode_chat(validated.chat_turns))
        assert validated.prompt_text is not None
        return tuple(await pool.encode(validated.prompt_text))
    except TokenizerBusy as exc:  # too many at once, or this one past its deadline
        raise overloaded(f"The gateway is busy tokenizing prompts ({exc}); retry in a "
                         "moment.", retry_after_s=1) from exc
    except ValueError as exc:  # e.g. a chat template that refuses the conversation
        raise invalid_request(f"The messages cannot be rendered: {exc}", param) from exc
