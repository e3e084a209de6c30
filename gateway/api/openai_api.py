"""Wire types of the OpenAI-compatible API: request bodies, responses and stream chunks.

Requests are decoded in two steps (see `gateway.api.request_parsing`): JSON -> builtins, then
`msgspec.convert` into these Structs, so type errors carry a JSON path (`$.messages[0].role`)
that becomes the error's `param`. Value ranges and cross-field rules are checked after
conversion, in code, where the messages can name the field and the allowed range.

Unknown top-level fields are ignored (and reported back to the caller for a log line), as
OpenAI and vLLM do in practice: benchmark tools send vendor extensions such as
`skip_special_tokens` that must not fail a request. Fields that are known but change
semantics in ways pdserve does not implement (`echo`, `suffix`, images, ...) are rejected
with a clear 400 instead of being silently dropped.

`prompt`, `logit_bias` and `tools` are typed loosely (`list[Any]`, ...) because msgspec
unions admit one array-like member; their shapes are checked by hand.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ---------------------------------------------------------------- requests

class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content list; only `{"type": "text", "text": ...}` is served."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # assistant: the calls it made (checked by hand)
    tool_call_id: str | None = None  # tool: the call this message answers


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is always honoured:
    the output is constrained to the schema either way)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` extension (gateway/api/grammar_request.py)."""

    json: Any = None  # a schema, as an object or JSON text
    regex: Any = None
    choice: Any = None
    grammar: Any = None
    json_object: bool | None = None
    structural_tag: Any = None  # not supported (400)
    whitespace_pattern: Any = None  # not supported (400)


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0 mean "no cut"
    min_p: float | None = None  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM extension
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    n: int | None = None
    best_of: int | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension
    include_stop_str_in_output: bool | None = None  # vLLM extension
    # Output constraints (gateway/api/grammar_request.py): OpenAI's, vLLM's, vLLM's older.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: str | None = None  # accepted and ignored (one engine here)


class CompletionRequest(SamplingFields, kw_only=True):
    """Body of POST /v1/completions."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # gateway/api/tool_request.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


# ---------------------------------------------------------------- responses

class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int  # prompt tokens whose KV came from a prefix cache


class Usage(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # When the workers reported it: the prompt's tokens found in the prefilling worker's
    # prefix cache (with n > 1, the first choice's: the prompt counts once).
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One `data:` event of a streamed completion (OpenAI names its object like the response)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob] | None


class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatResponseMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    # `role` and `content` have no default, so they are always written (content null beside
    # tool calls); `tool_calls` only when there are some.
    role: str
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ToolCallFunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: the first names it (`id`, `type`, `function.name`), the
    next ones add to `function.arguments`; `index` says which call of the choice."""

    index: int
    id: str | None = None
    type: str | None = None
    function: ToolCallFunctionDelta | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    # The last chunk's delta is `{}`: omit_defaults drops the unset members.
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
