"""One streamed OpenAI request, measured from the client's side.

Lifecycle of a request: sent -> response headers -> SSE events (`data: {json}` blocks
separated by blank lines) -> `data: [DONE]` -> record. The first fault ends it: the record
then carries an error kind and is counted as an SLO miss, never raised.

Timings (time.perf_counter, milliseconds):
    TTFT  request sent -> first chunk with non-empty content (completions: choices[].text,
          chat: choices[].delta.content); role-only and empty chunks do not count
    ITL   every gap between successive content chunks (a chunk may carry several tokens)
    E2E   request sent -> `[DONE]`
    TPOT  (E2E - TTFT) / (output_tokens - 1); undefined for fewer than 2 tokens
Output tokens come from the usage block (requested with stream_options.include_usage) when
the server sends one, else from the number of content chunks.

Error kinds: ErrorKind values, plus `http_<status>` for a non-200 response.
"""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum
from typing import Literal

import aiohttp
import msgspec

from bench.planner import PlannedRequest

Api = Literal["completions", "chat"]
TIER_HEADER = "x-pdserve-tier"


class ErrorKind(StrEnum):
    BAD_JSON = "bad_json"                  # a data line that is not JSON
    STREAM_ERROR = "stream_error"          # the server sent an error object mid-stream
    CONNECTION_DROPPED = "connection_dropped"  # the stream was cut before its end
    CONNECT_FAILED = "connect_failed"      # no connection at all
    TIMEOUT = "timeout"                    # the request ran past --request-timeout
    MISSING_DONE = "missing_done"          # the stream ended cleanly without [DONE]
    NO_OUTPUT = "no_output"                # [DONE] without a single content token
    CLIENT_ERROR = "client_error"          # anything else the client could not handle


