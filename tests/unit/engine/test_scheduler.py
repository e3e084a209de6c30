"""Scheduler: chunked prefill, decode priority, the prefill order (shortest remaining first,
with aging), prefix reuse, preemption, modes, aborts.

`KVChecker` stands in for the model runner. It records which sequence prefix each KV slot
holds and asserts that every chunk finds its own tokens' KV at every earlier position of its
block table, so any block-table, prefix-cache or eviction mistake shows up as wrong KV.
"""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestMode, RequestStatus
from engine.schedule_output import ScheduleOutput
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig
from protocol.sampling_params import SamplingParams

BS = 4


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 97


class KVChecker:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, block_ids, start: int, tokens: list[int], end: int) -> None:
        for pos in range(start, end):
            self.slots[(block_ids[pos // BS], pos % BS)] = tuple(tokens[:pos + 1])

    def check(self, block_ids, tokens: list[int], end: int) -> None:
        for pos in range(end):
            assert self.slots.get((block_ids[pos // BS], pos % BS)) == tuple(tokens[:pos + 1]), \
                f"wrong KV at position {pos}"

    def execute(self, out: ScheduleOutput) -> dict[str, int]:
        config, pool = self.scheduler.config, self.scheduler.kv_cache.pool
        assert out.num_tokens <= config.max_num_batched_tokens
        assert len(out.chunks) <= config.max_num_seqs
        assert not {c.request_id for c in out.chunks} & set(out.preempted_request_ids)
        written = [(c.block_ids[p // BS], p % BS) for c in out.chunks
                   for p in range(c.start_pos, c.end_pos)]
        assert len(written) == len(set(written)), "two chunks write one KV slot"
        # A block being written belongs to one request; shared blocks are read-only prefixes.
        assert all(pool.refcount(block) == 1 for block, _ in written)
        sampled = {}
        for chunk in out.chunks:
            request = self.scheduler.get_request(chunk.request_id)
            tokens = request.all_token_ids
            assert chunk.token_ids == tuple(tokens[chunk.start_pos:chunk.end_pos])
            assert len(chunk.block_ids) * BS >= chunk.end_pos
            self.check(chunk.block_ids, tokens, chunk.start_pos)
            self.write(chunk.block_ids, chunk.start_pos, tokens, chunk.end_pos)
            assert chunk.sample == (chunk.end_pos == len(tokens))
            if chunk.sample:
                sampled[chunk.request_id] = next_token(tokens)
        return sampled

    def transfer(self, reservation, prompt: list[int]) -> None:
        """What a prefill peer does: fill the uncached part of a reservation."""
        self.check(reservation.block_ids, prompt, reservation.num_cached_tokens)
        self.write(reservation.block_ids, reservation.num_cached_tokens, prompt, len(prompt))


def make(num_blocks: int = 16, **config) -> tuple[Scheduler, KVChecker]:
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 16)
    scheduler = Scheduler(SchedulerConfig(**config),
                          KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BS)))
    return scheduler, KVChecker(scheduler)


def request(request_id: str, prompt, max_tokens: int = 4, priority: int = 0,
            arrival_time: float = 0.0, mode: RequestMode = RequestMode.PREFILL_AND_DECODE):
    return Request(request_id=request_id, prompt_token_ids=tuple(prompt),
                   sampling_params=SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival_time=arrival_time, mode=mode)


def step(scheduler: Scheduler, checker: KVChecker) -> ScheduleOutput:
    out = scheduler.schedule()
    scheduler.update_from_output(out, checker.execute(out))
    scheduler.check_invariants()
    return out


def run_until_idle(scheduler: Scheduler, checker: KVChecker, max_steps: int = 500) -> int:
    for num_steps in range(max_steps):
        if scheduler.num_unfinished == scheduler.num_prefilled:
            return num_steps
        step(scheduler, checker)
    raise AssertionError("requests did not finish")


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler, checker = make(max_num_batched_tokens=8)
    scheduler.add_request(request("a", range(20), max_tokens=2))
    sizes = []
    for _ in range(3):
        out = step(scheduler, checker)
        sizes.append([(len(c.token_ids), c.sample) for c in out.chunks])
    assert sizes == [[(8, False)], [(8, False)], [(4, True)]]
    assert scheduler.get_request("a").num_output_tokens == 1


def test_prefill_chunk_tokens_caps_each_request() -> None:
    scheduler, checker = make(max_num_batched_tokens=16, prefill_chunk_tokens=3)
    scheduler.add_request(request("a", range(7)))
    scheduler.add_request(request("b", range(100, 107)))
    out = step(scheduler, checker)
    assert [len(c.token_ids) for c in out.chunks] == [3, 3]


def test_a_last_prompt_chunk_of_one_token_is_the_prompts_token() -> None:
    # One token left to compute, like a decode, but it is the prompt's last: the chunk
    # carries that token (not an output's) and samples the first output token.
    scheduler, checker = make(max_num_batched_tokens=16, prefill_chunk_tokens=3)
    scheduler.add_request(request("a", range(10, 17)))
    chunks = [step(scheduler, checker).chunks for _ in range(4)]
    assert [(c.token_ids, c.start_pos, c.sample) for (c,) in chunks] == [
        ((10, 11, 12), 0, False), ((13, 14, 15), 3, False), ((16,), 6, True),
        ((next_token(list(range(10, 17))),), 7, True)]


def test_decodes_are_never_stalled_by_a_long_prompt() -> None:
    scheduler, checker = make(num_blocks=64, max_num_batched_tokens=8)
    scheduler.add_request(request("short", range(3), max_tokens=12))
    step(scheduler, checker)  # short is now decoding
    scheduler.add_request(request("long", range(100, 160), max_tokens=1))
    for _ in range(10):
        out = step(scheduler, checker)
        by_id = {c.request_id: c for c in out.chunks}
        assert len(by_id["short"].token_ids) == 1
        assert out.num_tokens <= 8
        if "long" in by_id:
            assert len(by_id["long"].token_ids) <= 7


def test_a_short_prompt_arriving_mid_prefill_gets_its_first_token_in_the_next_step() -> None:
    # The long prompt takes the whole budget; the short one, arriving between two of its
    # chunks, is computed first in the next step and the long one takes what is left.
    scheduler, checker = make(num_blocks=64, max_num_batched_tokens=16)
    scheduler.add_request(request("long", range(100, 200), mode=RequestMode.PREFILL_ONLY))
    assert [(c.request_id, len(c.token_ids)) for c in step(scheduler, checker).chunks] == [
        ("long", 16)]
    scheduler.add_request(request("short", range(5), max_tokens=3))
    out = step(scheduler, checker)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [
        ("short", 5, True), ("long", 11, False)]
    assert scheduler.get_request("short").num_output_tokens == 1
    # From then on it decodes first in every step, beside the long prompt's chunks.
    for _ in range(2):
        out = step(scheduler, checker)
        assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1),
                                                                          ("long", 15)]
    assert [r.request_id for r in scheduler.drain_finished()] == ["short"]


def test_the_prefill_order_is_shortest_remaining_first_within_a_tier_only() -> None:
    # A higher tier goes first however long its prompt; within a tier the fewest tokens left.
    scheduler, checker = make(num_blocks=64, max_num_batched_tokens=8, aging_steps=None)
    scheduler.add_request(request("long", range(100, 124), mode=RequestMode.PREFILL_ONLY))
    scheduler.add_request(request("mid", range(200, 212), mode=RequestMode.PREFILL_ONLY))
    scheduler.add_request(request("urgent-long", range(300, 316), priority=1,
                                  mode=RequestMode.PREFILL_ONLY))
    scheduler.add_request(request("short", range(4), mode=RequestMode.PREFILL_ONLY))
    order = [c.request_id for _ in range(8) for c in step(scheduler, checker).chunks]
    firsts = list(dict.fromkeys(order))
    assert firsts == ["urgent-long", "short", "mid", "long"]


@pytest.mark.parametrize("aging_tokens", [1, 4, 8, 16])
def test_a_long_prompt_under_a_stream_of_short_ones_finishes_within_the_aging_bound(
        aging_tokens) -> None:
    """Two 8-token prompts arrive every step and fill the 16-token budget: by length alone
    the 64-token prompt would never run. Passed over, it gains one step of age per step,
    and R tokens left cost it R / aging_tokens steps (engine/request_rank.py): after
    ceil(R / aging_tokens) steps it goes before every later arrival, and takes the whole
    budget until done: at most ceil(64 / aging_tokens) + ceil(64 / 16) steps in all."""
    scheduler, checker = make(num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16,
                              prefill_aging_tokens=aging_tokens)
    scheduler.add_request(request("long", range(5000, 5064), mode=RequestMode.PREFILL_ONLY))
    bound = -(-64 // aging_tokens) + 64 // 16
    for num_steps in range(1, 200):
        for j in range(2):
            first = num_steps * 20 + j * 10  # distinct prompts: no prefix-cache hits
            scheduler.add_request(request(f"s{num_steps}-{j}", range(first, first + 8),
                                          mode=RequestMode.PREFILL_ONLY))
        out = step(scheduler, checker)
        if num_steps == 1:
            assert "long" not in {c.request_id for c in out.chunks}  # the short ones first
        done = [r.request_id for r in scheduler.drain_finished()]
        for request_id in done:
            scheduler.release_prefilled(request_id)
        if "long" in done:
            break
    assert num_steps <= bound
    assert num_steps > 64 // 16  # it was passed over for a while


def test_prefix_hit_reuses_blocks_and_skips_compute() -> None:
    scheduler, checker = make()
    prompt = list(range(13))
    scheduler.add_request(request("first", prompt, max_tokens=2))
    run_until_idle(scheduler, checker)
    used_before = scheduler.kv_cache.num_used_blocks
    scheduler.add_request(request("second", prompt[:12] + [77, 78], max_tokens=2))
    out = step(scheduler, checker)
    [chunk] = out.chunks
    assert chunk.start_pos == 12 and chunk.token_ids == (77, 78)
    assert scheduler.get_request("second").num_cached_tokens == 12
    assert scheduler.kv_cache.num_used_blocks == used_before + 4  # 3 shared + 1 new


def test_two_running_requests_share_prefix_blocks() -> None:
    scheduler, checker = make(max_num_batched_tokens=16)
    scheduler.add_request(request("a", range(9), max_tokens=8))
    step(scheduler, checker)
    scheduler.add_request(request("b", list(range(8)) + [50], max_tokens=8))
    step(scheduler, checker)
    a, b = scheduler.get_request("a"), scheduler.get_request("b")
    assert a.block_ids[:2] == b.block_ids[:2]
    run_until_idle(scheduler, checker)
    assert scheduler.kv_cache.num_used_blocks == 0


def test_preemption_picks_lowest_priority_then_newest_and_victim_completes() -> None:
    # 4 blocks of 4 tokens: three 4-token prompts fill three blocks; the first decode step of
    # each needs a second block, which only one of them can get.
    scheduler, checker = make(num_blocks=4, aging_steps=None)
    scheduler.add_request(request("old_low", range(4), max_tokens=6, arrival_time=1.0))
    scheduler.add_request(request("new_low", range(10, 14), max_tokens=6, arrival_time=2.0))
    scheduler.add_request(request("high", range(20, 24), max_tokens=6, priority=1,
                                  arrival_time=3.0))
    step(scheduler, checker)  # all three prefilled
    out = step(scheduler, checker)
    assert out.preempted_request_ids == ("new_low",)
    assert scheduler.get_request("new_low").status is RequestStatus.PREEMPTED
    assert {c.request_id for c in out.chunks} == {"high", "old_low"}
    run_until_idle(scheduler, checker)
    finished = {r.request_id: r for r in scheduler.drain_finished()}
    assert set(finished) == {"old_low", "new_low", "high"}
    for r in finished.values():
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6
    assert finished["new_low"].num_preemptions >= 1
    assert finished["high"].num_preemptions == 0
    # Recompute gives the same continuation: the victim's output is what it would have been.
    tokens = list(range(10, 14))
    for _ in range(6):
        tokens.append(next_token(tokens))
    assert finished["new_low"].output_token_ids == tokens[4:]
    assert scheduler.kv_cache.num_used_blocks == 0


def test_preempted_decode_loses_its_chunk_to_a_higher_priority_prefill() -> None:
    # Decodes are scheduled first, so the low-priority decode already has a chunk when the
    # high-priority prefill runs out of blocks and preempts it: that chunk must be withdrawn.
    scheduler, checker = make(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8,
                              prefill_chunk_tokens=4, aging_steps=None)
    scheduler.add_request(request("low", range(3), max_tokens=20))
    step(scheduler, checker)
    scheduler.add_request(request("high", range(100, 112), max_tokens=2, priority=1))
    step(scheduler, checker)
    step(scheduler, checker)
    out = step(scheduler, checker)
    assert out.preempted_request_ids == ("low",)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("high", 4)]
    run_until_idle(scheduler, checker)
    assert {r.request_id for r in scheduler.drain_finished()} == {"low", "high"}


def _abort_and_check(scheduler: Scheduler, request_id: str) -> None:
    kv = scheduler.kv_cache
    held = set(scheduler.get_request(request_id).block_ids)
    others = {b for rid in kv.request_ids() if rid != request_id for b in kv.block_table(rid)}
    used = kv.num_used_blocks
    aborted = scheduler.abort_request(request_id)
    assert aborted.status is RequestStatus.FINISHED_ABORTED and aborted.block_ids == ()
    assert kv.num_used_blocks == used - len(held - others)
    assert not kv.holds_blocks(request_id)
    assert scheduler.abort_request(request_id) is None
    scheduler.check_invariants()


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted",
                                   "prefilled", "between_schedule_and_update"])
def test_abort_in_every_state_frees_exactly_its_blocks(state: str) -> None:
    scheduler, checker = make(num_blocks=4 if state == "preempted" else 8,
                              max_num_batched_tokens=8, aging_steps=None)
    mode = RequestMode.PREFILL_ONLY if state == "prefilled" else RequestMode.PREFILL_AND_DECODE
    scheduler.add_request(request("other", range(3), max_tokens=20, priority=1))
    if state == "preempted":
        scheduler.add_request(request("x", range(50, 54), max_tokens=20))
        scheduler.add_request(request("filler", range(60, 68), max_tokens=20, priority=1))
        for _ in range(10):
            if scheduler.get_request("x").status is RequestStatus.PREEMPTED:
                break
            step(scheduler, checker)
    else:
        scheduler.add_request(request("x", range(50, 62), max_tokens=20, mode=mode))
        num_steps = {"waiting": 0, "prefilling": 1, "decoding": 3, "prefilled": 3,
                     "between_schedule_and_update": 1}[state]
        for _ in range(num_steps):
            step(scheduler, checker)
    expected = {"waiting": RequestStatus.WAITING, "prefilling": RequestStatus.RUNNING,
                "decoding": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED,
                "prefilled": RequestStatus.PREFILLED,
                "between_schedule_and_update": RequestStatus.RUNNING}[state]
    assert scheduler.get_request("x").status is expected
    if state == "between_schedule_and_update":
        out = scheduler.schedule()
        sampled = checker.execute(out)
        _abort_and_check(scheduler, "x")
        scheduler.update_from_output(out, sampled)  # the aborted chunk is skipped
    else:
        _abort_and_check(scheduler, "x")
    run_until_idle(scheduler, checker)
    assert scheduler.kv_cache.num_used_blocks == 0


def test_prefill_only_holds_blocks_until_released() -> None:
    scheduler, checker = make()
    prompt = list(range(10))
    scheduler.add_request(request("p", prompt, max_tokens=50, mode=RequestMode.PREFILL_ONLY))
    step(scheduler, checker)
    [done] = scheduler.drain_finished()
    assert done.status is RequestStatus.PREFILLED
    assert done.output_token_ids == [next_token(prompt)]
    assert scheduler.kv_cache.num_used_blocks == 3
    for _ in range(3):
        assert scheduler.schedule().is_empty  # parked: nothing more to compute
    released = scheduler.release_prefilled("p")
    assert released is done and scheduler.kv_cache.num_used_blocks == 0
    assert scheduler.get_request("p") is None
    assert scheduler.kv_cache.find_cached_prefix(prompt).num_cached_tokens == 8
    scheduler.check_invariants()


def test_decode_only_starts_decoding_at_once() -> None:
    scheduler, checker = make()
    prompt = list(range(9))
    first = next_token(prompt)
    reservation = scheduler.kv_cache.reserve("d", prompt)
    checker.transfer(reservation, prompt)
    scheduler.add_decode_request(
        request("d", prompt, max_tokens=5, mode=RequestMode.DECODE_ONLY), first)
    scheduler.check_invariants()
    out = step(scheduler, checker)
    [chunk] = out.chunks
    assert (chunk.start_pos, chunk.token_ids, chunk.sample) == (9, (first,), True)
    run_until_idle(scheduler, checker)
    [done] = scheduler.drain_finished()
    assert done.status is RequestStatus.FINISHED_LENGTH
    assert done.num_output_tokens == 5 and done.output_token_ids[0] == first
    assert scheduler.kv_cache.num_used_blocks == 0


def test_decode_only_with_one_token_ends_at_join() -> None:
    scheduler, _ = make()
    scheduler.kv_cache.reserve("d", [1, 2, 3])
    scheduler.add_decode_request(request("d", [1, 2, 3], max_tokens=1,
                                         mode=RequestMode.DECODE_ONLY), 9)
    [done] = scheduler.drain_finished()
    assert done.status is RequestStatus.FINISHED_LENGTH
    assert scheduler.kv_cache.num_used_blocks == 0


def test_request_that_cannot_fit_the_pool_ends_instead_of_looping() -> None:
    scheduler, checker = make(num_blocks=3)
    scheduler.add_request(request("huge", range(13)))
    [rejected] = scheduler.drain_finished()
    assert rejected.status is RequestStatus.FINISHED_ERROR
    scheduler.add_request(request("grows", range(10), max_tokens=10))
    run_until_idle(scheduler, checker, max_steps=20)
    [cut] = scheduler.drain_finished()
    assert cut.status is RequestStatus.FINISHED_LENGTH
    assert cut.num_output_tokens == 3  # 12 positions fit; the 13th does not
    assert scheduler.kv_cache.num_used_blocks == 0


def test_finish_request_for_engine_decided_stops() -> None:
    scheduler, checker = make()
    scheduler.add_request(request("a", range(5), max_tokens=100))
    step(scheduler, checker)
    stopped = scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert stopped.status is RequestStatus.FINISHED_STOPPED
    assert scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED) is None
    assert scheduler.drain_finished() == []  # the caller already knows
    assert scheduler.kv_cache.num_used_blocks == 0
    with pytest.raises(ValueError):
        scheduler.finish_request("a", RequestStatus.RUNNING)


