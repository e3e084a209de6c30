"""No head-of-line blocking on `pdserve up` (CPU, 1 prefill + 1 decode worker as in the
report, and the default layout; the default model and step mode): short prompts sent while a
~5,000-token prompt is being prefilled get their first token within twice their time to first
token alone or a quarter of one prefill chunk more (the median; the slowest within the noise
measured alone).

Before, a short prompt split onto the prefill worker behind the long one waited for its
whole prefill (tens of seconds on a CPU): the router planned on a load report that did not
show the long prompt yet, and the engine served prompts in arrival order. Now the router
counts what it routed and has not seen prefilled (gateway/upstream/routed_prefills.py), so
a short prompt is prefilled by the idle decode worker, and the engine computes a shorter
prompt first in its next step wherever it lands (engine/request_rank.py). As in the report,
the cluster is fresh: the prefill worker has not fitted a step model yet (16 steps), so the
token-cost rule routes (gateway/routing/router.py).

What is compared is the wait in the serving system, not the machine's two cores being
shared: while it prefills, the prefill worker keeps one core busy (its engine thread), so
the reference TTFT "alone" is measured with a process keeping one core busy the same way
(`_one_core_busy`; the idle-machine TTFT is printed beside it). Behind the long prompt in
arrival order a short one waited for its whole prefill, tens of seconds: the bound of
twice the TTFT alone fails by two orders of magnitude.

Its own cluster: test_up_openai.py's runs overlapped steps, which on a CPU hold a local
prefill's first token until a second step is computed, and so would compare one step alone
with two behind. The operations agent's hung threshold is raised for this cluster: one
512-token chunk of the long prompt can take over its 3 s default on a shared 2-core
machine, and the agent would then kill the busy prefill worker as hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from up_process import HANDOFF_TIER, UpProcess

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORDS = ("apple", "pear", "plum", "fig", "cherry", "lemon", "melon", "grape")
LONG_PROMPT = "Here is a long list: " + " ".join(f"{WORDS[i % 8]} {i}" for i in range(1000))
LONG_PROMPT_TOKENS = 5021  # of the default model
SHORT_PROMPT = "The capital of France is"  # 5 tokens


# The layout of the report (1 prefill + 1 decode) and the one `pdserve up` starts on a CPU
# without role options (two workers that each prefill and decode).
LAYOUTS = {"1 prefill + 1 decode": ("--prefill", "1", "--decode", "1"), "default": ()}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def up(request, tmp_path_factory):
    tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
    tiers.write_text(HANDOFF_TIER)  # the shipped tiers, plus one that hands every prompt off
    process = UpProcess(*LAYOUTS[request.param], "--tiers", str(tiers),
                        log_dir=tmp_path_factory.mktemp("up-logs"),
                        env={"PDSERVE_HUNG_AFTER_S": "60"})
    yield process
    process.stop()


def test_a_short_prompt_does_not_wait_behind_a_long_one(up: UpProcess) -> None:
    asyncio.run(_head_of_line(up))


async def _head_of_line(up: UpProcess) -> None:
    client = openai.AsyncOpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    model = (await client.models.list()).data[0].id

    async def ttft_s(prompt: str, max_tokens: int = 6, tier: str | None = None,
                     first_at: list[float] | None = None) -> float:
        started = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"x-pdserve-tier": tier} if tier else None)
        first: float | None = None
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter()
                if first_at is not None:
                    first_at.append(first)
        assert first is not None
        return first - started

    long: asyncio.Task[float] | None = None
    try:
        await ttft_s(SHORT_PROMPT)  # the first request of a fresh cluster warms it
        idle_s = [await ttft_s(SHORT_PROMPT) for _ in range(3)]
        with _one_core_busy():
            alone_s = [await ttft_s(SHORT_PROMPT) for _ in range(5)]
        long_first_at: list[float] = []
        # The handoff tier puts the long prompt on the prefill worker, as in the report.
        long = asyncio.create_task(ttft_s(LONG_PROMPT, max_tokens=2, tier="handoff",
                                          first_at=long_first_at))
        await _until_prefilling(up, long, long_first_at)
        queued_before = (time.perf_counter(), await asyncio.to_thread(_queued_prefill, up))
        behind_s = [await ttft_s(SHORT_PROMPT) for _ in range(6)]
        behind_done_at = time.perf_counter()
        queued_after = (behind_done_at, await asyncio.to_thread(_queued_prefill, up))
        long.cancel()  # the client hangs up: the gateway aborts it on both workers
        await asyncio.gather(long, return_exceptions=True)
        await asyncio.to_thread(_until_nothing_held, up)
        # Alone again: the machine's other load drifts, so the reference spans both sides.
        with _one_core_busy():
            alone_s += [await ttft_s(SHORT_PROMPT) for _ in range(5)]
    finally:
        if long is not None and not long.done():
            long.cancel()
            await asyncio.gather(long, return_exceptions=True)
        await client.close()
    alone_median_s = statistics.median(alone_s)
    # One 512-token chunk of the long prompt, as it progressed while the short ones ran.
    computed = queued_before[1] - queued_after[1]
    chunk_s = 512 * (queued_after[0] - queued_before[0]) / computed if computed > 0 else 0.0
    print(f"TTFT of {SHORT_PROMPT!r}: {alone_median_s * 1000:.0f} ms alone with one core busy "
          f"(median of {[round(s * 1000) for s in alone_s]}; idle machine: "
          f"{[round(s * 1000) for s in idle_s]}), {[round(s * 1000) for s in behind_s]} ms "
          f"behind a 5,021-token prompt (a 512-token chunk: {chunk_s * 1000:.0f} ms); "
          f"plans: {_plans(up)}")
    # The machine's other load (a test run in parallel) moves single samples by 2x either way;
    # a short prompt behind the long one waits for a whole 512-token chunk at least (about 1 s
    # on a 2-core machine) and waited for its whole prefill before the fix (tens of seconds).
    # So the typical short prompt keeps within twice the typical one alone or a quarter of a
    # chunk over it (the other test's load alone once took it to 2.2x), and the worst within
    # half a chunk of it, and within the noise seen alone.
    median_bound_s = max(2 * alone_median_s, alone_median_s + chunk_s / 4)
    bound_s = max(2 * alone_median_s, 1.5 * max(alone_s), alone_median_s + chunk_s / 2)
    detail = (f"TTFT {behind_s} s against {alone_s} s alone; a chunk {chunk_s:.3f} s; "
              f"plans: {_plans(up)}; missed: {_missed(up)}")
    assert statistics.median(behind_s) <= median_bound_s, \
        f"short prompts waited behind a long one ({median_bound_s:.3f} s allowed): {detail}"
    assert max(behind_s) <= bound_s, \
        f"a short prompt waited behind a long one ({bound_s:.3f} s allowed): {detail}"
    assert not long_first_at or long_first_at[0] > behind_done_at, \
        "the long prompt was done before the short ones: nothing was behind it"


@contextlib.contextmanager
def _one_core_busy() -> Iterator[None]:
    """A process keeping one core busy, as a prefill worker's engine thread does."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        burner.kill()
        burner.wait()


