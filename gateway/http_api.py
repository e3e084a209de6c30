"""The OpenAI-compatible HTTP surface: routes, request handling, OpenAI-style errors.

`create_app` builds an aiohttp application around a `CompletionBackend` (workers in
production, a fake in tests). A request goes through, in order:

    auth + tier header (401/400) -> body, size-limited (413) -> JSON + schema (400)
    -> model (404) -> tokenize, context fit, SamplingParams (400)
    -> rate limit + admission (429 + Retry-After) -> backend (503 when it cannot serve)
    -> SSE stream or one JSON body

Every failure becomes an `ApiError` rendered by `error_middleware`, including aiohttp's
own (unknown route, wrong method); anything else is a bug, logged with its traceback and
answered as an OpenAI-style 500. A failing request touches no shared state beyond the
admission gate, which it leaves in `finally`.

Streaming sends headers together with the first token: a backend that fails before its
first token still gets a proper 503, and TTFT is not worse for it. A client that goes
away mid-stream ends the iteration, which closes the backend's generator (`aclose`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from common.contract.finish_reason import FinishReason
from gateway.admission_gate import AdmissionGate
from gateway.backend import (BackendUnavailable, CompletionBackend, GenerationRequest,
                             PromptTokenizer, TokenDelta, TokenLogprob, delta_batches)
from gateway.chunk_encoder import (ChatChunkEncoder, CompletionChunkEncoder, chat_logprobs,
                                   completion_logprobs)
from gateway.errors import (ApiError, body_too_large, internal_error, method_not_allowed,
                            model_not_found, overloaded, route_not_found)
from gateway.openai_api import (ChatChoice, ChatCompletionResponse, ChatResponseMessage,
                                CompletionChoice, CompletionResponse, ModelCard, ModelList, Usage)
from gateway.request_parsing import (Endpoint, RequestLimits, ValidatedRequest,
                                     build_sampling_params, parse_chat, parse_completion)
from gateway.sse import DONE_EVENT, SSE_HEADERS, encode_event
from gateway.tiers import TIER_HEADER, TierConfig, TierError, classify, resolve

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class ApiSettings:
    served_models: tuple[str, ...]  # the first is the canonical name
    limits: RequestLimits
    created_at: int  # unix seconds, shown by /v1/models
    body_timeout_s: float = 30.0  # the whole request body must arrive within this (else 408)
    write_timeout_s: float = 30.0  # a client that takes no bytes this long is treated as gone


SETTINGS = web.AppKey("settings", ApiSettings)
TIERS = web.AppKey("tiers", TierConfig)
BACKEND = web.AppKey("backend", CompletionBackend)
TOKENIZER = web.AppKey("tokenizer", PromptTokenizer)
GATE = web.AppKey("admission_gate", AdmissionGate)


def create_app(settings: ApiSettings, tiers: TierConfig, backend: CompletionBackend,
               tokenizer: PromptTokenizer, gate: AdmissionGate) -> web.Application:
    # client_max_size backs up our own limit for any handler that calls request.read().
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=settings.limits.max_body_bytes)
    app[SETTINGS], app[TIERS], app[BACKEND] = settings, tiers, backend
    app[TOKENIZER], app[GATE] = tokenizer, gate
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat_completions)
    app.router.add_get("/v1/models", handle_models)
    return app


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
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
    app = request.app
    settings = app[SETTINGS]
    caller = resolve(bearer_key(request), request.headers.get(TIER_HEADER), app[TIERS])
    if isinstance(caller, TierError):
        raise ApiError(caller.kind.status, caller.message, code=caller.kind.value,
                       param=TIER_HEADER if caller.kind.status == 400 else None)
    body = await read_body(request, settings.limits.max_body_bytes, settings.body_timeout_s)
    parse = parse_chat if endpoint is Endpoint.CHAT else parse_completion
    validated = parse(body, settings.limits)
    if validated.unknown_fields:
        log.info("ignoring unknown request fields: %s", ", ".join(validated.unknown_fields))
    if validated.model not in settings.served_models:
        raise model_not_found(validated.model)
    prompt_ids = _tokenize(app[TOKENIZER], validated)
    sampling = build_sampling_params(validated, len(prompt_ids), settings.limits)
    decision = classify(caller, len(prompt_ids))
    tier, key_id = decision.tier, decision.key_id
    prefix = "chatcmpl-" if endpoint is Endpoint.CHAT else "cmpl-"
    request_id = prefix + uuid.uuid4().hex
    generation = GenerationRequest(
        request_id=request_id, model=validated.model, prompt_token_ids=prompt_ids,
        sampling=sampling, tier=tier.name, key_id=key_id,
        local_prefill=decision.local_prefill)
    gate = app[GATE]
    await gate.enter(request_id, tier, key_id, len(prompt_ids) + sampling.max_tokens)
    num_generated = 0
    try:
        batches = delta_batches(app[BACKEND], generation)
        if validated.stream:
            response, num_generated = await _stream(request, validated, generation, batches)
        else:
            response, num_generated = await _collect(validated, generation, batches)
        return response
    finally:
        # The charge was prompt + max_tokens; what was not generated goes back.
        gate.leave(request_id, tier, key_id, sampling.max_tokens - num_generated)


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


async def _write(request: web.Request, response: web.StreamResponse, data: bytes,
                 timeout_s: float, eof: bool = False) -> None:
    """One write to the client, bounded: a client that stops reading counts as gone (its
    connection is dropped, so nothing else waits on it either)."""
    try:
        async with asyncio.timeout(timeout_s):
            if eof:
                await response.write_eof(data)
            else:
                await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"the client took no data for {timeout_s:g} s") from None


def _tokenize(tokenizer: PromptTokenizer, validated: ValidatedRequest) -> tuple[int, ...]:
    if validated.prompt_token_ids is not None:
        return validated.prompt_token_ids
    if validated.chat_turns is not None:
        return tuple(tokenizer.encode_chat(validated.chat_turns))
    assert validated.prompt_text is not None
    return tuple(tokenizer.encode(validated.prompt_text))


async def _first_batch(batches: AsyncGenerator[list[TokenDelta], None]) -> list[TokenDelta]:
    try:
        return await anext(batches)
    except BackendUnavailable as exc:
        raise overloaded(str(exc), exc.retry_after_s) from exc
    except StopAsyncIteration:
        raise overloaded("The backend ended the request without an answer.") from None


async def _stream(request: web.Request, validated: ValidatedRequest,
                  generation: GenerationRequest,
                  batches: AsyncGenerator[list[TokenDelta], None]
                  ) -> tuple[web.StreamResponse, int]:
    """One SSE event per token; all the events of one batch leave in one write.

    aiohttp's `write` awaits the transport only past 64 KiB buffered, so a client that
    keeps up costs no suspension per batch; one that lags makes us wait here, and the
    tokens that arrive meanwhile come as a bigger next batch.
    """
    created = int(time.time())
    chat = validated.endpoint is Endpoint.CHAT
    encoder = (ChatChunkEncoder if chat else CompletionChunkEncoder)(
        generation.request_id, created, validated.model)
    encode = encoder.text
    num_generated = 0
    write_timeout_s = request.app[SETTINGS].write_timeout_s
    response = web.StreamResponse(headers=SSE_HEADERS)
    try:
        batch = await _first_batch(batches)
        await response.prepare(request)
        events = [encoder.role()] if isinstance(encoder, ChatChunkEncoder) else []
        while True:
            finished = False
            for delta in batch:
                num_generated += delta.num_tokens
                events.append(encode(delta.text, delta.logprobs, delta.finish_reason))
                if delta.finish_reason is not None:
                    finished = True
                    break
            if finished:
                break
            await _write(request, response,
                         events[0] if len(events) == 1 else b"".join(events), write_timeout_s)
            events.clear()
            try:
                batch = await anext(batches)
            except StopAsyncIteration:
                break
            except BackendUnavailable as exc:
                # Headers are out: report in-band, as OpenAI-compatible servers do.
                events.append(encode_event(overloaded(str(exc)).body_bytes()))
                break
        if validated.include_usage:
            events.append(encoder.usage(_usage(generation, num_generated)))
        events.append(DONE_EVENT)
        # With the end-of-body chunk: the last events, [DONE] and the end in one write.
        await _write(request, response, b"".join(events), write_timeout_s, eof=True)
    except ConnectionResetError as exc:
        # The client is gone (or stopped reading); nothing more can be sent. Closing the
        # generator (below) is what stops the work upstream.
        log.info("client went away during %s: %s", generation.request_id, exc)
    finally:
        await batches.aclose()
    return response, num_generated


async def _collect(validated: ValidatedRequest, generation: GenerationRequest,
                   batches: AsyncGenerator[list[TokenDelta], None]) -> tuple[web.Response, int]:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    num_generated = 0
    finish_reason: FinishReason | None = None
    try:
        batch = await _first_batch(batches)
        while finish_reason is None:
            for delta in batch:
                texts.append(delta.text)
                logprobs.extend(delta.logprobs or ())
                num_generated += delta.num_tokens
                finish_reason = delta.finish_reason
                if finish_reason is not None:
                    break
            else:
                batch = await anext(batches)
    except StopAsyncIteration:
        pass
    except BackendUnavailable as exc:
        raise overloaded(str(exc), exc.retry_after_s) from exc
    finally:
        await batches.aclose()
    text = "".join(texts)
    usage = _usage(generation, num_generated)
    created = int(time.time())
    want_logprobs = generation.sampling.logprobs is not None
    body: ChatCompletionResponse | CompletionResponse
    if validated.endpoint is Endpoint.CHAT:
        body = ChatCompletionResponse(
            id=generation.request_id, created=created, model=validated.model, usage=usage,
            choices=[ChatChoice(index=0, message=ChatResponseMessage(content=text),
                                logprobs=chat_logprobs(tuple(logprobs)) if want_logprobs else None,
                                finish_reason=finish_reason)])
    else:
        body = CompletionResponse(
            id=generation.request_id, created=created, model=validated.model, usage=usage,
            choices=[CompletionChoice(
                index=0, text=text, finish_reason=finish_reason,
                logprobs=completion_logprobs(tuple(logprobs), 0) if want_logprobs else None)])
    return web.Response(body=msgspec.json.encode(body), content_type="application/json"), num_generated


def _usage(generation: GenerationRequest, num_generated: int) -> Usage:
    num_prompt = len(generation.prompt_token_ids)
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_generated,
                 total_tokens=num_prompt + num_generated)
