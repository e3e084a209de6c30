"""Short prompts are tokenized on the spot; long ones on the pool, refused past its bound."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from gateway.api.tokenize_pool import TokenizePool, TokenizerBusy


class ThreadRecorder:
    max_token_chars = 1

    def __init__(self, release: threading.Event | None = None) -> None:
        self.threads: list[str] = []
        self.release = release

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if self.release is not None and len(text) > 10:
            self.release.wait(5)
        return [len(text)]

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        return self.encode("".join(text for _, text in messages))


def test_short_prompts_stay_on_the_loop_and_long_ones_go_to_the_pool() -> None:
    recorder = ThreadRecorder()
    pool = TokenizePool(recorder, inline_max_chars=10)

    async def run() -> None:
        assert await pool.encode("short") == [5]
        assert await pool.encode("x" * 11) == [11]
        assert await pool.encode_chat([("user", "hi")]) == [2]
        assert await pool.encode_chat([("user", "")] * 17) == [0]  # many turns: the pool

    asyncio.run(run())
    pool.close()
    main = threading.current_thread().name
    assert recorder.threads[0] == main and recorder.threads[2] == main
    assert recorder.threads[1].startswith("tokenize") and recorder.threads[3].startswith("tokenize")


def test_a_burst_of_short_prompts_is_never_refused_but_long_ones_are_bounded() -> None:
    release = threading.Event()
    pool = TokenizePool(ThreadRecorder(release), max_workers=1, max_waiting=1,
                        inline_max_chars=10)

    async def run() -> None:
        long_ones = [asyncio.ensure_future(pool.encode("y" * 20)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(TokenizerBusy):
            await pool.encode("z" * 20)
        assert [await pool.encode("hi") for _ in range(100)] == [[2]] * 100
        pool.check_invariants()
        release.set()
        assert await asyncio.gather(*long_ones) == [[20], [20]]

    asyncio.run(run())
    pool.close()


def test_a_prompt_past_its_deadline_is_refused_and_its_slot_kept_until_its_thread_is_done(
        ) -> None:
    release = threading.Event()
    pool = TokenizePool(ThreadRecorder(release), max_workers=1, max_waiting=1,
                        inline_max_chars=10, deadline_s=0.1)

    async def run() -> None:
        with pytest.raises(TokenizerBusy, match="within 0.1 s"):
            await pool.encode("y" * 20)  # its thread waits for `release`
        # The thread still runs it: the slot is not free for a third prompt.
        waiting = asyncio.ensure_future(pool.encode("w" * 20))
        await asyncio.sleep(0.02)
        with pytest.raises(TokenizerBusy, match="being tokenized"):
            await pool.encode("z" * 20)
        pool.check_invariants()
        release.set()
        assert await waiting == [20]
        await asyncio.sleep(0.05)  # the first one's thread is done: its slot comes back
        assert pool._num_admitted == 0
        assert await pool.encode("v" * 20) == [20]

    asyncio.run(run())
    pool.close()


def test_a_prompt_whose_client_left_before_its_thread_began_is_dropped() -> None:
    release = threading.Event()
    recorder = ThreadRecorder(release)
    pool = TokenizePool(recorder, max_workers=1, max_waiting=4, inline_max_chars=10)

    async def run() -> None:
        first = asyncio.ensure_future(pool.encode("a" * 20))  # holds the only thread
        second = asyncio.ensure_future(pool.encode("b" * 20))  # waits for it
        await asyncio.sleep(0.05)
        second.cancel()
        await asyncio.sleep(0.05)
        assert pool._num_admitted == 1  # dropped unstarted: its slot is free at once
        release.set()
        assert await first == [20]

    asyncio.run(run())
    pool.close()
    assert len(recorder.threads) == 1  # the dropped one never ran