async def _until_prefilling(up: UpProcess, long: asyncio.Task[float], long_first_at: list[float],
                            timeout_s: float = 60.0) -> None:
    """Until a worker that prefills reports the long prompt partly computed: mid-prefill, past
    the moment it arrived (its tokenizing, routing, reservation and first KV link)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not long.done():
        assert not long_first_at, "the long prompt's prefill ended before it was seen under way"
        workers = await asyncio.to_thread(up.workers)
        if any(w["role"] != "decode" and 0 < (w.get("load") or {}).get(
                "num_queued_prefill_tokens", 0) < LONG_PROMPT_TOKENS for w in workers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no worker ever reported the long prompt mid-prefill")


def _queued_prefill(up: UpProcess) -> int:
    """Prompt tokens the workers that prefill have left to compute (the long prompt's)."""
    return max((w.get("load") or {}).get("num_queued_prefill_tokens", 0)
               for w in up.workers() if w["role"] != "decode")


def _until_nothing_held(up: UpProcess, timeout_s: float = 60.0) -> None:
    """Until the aborted long prompt has left both workers (their own /admin/state)."""
    urls = [w["control_url"] + "/admin/state" for w in up.workers()]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [up.internal_get(url) for url in urls]
        if not any(s["num_held_tables"] + s["num_running"] + s["num_waiting"] for s in states):
            return
        time.sleep(0.1)
    raise AssertionError(f"the aborted prompt still holds KV: {states}")


def _missed(up: UpProcess) -> list[object]:
    """The cluster page's requests that missed their targets, with their stages and routes."""
    url = f"{up.url}/admin/cluster"
    return json.loads(urllib.request.urlopen(url, timeout=5).read())["recent"][:4]


def _plans(up: UpProcess) -> list[str]:
    text = urllib.request.urlopen(f"{up.url}/metrics", timeout=5).read().decode()
    return [line for line in text.splitlines() if line.startswith("pdserve_gateway_plans_total")]
