"""Prompt tokenization off the event loop: a small thread pool with bounded admission.

Tokenizing (and applying a chat template to) a large prompt takes long enough to stall
every stream the gateway relays, so it runs on `max_workers` threads; requests beyond
`max_waiting` waiting for a thread are refused at once (503), so a burst of huge prompts
cannot queue without bound. A short prompt (at most `inline_max_chars` characters, tens
of microseconds of work; a chat of at most INLINE_MAX_TURNS turns) is tokenized on the
spot instead: a thread hop would cost more,
and a burst of short chats must not be refused for a queue it never needed. Before any of it, a text too long to fit the context in any
tokenization is refused by its length alone: no token is longer than the tokenizer's
longest vocabulary entry, so n characters make at least ceil(n / max_token_chars) tokens.

Lifecycle: created with the app → tokenize() per request → close() at shutdown (the
threads finish what they run). Invariant: at most max_workers + max_waiting tokenizations
are admitted at once (`check_invariants`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

from gateway.api.backend import PromptTokenizer

A = TypeVar("A")
INLINE_MAX_TURNS = 16  # a chat template's cost grows with the turns, not only the text


class TokenizerBusy(Exception):
    """Too many prompts are waiting to be tokenized."""


class TokenizePool:
    def __init__(self, tokenizer: PromptTokenizer, max_workers: int = 2,
                 max_waiting: int = 64, inline_max_chars: int = 512) -> None:
        self.tokenizer = tokenizer
        self.inline_max_chars = inline_max_chars
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tokenize")
        self._num_admitted = 0

    def min_tokens(self, num_chars: int) -> int:
        """The fewest tokens a text of `num_chars` characters can have."""
        return -(-num_chars // self.tokenizer.max_token_chars)

    async def encode(self, text: str) -> list[int]:
        if len(text) <= self.inline_max_chars:
            return self.tokenizer.encode(text)
        return await self._run(self.tokenizer.encode, text)

    async def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        if len(turns) <= INLINE_MAX_TURNS and \
                sum(len(text) for _, text in turns) <= self.inline_max_chars:
            return self.tokenizer.encode_chat(turns)
        return await self._run(self.tokenizer.encode_chat, turns)

    async def _run(self, fn: Callable[[A], list[int]], arg: A) -> list[int]:
        if self._num_admitted >= self.max_workers + self.max_waiting:
            raise TokenizerBusy(f"{self._num_admitted} prompts are being tokenized")
        self._num_admitted += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, arg)
        finally:
            self._num_admitted -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_invariants(self) -> None:
        assert 0 <= self._num_admitted <= self.max_workers + self.max_waiting
