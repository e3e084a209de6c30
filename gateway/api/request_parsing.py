"""Request bodies -> validated requests -> `SamplingParams`, or an `ApiError` (400/422).

Side-effect free. Two stages, because the default and the ceiling of `max_tokens` depend
on the prompt's length, which is known only after tokenization:

    body bytes --parse_completion/parse_chat--> ValidatedRequest      (shape, types, ranges)
    ValidatedRequest + prompt_len --build_sampling_params--> SamplingParams (context fit)

Every error names the offending field in `param`, as a JSON path without the leading `$.`
(`messages[2].content`), so clients can point at it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import msgspec

from gateway.api.chat_messages import validate_messages
from gateway.api.errors import ApiError, invalid_request, unsupported
from gateway.api.grammar_request import grammar_from_request
from gateway.api.openai_api import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.api.tool_request import ToolUse, tool_use_from_request
from protocol.grammar_spec import GrammarSpec
from protocol.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, SamplingParams
from text.tool_prompt import ChatTurn

# OpenAI's completions endpoint defaults to 16 tokens; chat fills the remaining context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Choices one request may ask for: n per prompt, and prompts x n in all (each choice is a
# generation of its own on the workers: gateway/api/multi_choice.py).
MAX_N = 16
MAX_BATCH_PROMPTS = 64
MAX_CHOICES = 64
INT64_MIN, UINT64_MAX, INT32_MAX = -(2**63), 2**64 - 1, 2**31 - 1
S = TypeVar("S", bound=msgspec.Struct)


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_model_len: int  # prompt + generated tokens
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    vocab_size: int | None = None  # None: token ids are not range-checked here
    max_stop_sequences: int = 16
    max_stop_chars: int = 1024
    max_body_bytes: int = 4 * 1024 * 1024
    reject_unknown_fields: bool = False
    # The context is capped by the workers' KV cache (smaller than the model's), not the model.
    limited_by_kv_cache: bool = False

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")

    @property
    def context_description(self) -> str:
        """What bounds the context, for error messages."""
        if self.limited_by_kv_cache:
            return f"the workers' KV cache holds {self.max_model_len} tokens"
        return f"this model's maximum context length is {self.max_model_len} tokens"

    @property
    def prompt_token_limit(self) -> int:
        limit = self.max_model_len - 1
        return limit if self.max_prompt_tokens is None else min(limit, self.max_prompt_tokens)


@dataclass(frozen=True, slots=True)
class ValidatedRequest:
    endpoint: Endpoint
    model: str
    prompt_text: str | None  # completions with a text prompt
    prompt_token_ids: tuple[int, ...] | None  # completions with token ids
    chat_turns: tuple[tuple[str, str], ...] | None  # chat: (role, text), role normalised
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: fill the remaining context
    logprobs: int | None
    sampling_fields: SamplingFields  # the decoded body, for build_sampling_params
    unknown_fields: tuple[str, ...]
    user: str | None
    # /v1/completions with a list of prompts (two or more): each a text or token ids, in
    # order; prompt_text and prompt_token_ids are then None.
    batch_prompts: tuple[str | tuple[int, ...], ...] | None = None
    n: int = 1  # choices per prompt
    grammar: GrammarSpec | None = None  # the output must match it
    grammar_param: str | None = None  # the field that gave it, for errors
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    # Chat with tools, or a conversation that carries tool calls or results: the whole
    # conversation, rendered by the tokenizer's tool path (text/tool_prompt.py).
    tool_turns: tuple[ChatTurn, ...] | None = None
    tool_use: ToolUse | None = None


def parse_completion(body: bytes, limits: RequestLimits) -> ValidatedRequest:
    req, unknown = _decode(body, CompletionRequest, limits)
    prompts = _validate_prompts(req.prompt, limits)
    batch = prompts if len(prompts) > 1 else None
    prompt_text = prompts[0] if batch is None and isinstance(prompts[0], str) else None
    prompt_ids = prompts[0] if batch is None and isinstance(prompts[0], tuple) else None
    if req.echo:
        raise unsupported("`echo` is not supported.", "echo")
    if req.suffix:
        raise unsupported("`suffix` is not supported.", "suffix")
    logprobs = _check_int_range(req.logprobs, "logprobs", 0, 20)
    constraints = _validate_common(req, limits)
    num_choices = len(prompts) * constraints["n"]
    if num_choices > MAX_CHOICES:
        raise invalid_request(f"{len(prompts)} prompts x n = {constraints['n']} asks for "
                              f"{num_choices} choices; at most {MAX_CHOICES} per request.", "n")
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    return ValidatedRequest(
        endpoint=Endpoint.COMPLETIONS, model=req.model, prompt_text=prompt_text,
        prompt_token_ids=prompt_ids, chat_turns=None, stream=bool(req.stream),
        include_usage=_include_usage(req), max_tokens=max_tokens, logprobs=logprobs,
        sampling_fields=req, unknown_fields=unknown, user=req.user, batch_prompts=batch,
        **constraints)


def parse_chat(body: bytes, limits: RequestLimits) -> ValidatedRequest:
    req, unknown = _decode(body, ChatCompletionRequest, limits)
    full_turns = validate_messages(req.messages)
    turns = tuple((t.role, t.content) for t in full_turns)
    tool_use = tool_use_from_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    with_tools = tool_use is not None or any(t.role == "tool" or t.tool_calls for t in full_turns)
    top_logprobs = _check_int_range(req.top_logprobs, "top_logprobs", 0, 20)
    if top_logprobs is not None and not req.logprobs:
        raise invalid_request("`top_logprobs` requires `logprobs` to be true.", "top_logprobs")
    logprobs = (top_logprobs or 0) if req.logprobs else None
    constraints = _validate_common(req, limits)
    forced = tool_use.grammar() if tool_use is not None else None
    if forced is not None:
        if constraints["grammar"] is not None:
            raise invalid_request(f"`tool_choice` {tool_use.choice.value if tool_use else ''} "
                                  f"cannot be combined with `{constraints['grammar_param']}` "
                                  "(both constrain the output).", "tool_choice")
        if req.ignore_eos:
            raise invalid_request("`ignore_eos` cannot be combined with a forced tool call.",
                                  "ignore_eos")
        constraints["grammar"], constraints["grammar_param"] = forced, "tools"
    # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    _check_int_range(max_tokens, param, 1, None)
    return ValidatedRequest(
        endpoint=Endpoint.CHAT, model=req.model, prompt_text=None, prompt_token_ids=None,
        chat_turns=turns, stream=bool(req.stream), include_usage=_include_usage(req),
        max_tokens=max_tokens, logprobs=logprobs, sampling_fields=req,
        unknown_fields=unknown, user=req.user, tool_turns=full_turns if with_tools else None,
        tool_use=tool_use, **constraints)


def build_sampling_params(request: ValidatedRequest, prompt_len: int,
                          limits: RequestLimits) -> SamplingParams:
    """The engine's parameters once the prompt is tokenized; raises ApiError(400)."""
    if prompt_len < 1:
        raise invalid_request("The prompt is empty after tokenization.", _prompt_param(request))
    what = limits.context_description
    if prompt_len > limits.prompt_token_limit:
        raise invalid_request(
            f"The prompt has {prompt_len} tokens; this model accepts at most "
            f"{limits.prompt_token_limit} ({what}).",
            _prompt_param(request), code="context_length_exceeded")
    remaining = limits.max_model_len - prompt_len
    max_tokens = remaining if request.max_tokens is None else request.max_tokens
    if max_tokens > remaining:
        raise invalid_request(
            f"{what[0].upper()}{what[1:]}. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).", "max_tokens", code="context_length_exceeded")
    f = request.sampling_fields
    stop = (f.stop,) if isinstance(f.stop, str) else tuple(f.stop or ())
    top_k = None if f.top_k is None or f.top_k in (-1, 0) else f.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(f.temperature, 1.0), top_p=_or(f.top_p, 1.0), top_k=top_k,
            min_p=_or(f.min_p, 0.0), seed=f.seed,
            presence_penalty=_or(f.presence_penalty, 0.0),
            frequency_penalty=_or(f.frequency_penalty, 0.0),
            repetition_penalty=_or(f.repetition_penalty, 1.0),
            stop=stop, stop_token_ids=tuple(f.stop_token_ids or ()),
            ignore_eos=bool(f.ignore_eos), min_tokens=_or(f.min_tokens, 0),
            logprobs=request.logprobs,
            include_stop_str_in_output=bool(f.include_stop_str_in_output),
            logit_bias=request.logit_bias, grammar=request.grammar)
    except ValueError as exc:
        # SamplingParams messages start with the field's name ("top_p must be in ...").
        message = str(exc)
        param = message.split(" ", 1)[0]
        if request.endpoint is Endpoint.CHAT and param == "logprobs":
            param = "top_logprobs"
        raise invalid_request(message, param) from exc


