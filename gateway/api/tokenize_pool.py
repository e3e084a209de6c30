"""Prompt tokenization off the event loop: a small thread pool with bounded admission and
a deadline per prompt.

Tokenizing (and applying a chat template to) a large prompt takes long enough to stall
every stream the gateway relays, so it runs on `max_workers` threads. The tokenizer's
Rust code runs there with the interpreter lock released (text/tokenizer.py: `tokenizers`'
single `encode` would hold it for the whole call, 0.34 s for a 660 kB prompt, and the loop
with it); a chat template renders in Python and so hands the lock back every switch
interval. Requests beyond `max_waiting` waiting for a thread are refused at once (503), so a
burst of huge prompts cannot queue without bound, and one that is not tokenized within
`deadline_s` is answered 503 too; its slot stays taken until its thread is done with it (a
thread cannot be stopped mid-call; one that never started is dropped). A short prompt (at
most `inline_max_chars` characters, tens of microseconds of work; a chat of at most
INLINE_MAX_TURNS turns) is tokenized on the spot instead: a thread hop would cost more,
and a burst of short chats must not be refused for a queue it never needed. Before any of
it, a text too long to fit the context in any tokenization is refused by its length
alone: no token is longer than the tokenizer's longest vocabulary entry, so n characters
make at least ceil(n / max_token_chars) tokens.

Lifecycle: created with the app → tokenize() per request → close() at shutdown (the
threads finish what they run). Invariant: at most max_workers + max_waiting tokenizations
are admitted at once, counted from admission until their thread is done with them or they
are dropped unstarted (`check_invariants`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

from gateway.api.backend import PromptTokenizer
from text.tool_prompt import ChatTurn, ToolFunction

A = TypeVar("A")
INLINE_MAX_TURNS = 16  # a chat template's cost grows with the turns, not only the text


class TokenizerBusy(Exception):
    """Too many prompts are being tokenized, or this one was not within its deadline."""


class TokenizePool:
    def __init__(self, tokenizer: PromptTokenizer, max_workers: int = 2,
                 max_waiting: int = 64, inline_max_chars: int = 512,
                 deadline_s: float = 10.0) -> None:
        """`deadline_s`: from admission to the ids; a full queue of the longest prompts
        (64 waiting, 0.35 s each on two threads) takes about 11 s."""
        self.tokenizer = tokenizer
        self.inline_max_chars = inline_max_chars
        self.max_workers = max_workers
        self.max_waiting = max_waiting
        self.deadline_s = deadline_s
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

    async def encode_tool_chat(self, turns: tuple[ChatTurn, ...],
                               functions: tuple[ToolFunction, ...]) -> list[int]:
        """A conversation with tools: always on the pool (its rendering is the costly kind)."""
        tokenizer = self.tokenizer
        return await self._run(lambda job: tokenizer.encode_tool_chat(*job), (turns, functions))

    async def _run(self, fn: Callable[[A], list[int]], arg: A) -> list[int]:
        if self._num_admitted >= self.max_workers + self.max_waiting:
            raise TokenizerBusy(f"{self._num_admitted} prompts are being tokenized")
        self._num_admitted += 1
        work = self._executor.submit(fn, arg)
        job = asyncio.wrap_future(work)
        # On the loop, once the thread is done with it (or it was dropped before it began).
        job.add_done_callback(self._finished)
        try:
            async with asyncio.timeout(self.deadline_s):
                return await asyncio.shield(job)
        except TimeoutError:
            raise TokenizerBusy(f"the prompt was not tokenized within {self.deadline_s:g} s"
                                ) from None
        finally:
            work.cancel()  # a no-op once it runs or ran: its slot is freed when it is done

    def _finished(self, job: asyncio.Future[list[int]]) -> None:
        self._num_admitted -= 1
        if not job.cancelled():
            job.exception()  # retrieved: the waiter may have left (deadline, client gone)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def check_invariants(self) -> None:
        assert 0 <= self._num_admitted <= self.max_workers + self.max_waiting