class StreamFault(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class RequestRecord(msgspec.Struct):
    index: int
    class_name: str
    tier: str
    scheduled_s: float | None   # planned send time since run start (open loop only)
    start_s: float              # actual send time since run start
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = []
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    prompt_tokens: int | None = None
    error: str | None = None
    error_detail: str | None = None
    retry_after_s: float | None = None  # a refusal's Retry-After header, when it had one

    @property
    def tpot_ms(self) -> float | None:
        if self.error is not None or self.ttft_ms is None or self.e2e_ms is None:
            return None
        if self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


class StreamState:
    """Accumulates one stream's events. Pure apart from the timestamps handed in."""

    def __init__(self, api: Api, start_t: float):
        self._api = api
        self._start_t = start_t
        self.first_token_t: float | None = None
        self.last_token_t: float | None = None
        self.itl_ms: list[float] = []
        self.num_content_chunks = 0
        self.usage_completion_tokens: int | None = None
        self.usage_prompt_tokens: int | None = None
        self.num_logprob_entries = 0  # tokens the logprobs listed (requests that ask for them)
        self.done_t: float | None = None

    def _chunk_text(self, choice: dict) -> str:
        if self._api == "completions":
            return choice.get("text") or ""
        delta = choice.get("delta") or {}
        return delta.get("content") or ""

    def on_data(self, payload: str, now: float) -> bool:
        """Handle one event's data; True once `[DONE]` arrived. Raises StreamFault."""
        if payload.strip() == "[DONE]":
            self.done_t = now
            return True
        try:
            event = msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise StreamFault(ErrorKind.BAD_JSON, f"{exc}: {payload[:120]!r}") from None
        if not isinstance(event, dict):
            raise StreamFault(ErrorKind.BAD_JSON, f"not an object: {payload[:120]!r}")
        if event.get("error") is not None:
            raise StreamFault(ErrorKind.STREAM_ERROR, str(event["error"])[:200])
        usage = event.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.usage_completion_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.usage_prompt_tokens = int(usage["prompt_tokens"])
        choices = event.get("choices") or []
        for choice in choices:
            logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
            if isinstance(logprobs, dict):  # completions: tokens; chat: content
                self.num_logprob_entries += len(logprobs.get("tokens") or
                                                logprobs.get("content") or ())
        if any(isinstance(c, dict) and self._chunk_text(c) for c in choices):
            if self.first_token_t is None:
                self.first_token_t = now
            else:
                self.itl_ms.append((now - self.last_token_t) * 1e3)  # type: ignore[operator]
            self.last_token_t = now
            self.num_content_chunks += 1
        return False

    def fill(self, record: RequestRecord) -> None:
        if self.first_token_t is not None:
            record.ttft_ms = (self.first_token_t - self._start_t) * 1e3
        if self.done_t is not None:
            record.e2e_ms = (self.done_t - self._start_t) * 1e3
        record.itl_ms = self.itl_ms
        if self.usage_completion_tokens is not None:
            record.output_tokens = self.usage_completion_tokens
            record.output_tokens_from_usage = True
        else:
            record.output_tokens = self.num_content_chunks
        record.prompt_tokens = self.usage_prompt_tokens


def build_payload(api: Api, model: str, request: PlannedRequest, ignore_eos: bool,
                  temperature: float | None) -> dict:
    payload: dict = {"model": model, "max_tokens": request.max_tokens, "stream": True,
                     "stream_options": {"include_usage": True}}
    if api == "completions":
        payload["prompt"] = request.prompt
    else:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    if ignore_eos:
        # Not OpenAI proper, but vLLM, SGLang and pdserve honour it: outputs then have
        # exactly the planned length, so runs at different rates do the same work.
        payload["ignore_eos"] = True
    if temperature is not None:
        payload["temperature"] = temperature
    return payload


def build_headers(request: PlannedRequest, default_api_key: str | None) -> dict[str, str]:
    """The class's API key, when set, carries the tier; else the tier header does."""
    if request.api_key is not None:
        return {"Authorization": f"Bearer {request.api_key}"}
    headers = {TIER_HEADER: request.tier}
    if default_api_key is not None:
        headers["Authorization"] = f"Bearer {default_api_key}"
    return headers


async def read_stream(response: aiohttp.ClientResponse, state: StreamState) -> None:
    """Feed `state` each event of a 200 response's SSE body until [DONE]; raises
    StreamFault (the stream's own error event, bad JSON, no [DONE])."""
    data_lines: list[str] = []
    async for raw in response.content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                data_lines.append(value[1:] if value.startswith(" ") else value)
            continue
        if data_lines:  # a blank line ends an event
            payload, data_lines = "\n".join(data_lines), []
            if state.on_data(payload, time.perf_counter()):
                return
    if data_lines and state.on_data("\n".join(data_lines), time.perf_counter()):
        return
    raise StreamFault(ErrorKind.MISSING_DONE, "stream ended without data: [DONE]")


def _retry_after_s(value: str | None) -> float | None:
    """Retry-After in seconds (the delay form; an HTTP date counts as absent)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def send_request(session: aiohttp.ClientSession, url: str, api: Api, payload: dict,
                       headers: dict[str, str], request: PlannedRequest, timeout_s: float,
                       run_start_t: float, scheduled_s: float | None) -> RequestRecord:
    """Send one streamed request; never raises (except cancellation)."""
    start_t = time.perf_counter()
    record = RequestRecord(index=request.index, class_name=request.class_name,
                           tier=request.tier, scheduled_s=scheduled_s,
                           start_s=start_t - run_start_t)
    state = StreamState(api, start_t)
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json=payload, headers=headers) as response:
                if response.status != 200:
                    record.retry_after_s = _retry_after_s(response.headers.get("Retry-After"))
                    body = await response.text(errors="replace")
                    raise StreamFault(f"http_{response.status}", body[:200])
                await read_stream(response, state)
        if state.num_content_chunks == 0:
            raise StreamFault(ErrorKind.NO_OUTPUT, "[DONE] without any content")
    except StreamFault as fault:
        record.error, record.error_detail = fault.kind, fault.detail
    except TimeoutError:
        record.error, record.error_detail = ErrorKind.TIMEOUT, f"no end within {timeout_s}s"
    except aiohttp.ClientConnectorError as exc:
        record.error, record.error_detail = ErrorKind.CONNECT_FAILED, str(exc)[:200]
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError,
            aiohttp.ClientConnectionError) as exc:
        record.error, record.error_detail = ErrorKind.CONNECTION_DROPPED, repr(exc)[:200]
    except (aiohttp.ClientError, ValueError, UnicodeError) as exc:
        record.error, record.error_detail = ErrorKind.CLIENT_ERROR, repr(exc)[:200]
    state.fill(record)
    if record.error is not None:
        record.error = str(record.error)
    return record