def test_schedule_and_update_must_alternate() -> None:
    scheduler, checker = make()
    scheduler.add_request(request("a", range(5)))
    out = scheduler.schedule()
    with pytest.raises(RuntimeError):
        scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update_from_output(out, {})  # the sampled token is missing
    scheduler.check_invariants()


@pytest.mark.parametrize("aging_steps", [2, None])
def test_aging_lets_low_priority_through_a_stream_of_high_priority(aging_steps) -> None:
    scheduler, checker = make(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=4,
                              aging_steps=aging_steps)
    scheduler.add_request(request("low", range(4), max_tokens=2, priority=0))
    for i in range(40):
        scheduler.add_request(request(f"high{i}", range(100 + i, 104 + i), max_tokens=2,
                                      priority=5))
        step(scheduler, checker)
    low = scheduler.get_request("low")
    if aging_steps is None:
        assert low.status is RequestStatus.WAITING  # strict priority starves it
    else:
        assert low is None or low.is_finished


def test_steps_that_run_nothing_age_no_one() -> None:
    # "held" keeps the whole pool (prefilled, not yet released), so "old" cannot be admitted
    # and every schedule() is empty. Aging counts steps that ran: "new", one priority level
    # up and arriving after ten empty schedules, has lost nothing to "old" and goes first.
    scheduler, checker = make(num_blocks=4, max_num_seqs=2, aging_steps=2,
                              prefill_aging_tokens=None)
    scheduler.add_request(request("held", range(100, 116), max_tokens=1,
                                  mode=RequestMode.PREFILL_ONLY))
    run_until_idle(scheduler, checker)
    scheduler.add_request(request("old", range(4), max_tokens=1))
    for _ in range(10):
        assert scheduler.schedule().is_empty
    scheduler.add_request(request("new", range(200, 204), max_tokens=1, priority=1))
    scheduler.release_prefilled("held")
    out = scheduler.schedule()
    assert [c.request_id for c in out.chunks][0] == "new"


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError):
        SchedulerConfig(prefill_chunk_tokens=0)
    with pytest.raises(ValueError):
        SchedulerConfig(aging_steps=0)
    with pytest.raises(ValueError):
        SchedulerConfig(prefill_aging_tokens=0)