# ---------------------------------------------------------------- decoding

def _decode(body: bytes, struct_type: type[S], limits: RequestLimits) -> tuple[S, tuple[str, ...]]:
    if not body.strip():
        raise invalid_request("The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        # ValidationError: numbers out of float range. DecodeError covers invalid UTF-8.
        raise invalid_request(f"The request body is not valid JSON: {exc}.", code="invalid_json") from exc
    if not isinstance(raw, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    known = struct_type.__struct_fields__
    unknown = tuple(sorted(k for k in raw if k not in known))
    if unknown and limits.reject_unknown_fields:
        raise invalid_request(f"Unrecognized request argument supplied: {unknown[0]}",
                              unknown[0], code="unknown_parameter")
    try:
        return msgspec.convert(raw, struct_type), unknown
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from exc


def _validation_error(text: str) -> ApiError:
    """'Expected `int`, got `str` - at `$.max_tokens`' -> 400 with param 'max_tokens'."""
    message, sep, where = text.partition(" - at `$")
    param = where.rstrip("`").lstrip(".") if sep else None
    if message.startswith("Object missing required field `"):
        field = message.split("`")[1]
        param = f"{param}.{field}" if param else field
        return invalid_request(f"Missing required parameter: `{param}`.", param,
                               code="missing_required_parameter")
    return invalid_request(f"Invalid type or value for `{param}`: {message}." if param
                           else f"Invalid request: {message}.", param, code="invalid_type")


# ---------------------------------------------------------------- field checks

def _validate_prompts(prompt: str | list[Any], limits: RequestLimits
                      ) -> tuple[str | tuple[int, ...], ...]:
    """One prompt or a batch: a string, token ids, or a list of either (not mixed)."""
    if isinstance(prompt, str) or not prompt or all(type(t) is int for t in prompt):
        return (_validate_prompt(prompt, limits, "prompt"),)
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise invalid_request("`prompt` must be a string, a list of token ids, or a list of "
                              "strings or of token-id lists (not mixed).", "prompt",
                              code="invalid_type")
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise invalid_request(f"At most {MAX_BATCH_PROMPTS} prompts per request; got "
                              f"{len(prompt)}.", "prompt")
    return tuple(_validate_prompt(p, limits, f"prompt[{i}]") for i, p in enumerate(prompt))


def _validate_prompt(prompt: str | list[Any], limits: RequestLimits,
                     param: str) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_request(f"`{param}` must not be empty.", param)
        return prompt
    if not prompt:
        raise invalid_request(f"`{param}` must not be empty.", param)
    if not all(type(t) is int for t in prompt):
        raise invalid_request(f"`{param}` must be a string or a list of token ids.", param,
                              code="invalid_type")
    if len(prompt) > limits.prompt_token_limit:
        raise invalid_request(
            f"The prompt has {len(prompt)} tokens; this model accepts at most "
            f"{limits.prompt_token_limit}.", param, code="context_length_exceeded")
    vocab = limits.vocab_size
    # Without a known vocabulary, still refuse ids no tokenizer has (int32 overflow).
    bound = vocab if vocab is not None else 2**31
    for i, t in enumerate(prompt):
        if t < 0 or t >= bound:
            raise invalid_request(f"Token id {t} is outside the vocabulary"
                                  f"{f' [0, {vocab})' if vocab else ''}.", f"{param}[{i}]")
    return tuple(prompt)


class _Constraints(TypedDict):
    n: int
    grammar: GrammarSpec | None
    grammar_param: str | None
    logit_bias: tuple[tuple[int, float], ...]


def _validate_common(req: SamplingFields, limits: RequestLimits) -> _Constraints:
    """Checks the fields both endpoints share; returns the parsed output constraints."""
    if not req.model:
        raise invalid_request("`model` must not be empty.", "model")
    n = req.n if req.n is not None else 1
    if not 1 <= n <= MAX_N:
        raise invalid_request(f"`n` must be in [1, {MAX_N}], got {n}.", "n")
    if req.best_of is not None and req.best_of != n:
        raise unsupported("`best_of` must equal `n` (no candidates are ranked).", "best_of")
    if req.stream_options is not None and not req.stream:
        raise invalid_request("`stream_options` is only allowed when `stream` is true.", "stream_options")
    _check_int_range(req.max_tokens, "max_tokens", 1, None)
    _check_int_range(req.min_tokens, "min_tokens", 0, None)
    _check_int_range(req.seed, "seed", INT64_MIN, UINT64_MAX)
    _check_int_range(req.top_k, "top_k", -1, INT32_MAX)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise invalid_request(f"`{name}` must be a finite number.", name)
    if req.temperature is not None and req.temperature > 2:
        raise invalid_request(f"`temperature` must be in [0, 2], got {req.temperature}.", "temperature")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise invalid_request(f"At most {limits.max_stop_sequences} stop sequences are allowed.", "stop")
    for s in stops:
        if not s or len(s) > limits.max_stop_chars:
            raise invalid_request(f"Stop sequences must have 1 to {limits.max_stop_chars} characters.", "stop")
    for t in req.stop_token_ids or ():
        if t < 0 or t >= (limits.vocab_size if limits.vocab_size is not None else 2**31):
            raise invalid_request(f"Stop token id {t} is outside the vocabulary.", "stop_token_ids")
    found = grammar_from_request(req)
    if found is not None and req.ignore_eos:
        raise invalid_request("`ignore_eos` cannot be combined with an output constraint "
                              "(the constraint ends the output with EOS).", "ignore_eos")
    return _Constraints(n=n, grammar=found[0] if found else None,
                        grammar_param=found[1] if found else None,
                        logit_bias=_validate_logit_bias(req.logit_bias, limits))


def _validate_logit_bias(bias: dict[str, Any] | None, limits: RequestLimits
                         ) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a string) to a bias in [-100, 100], sorted by id."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid_request(f"`logit_bias` may name at most {MAX_LOGIT_BIAS_TOKENS} tokens.",
                              "logit_bias")
    bound = limits.vocab_size if limits.vocab_size is not None else 2**31
    pairs = []
    for key, value in bias.items():
        where = f"logit_bias.{key}"
        if not (key.isascii() and key.isdigit()) or int(key) >= bound:
            raise invalid_request(f"`logit_bias` keys must be token ids in [0, {bound}); got "
                                  f"{key!r}.", where)
        if (type(value) not in (int, float) or not math.isfinite(value)
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise invalid_request(f"`logit_bias` values must be numbers in [-100, 100]; got "
                                  f"{value!r} for token {key}.", where)
        pairs.append((int(key), float(value)))
    pairs.sort()
    if len({t for t, _ in pairs}) != len(pairs):  # "7" and "07"
        raise invalid_request("`logit_bias` names a token twice.", "logit_bias")
    return tuple(pairs)


def _check_int_range(value: int | None, name: str, low: int, high: int | None) -> int | None:
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise invalid_request(f"`{name}` must be {bound}, got {value}.", name)
    return value


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream and req.stream_options and req.stream_options.include_usage)


def _prompt_param(request: ValidatedRequest) -> str:
    return "messages" if request.endpoint is Endpoint.CHAT else "prompt"


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
