"""Compiles a request's grammar before it is routed, so a grammar that cannot work is a 400
here, not an error from a worker (and a worker never sees it).

    parsed request --grammar?--> GrammarCheck.check_request: each tool's parameter schema,
        then the output grammar, each by GrammarCheck.check: compile on the pool (cached by the
        spec's key) within `deadline_s` --ok--> routed; the workers compile it again, from
        their own caches
                                                --GrammarError / deadline--> 400

Compiles run on a small thread pool of their own, never on the event loop, so `/health` and
every other request stay fast while a large schema compiles; the pool is bounded, so a flood
of schemas queues there (and meets its deadline) instead of taking every core. A compile
that misses its deadline keeps its thread until llguidance's own fuel limits end it; its
result still lands in the cache.

Lifecycle: built with the app; `close()` on cleanup stops the pool (compiles in progress
finish, queued ones are dropped).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from gateway.api.grammar_request import grammar_error
from gateway.api.request_parsing import ValidatedRequest
from gateway.api.tool_request import parameters_spec
from protocol.grammar_spec import GrammarSpec
from text.grammar import GrammarCompiler, GrammarError

DEFAULT_DEADLINE_S = 5.0


class GrammarCheck:
    def __init__(self, compiler: GrammarCompiler, deadline_s: float = DEFAULT_DEADLINE_S,
                 num_threads: int = 2) -> None:
        if deadline_s <= 0 or num_threads < 1:
            raise ValueError("the deadline and the number of threads must be positive")
        self._compiler = compiler
        self.deadline_s = deadline_s
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")

    async def check_request(self, validated: ValidatedRequest) -> None:
        """Every schema and grammar of a parsed request: each tool's parameters (so a bad
        one is named), then the output constraint; ApiError(400) for the first that fails."""
        if validated.tool_use is not None:
            for i, function in enumerate(validated.tool_use.functions):
                await self.check(parameters_spec(function), f"tools[{i}].function.parameters")
        if validated.grammar is not None:
            await self.check(validated.grammar, validated.grammar_param or "response_format")

    async def check(self, spec: GrammarSpec, param: str) -> None:
        """Returns when `spec` compiles; raises ApiError(400) naming `param` otherwise."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, self._compiler.compile, spec)
        try:
            await asyncio.wait_for(future, self.deadline_s)
        except GrammarError as exc:
            raise grammar_error(str(exc), spec, param) from None
        except TimeoutError:
            raise grammar_error(f"it did not compile within {self.deadline_s:g} s; simplify it",
                                spec, param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