# ---- property test: random traffic on small pools ------------------------------------------

from hypothesis import event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

# Prompts grow from a few shared stems, so prefix hits, sharing and eviction all happen.
STEMS = [list(range(s * 100, s * 100 + 30)) for s in range(3)]
MAX_DRAIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 16), max_num_seqs=st.integers(1, 4),
                extra_budget=st.integers(0, 10),
                prefill_chunk_tokens=st.one_of(st.none(), st.integers(1, 6)),
                aging_steps=st.sampled_from([None, 1, 5]),
                prefill_aging_tokens=st.sampled_from([None, 1, 4, 256]))
    def setup(self, num_blocks, max_num_seqs, extra_budget, prefill_chunk_tokens, aging_steps,
              prefill_aging_tokens):
        self.scheduler, self.checker = make(
            num_blocks=num_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            prefill_chunk_tokens=prefill_chunk_tokens, aging_steps=aging_steps,
            prefill_aging_tokens=prefill_aging_tokens)
        self.ids: list[str] = []
        self.reservations: list[str] = []

    def _prompt(self, data) -> list[int]:
        stem = data.draw(st.sampled_from(STEMS))
        tail = data.draw(st.lists(st.integers(0, 9), max_size=5))
        return stem[:data.draw(st.integers(1, 16))] + tail

    def _live(self, data, statuses) -> str | None:
        ids = [i for i in self.ids if (r := self.scheduler.get_request(i)) is not None
               and r.status in statuses]
        return data.draw(st.sampled_from(ids)) if ids else None

    @rule(data=st.data(), priority=st.integers(0, 2), max_tokens=st.integers(1, 12),
          mode=st.sampled_from([RequestMode.PREFILL_AND_DECODE, RequestMode.PREFILL_ONLY]))
    def arrive(self, data, priority, max_tokens, mode):
        request_id = f"r{len(self.ids)}"
        self.ids.append(request_id)
        self.scheduler.add_request(request(request_id, self._prompt(data), max_tokens,
                                           priority, mode=mode))

    @rule(data=st.data(), max_tokens=st.integers(1, 6), join=st.booleans())
    def arrive_by_transfer(self, data, max_tokens, join):
        prompt = self._prompt(data)
        request_id = f"r{len(self.ids)}"
        kv = self.scheduler.kv_cache
        if not kv.can_reserve(prompt):
            return
        self.ids.append(request_id)
        reservation = kv.reserve(request_id, prompt)
        self.checker.transfer(reservation, prompt)
        if not join:  # transfer still in flight; released later
            self.reservations.append(request_id)
            return
        self.scheduler.add_decode_request(
            request(request_id, prompt, max_tokens, mode=RequestMode.DECODE_ONLY),
            next_token(prompt))

    @rule()
    def step(self):
        self._step()

    def _step(self):
        out = step(self.scheduler, self.checker)
        if out.preempted_request_ids:
            event("preemption")
        if any(c.start_pos > 0 and c.start_pos == self.scheduler.get_request(c.request_id)
               .num_cached_tokens for c in out.chunks if self.scheduler.get_request(c.request_id)):
            event("prefix hit")
        for finished in self.scheduler.drain_finished():
            event(f"ended {finished.status.value}")

    @rule(data=st.data())
    def abort_mid_step(self, data):
        out = self.scheduler.schedule()
        sampled = self.checker.execute(out)
        if out.chunks:
            victim = data.draw(st.sampled_from([c.request_id for c in out.chunks]))
            self.scheduler.abort_request(victim)
        self.scheduler.update_from_output(out, sampled)

    @rule(data=st.data())
    def abort(self, data):
        request_id = self._live(data, set(RequestStatus))
        if request_id is not None:
            assert self.scheduler.abort_request(request_id) is not None

    @rule(data=st.data())
    def stop(self, data):
        request_id = self._live(data, {RequestStatus.RUNNING})
        if request_id is not None:
            self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)

    @rule(data=st.data())
    def release(self, data):
        request_id = self._live(data, {RequestStatus.PREFILLED})
        if request_id is not None:
            self.scheduler.release_prefilled(request_id)

    @rule(data=st.data())
    def release_reservation(self, data):
        if not self.reservations:
            return
        request_id = data.draw(st.sampled_from(self.reservations))
        self.reservations.remove(request_id)
        self.scheduler.kv_cache.release(request_id)

    @invariant()
    def consistent(self):
        if hasattr(self, "scheduler"):
            self.scheduler.check_invariants()

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler, kv = self.scheduler, self.scheduler.kv_cache
        for request_id in self.reservations:
            kv.release(request_id)
        # Arrivals have stopped: every request must end within a bounded number of steps.
        for _ in range(MAX_DRAIN_STEPS):
            for request_id in [i for i in self.ids if (r := scheduler.get_request(i))
                               and r.status is RequestStatus.PREFILLED]:
                scheduler.release_prefilled(request_id)
            if scheduler.num_unfinished == 0:
                break
            self._step()
        else:
            raise AssertionError(f"{scheduler.num_unfinished} requests never finished")
        assert kv.num_used_blocks == 0 and not kv.request_ids()
        assert kv.num_free_blocks == kv.num_blocks
        scheduler.check_invariants()


SchedulerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                              deadline=None)
test_random_traffic_keeps_invariants_and_always_drains = SchedulerMachine.TestCase


def test_the_wait_for_admission_is_stamped_once_and_kept_through_preemption() -> None:
    scheduler, checker = make(num_blocks=4, aging_steps=None, max_num_seqs=3)
    now = [5.0]
    scheduler.clock = lambda: now[0]
    scheduler.add_request(request("old_low", range(4), max_tokens=6, arrival_time=1.0))
    scheduler.add_request(request("new_low", range(10, 14), max_tokens=6, arrival_time=2.0))
    scheduler.add_request(request("high", range(20, 24), max_tokens=6, priority=1,
                                  arrival_time=3.0))
    waiting = request("later", range(30, 34), arrival_time=4.0)
    scheduler.add_request(waiting)
    step(scheduler, checker)  # the first three admitted at 5.0; no seat left for `later`
    assert waiting.queued_s is None
    assert [scheduler.get_request(r).queued_s for r in ("old_low", "new_low", "high")] == \
        [4.0, 3.0, 2.0]
    now[0] = 9.0
    out = step(scheduler, checker)
    assert out.preempted_request_ids == ("new_low",)
    run_until_idle(scheduler, checker)
    finished = {r.request_id: r for r in scheduler.drain_finished()}
    assert finished["new_low"].num_preemptions >= 1
    assert finished["new_low"].queued_s == 3.0  # its first admission, not its return
    assert finished["later"].queued_s == 5.0
