"""The gateway's compile of a request's grammar: 400s naming the problem, a deadline, and
the event loop free while a compile runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.api.errors import ApiError
from gateway.api.grammar_check import GrammarCheck
from protocol.grammar_spec import GrammarKind, GrammarSpec
from text.grammar import GrammarError

SPEC = GrammarSpec(GrammarKind.REGEX, "a+")


class FakeCompiler:
    def __init__(self, delay_s: float = 0.0, error: str | None = None) -> None:
        self.delay_s, self.error = delay_s, error
        self.threads: list[str] = []

    def compile(self, spec: GrammarSpec) -> object:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        if self.error is not None:
            raise GrammarError(self.error)
        return object()


def run(check: GrammarCheck, spec: GrammarSpec = SPEC, param: str = "guided_regex") -> None:
    async def go() -> None:
        await check.check(spec, param)
    try:
        asyncio.run(go())
    finally:
        check.close()


def test_a_grammar_that_compiles_passes_on_the_pool_thread():
    compiler = FakeCompiler()
    run(GrammarCheck(compiler))  # type: ignore[arg-type]
    assert compiler.threads and compiler.threads[0].startswith("grammar")


def test_a_compile_error_is_400_naming_the_field_and_the_problem():
    with pytest.raises(ApiError) as info:
        run(GrammarCheck(FakeCompiler(error="unclosed group")))  # type: ignore[arg-type]
    error = info.value
    assert (error.status, error.param, error.code) == (400, "guided_regex", "invalid_grammar")
    assert "unclosed group" in error.message and "regex" in error.message


def test_a_slow_compile_misses_its_deadline_while_the_loop_keeps_running():
    check = GrammarCheck(FakeCompiler(delay_s=2.0), deadline_s=0.1)  # type: ignore[arg-type]
    ticks = 0

    async def go() -> None:
        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        try:
            await check.check(SPEC, "response_format")
        finally:
            ticker.cancel()

    started = time.monotonic()
    with pytest.raises(ApiError) as info:
        asyncio.run(go())
    check.close()
    assert time.monotonic() - started < 1.5
    assert info.value.status == 400 and "0.1 s" in info.value.message
    assert ticks >= 5  # the loop ran while the compile did
