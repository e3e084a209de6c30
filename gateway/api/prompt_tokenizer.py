"""The workers' tokenizer at the gateway: prompts in, and the text of a spliced first token out.

Prompts are tokenized once here (`PromptTokenizer` protocol of gateway/api/backend.py).

The first token of a handed-off request comes from the prefill worker as a bare id
(`PrefillResult.first_token_id`); its text is produced here exactly as the engine produces
it on the prefill side: the engine's detokenizer (`new_detokenizer`), then the stop
check that may hold back the start of a stop string. The decode worker replays the same
token through the same two steps (engine `add_decode_request`), so its later frames start
exactly where this text ends:

    text of token 1  = detok(prompt, t1)[:emit_end]       (here)
    frames 2..n      = engine text after emit_end           (decode worker)
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.sampling_params import SamplingParams
from text.detokenizer import new_detokenizer
from text.stop_checker import check_stop
from text.tokenizer import Tokenizer
from text.tool_prompt import ChatTurn, ToolFunction


class GatewayTokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        tokenizer.token_bytes()  # built now (as the engine's), not at the first handoff
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        # No token's text is longer than its vocabulary entry (byte-level entries spell one
        # byte per character), so a text of n characters has at least n / this many tokens.
        self.max_token_chars = max(map(len, vocab), default=1)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self._tokenizer.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self._tokenizer.encode_chat([{"role": r, "content": c} for r, c in messages])

    def encode_tool_chat(self, turns: Sequence[ChatTurn],
                         functions: tuple[ToolFunction, ...]) -> list[int]:
        return self._tokenizer.encode_tool_chat(turns, functions)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprob listings (a lone byte piece decodes to U+FFFD)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def first_token_text(self, prompt_token_ids: Sequence[int], token_id: int,
                         params: SamplingParams, finished: bool) -> str:
        """The text the engine streams for output token 1 (see the module docstring).

        `finished`: the prefill worker reported that token 1 already ends the request, so
        held-back text is released as the engine releases it at the end.
        """
        detokenizer = new_detokenizer(self._tokenizer, prompt_token_ids)
        text = detokenizer.add(token_id)
        check = check_stop(params, self.eos_token_ids, [token_id], text, len(text))
        if check.finished and isinstance(check.stop_reason, str):
            return text[:check.emit_end]  # cut at (or through) the stop string
        if finished or check.finished:
            return text + detokenizer.flush()
        return text[:check.emit_end]
