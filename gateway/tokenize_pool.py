"""Prompt tokenization off the event loop: a small thread pool with bounded admission.

Tokenizing (and applying a chat template to) a large prompt takes long enough to stall
every stream the gateway relays, so it runs on `max_workers` threads; requests beyond
`max_waiting` waiting for a thread are refused at once (503), so a burst of huge prompts
cannot queue without bound. Before any of it, a text too long to fit the context in any
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

from gateway.backend import PromptTokenizer

A = TypeVar("A")


class TokenizerBusy(Exception):
    """Too many prompts are waiting to be tokenized."""


class TokenizePool:
    def __init__(self, tokenizer: PromptTokenizer, max_workers: int = 2,
                 max_waiting: int = 64) -> None:
        self.tokenizer = tokenizer
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="tokenize")
        self._num_admitted = 0

    def min_tokens(self, num_chars: int) -> int:
        """The fewest tokens a text of `num_chars` characters can have."""
        return -(-num_chars // self.tokenizer.max_token_chars)

    async def encode(self, text: str) -> list[int]:
        return await self._run(self.tokenizer.encode, text)

    async def encode_chat(self, turns: Sequence[tuple[str, str]]) -> list[int]:
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
