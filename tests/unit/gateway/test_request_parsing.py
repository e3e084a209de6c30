from __future__ import annotations

import msgspec
import pytest

from gateway.api.errors import ApiError
from gateway.api.request_parsing import (Endpoint, RequestLimits, build_sampling_params, parse_chat,
                                         parse_completion)

LIMITS = RequestLimits(max_model_len=100, vocab_size=1000)


def chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return msgspec.json.encode(body)


def completion(**fields) -> bytes:
    body = {"model": "m", "prompt": "hi"}
    body.update(fields)
    return msgspec.json.encode(body)


def error_of(fn, body, limits=LIMITS) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body, limits)
    return info.value


def test_full_chat_request_maps_every_field_to_sampling_params():
    req = parse_chat(chat(max_completion_tokens=20, temperature=0, top_p=0.9, top_k=5, min_p=0.1,
                          seed=7, stop=["\n", "END"], presence_penalty=0.5,
                          frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=True,
                          top_logprobs=3, n=1, user="u", stream=True,
                          stream_options={"include_usage": True}, ignore_eos=True,
                          min_tokens=2, skip_special_tokens=True), LIMITS)
    assert req.endpoint is Endpoint.CHAT and req.stream and req.include_usage
    assert req.unknown_fields == ("skip_special_tokens",)
    params = build_sampling_params(req, prompt_len=10, limits=LIMITS)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (20, 0, 0.9, 5)
    assert params.stop == ("\n", "END") and params.seed == 7 and params.logprobs == 3
    assert params.ignore_eos and params.min_tokens == 2 and params.repetition_penalty == 1.1
    assert params.is_greedy


def test_defaults_completions_16_tokens_chat_fills_context():
    assert build_sampling_params(parse_completion(completion(), LIMITS), 10, LIMITS).max_tokens == 16
    assert build_sampling_params(parse_chat(chat(), LIMITS), 10, LIMITS).max_tokens == 90


def test_prompt_forms():
    assert parse_completion(completion(prompt="x"), LIMITS).prompt_text == "x"
    assert parse_completion(completion(prompt=["x"]), LIMITS).prompt_text == "x"
    assert parse_completion(completion(prompt=[1, 2, 3]), LIMITS).prompt_token_ids == (1, 2, 3)
    assert parse_completion(completion(prompt=[[4, 5]]), LIMITS).prompt_token_ids == (4, 5)
    batch = parse_completion(completion(prompt=["a", "b"]), LIMITS)
    assert batch.batch_prompts == ("a", "b") and batch.prompt_text is None
    ids = parse_completion(completion(prompt=[[1], [2, 3]], n=2, best_of=2), LIMITS)
    assert ids.batch_prompts == ((1,), (2, 3)) and ids.n == 2


def test_content_parts_are_joined_and_developer_is_system():
    req = parse_chat(chat(messages=[{"role": "developer", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]),
                     LIMITS)
    assert req.chat_turns == (("system", "be brief"), ("user", "a\nb"))


@pytest.mark.parametrize("fn, body, status, param", [
    (parse_chat, chat(n=17), 400, "n"),
    (parse_chat, chat(n=2, best_of=3), 400, "best_of"),
    (parse_chat, chat(n=0), 400, "n"),
    (parse_chat, chat(max_tokens=-1), 400, "max_tokens"),
    (parse_chat, chat(max_tokens="5"), 400, "max_tokens"),
    (parse_chat, chat(max_tokens=True), 400, "max_tokens"),
    (parse_chat, chat(temperature=3), 400, "temperature"),
    (parse_chat, chat(temperature="hot"), 400, "temperature"),
    (parse_chat, chat(messages=[]), 400, "messages"),
    (parse_chat, chat(messages=[{"role": "function", "content": "x"}]), 400, "messages[0].role"),
    (parse_chat, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (parse_chat, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400,
     "messages[0].content[0].type"),
    (parse_chat, chat(messages=[{"content": "x"}]), 400, "messages[0].role"),
    (parse_chat, chat(top_logprobs=2), 400, "top_logprobs"),
    (parse_chat, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (parse_chat, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    (parse_chat, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    (parse_chat, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (parse_chat, chat(stop=[""]), 400, "stop"),
    (parse_chat, chat(stop=["a"] * 17), 400, "stop"),
    (parse_chat, chat(seed=2**70), 400, "seed"),
    (parse_chat, chat(logit_bias={"5": 101}), 400, "logit_bias.5"),
    (parse_chat, b'{"messages": []}', 400, "model"),
    (parse_completion, completion(prompt=""), 400, "prompt"),
    (parse_completion, completion(prompt=[]), 400, "prompt"),
    (parse_completion, completion(prompt=["a", [1]]), 400, "prompt"),
    (parse_completion, completion(prompt=["a", ""]), 400, "prompt[1]"),
    (parse_completion, completion(prompt=[[1, 2], [1, -1]]), 400, "prompt[1][1]"),
    (parse_completion, completion(prompt=["a"] * 65), 400, "prompt"),
    (parse_completion, completion(prompt=["a"] * 8, n=9), 400, "n"),
    (parse_completion, completion(prompt=[1, -2]), 400, "prompt[1]"),
    (parse_completion, completion(prompt=[1, 5000]), 400, "prompt[1]"),
    (parse_completion, completion(prompt=[True]), 400, "prompt"),
    (parse_completion, completion(prompt=list(range(100))), 400, "prompt"),
    (parse_completion, completion(echo=True), 400, "echo"),
    (parse_completion, completion(best_of=3), 400, "best_of"),
    (parse_completion, completion(logprobs=21), 400, "logprobs"),
    (parse_completion, b"[1, 2]", 400, None),
    (parse_completion, b"", 400, None),
    (parse_completion, b'{"model": "m", "prompt": "\xff"}', 400, None),
    (parse_completion, b'{"model": "m", "prompt": "x"', 400, None),
    (parse_completion, b"[" * 100_000, 400, None),
    (parse_completion, b'{"model": "m", "prompt": "x", "temperature": 1e999}', 400, None),
])
def test_bad_requests_are_400_naming_the_field(fn, body, status, param):
    error = error_of(fn, body)
    assert error.status == status and error.param == param
    assert error.type == "invalid_request_error" and error.message


def test_unknown_fields_rejected_when_configured():
    strict = RequestLimits(max_model_len=100, reject_unknown_fields=True)
    error = error_of(parse_chat, chat(frobnicate=1), strict)
    assert error.param == "frobnicate" and "Unrecognized request argument" in error.message


def test_context_overflow_and_sampling_ranges_after_tokenization():
    req = parse_chat(chat(max_tokens=95), LIMITS)
    with pytest.raises(ApiError) as info:
        build_sampling_params(req, prompt_len=10, limits=LIMITS)
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as info:
        build_sampling_params(parse_chat(chat(), LIMITS), prompt_len=100, limits=LIMITS)
    assert info.value.param == "messages"
    # Ranges SamplingParams enforces come back as 400s naming the field.
    for body, param in ((chat(top_p=0), "top_p"), (chat(min_p=2), "min_p"),
                        (chat(presence_penalty=3), "presence_penalty"),
                        (chat(repetition_penalty=0), "repetition_penalty"),
                        (chat(max_tokens=3, min_tokens=5), "min_tokens"),
                        (chat(top_k=-5), "top_k")):
        with pytest.raises(ApiError) as info:
            build_sampling_params(parse_chat(body, LIMITS), prompt_len=10, limits=LIMITS)
        assert (info.value.status, info.value.param) == (400, param)
