"""The scheduler over a KV cache with a host tier, under random traffic (the scheduler's own
state machine, tests/unit/engine/test_scheduler.py, with a tiny host tier beside its tiny
pool).

The copier moves the `KVChecker`'s record of what each slot holds, as the real copier moves
tensors: a block offloaded after it was overwritten, reloaded into the wrong block, or
reloaded from a slot that was reused, makes a later chunk find the wrong prefix's KV.
Copies may stay in flight for a while (as on CUDA), so slots in flight are exercised too, and
then blocks are copied ahead of eviction, when they become cached-free (as on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_scheduler import BS, KVChecker, SchedulerMachine, request, step

from engine.block_pool import BlockPool
from engine.host_kv_tier import HostKVTier
from engine.kv_cache import KVCacheManager
from engine.scheduler import Scheduler
from engine.scheduler_config import SchedulerConfig

Slots = dict[tuple[int, int], tuple[int, ...]]


class Done:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class CheckerCopier:
    """Copies a block's slot records between the checker's pool and host slots."""

    def __init__(self, in_flight: bool) -> None:
        self.in_flight = in_flight
        self.asynchronous = in_flight
        self.slots: Slots = {}  # the checker's, set once it exists
        self.host: dict[int, dict[int, tuple[int, ...] | None]] = {}
        self.pending: list[Done] = []

    def _done(self) -> Done | None:
        if not self.in_flight:
            return None
        self.pending.append(done := Done())
        return done

    def to_host(self, block_id: int, host_slot: int, before_writes: bool) -> Done | None:
        self.host[host_slot] = {s: self.slots.get((block_id, s)) for s in range(BS)}
        return self._done()

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[Done]) -> Done | None:
        for host_slot, block_id in copies:
            for s, held in self.host[host_slot].items():
                if held is None:
                    self.slots.pop((block_id, s), None)
                else:
                    self.slots[(block_id, s)] = held
        return self._done()

    def order_writes_after(self, done: Done) -> None:
        pass  # the records moved when the copy was asked for


def make_tiered(num_blocks: int, num_host_blocks: int, in_flight: bool, **config
                ) -> tuple[Scheduler, KVChecker, CheckerCopier]:
    copier = CheckerCopier(in_flight)
    kv = KVCacheManager(BlockPool(num_blocks=num_blocks, block_size=BS),
                        HostKVTier(num_host_blocks, copier, block_bytes=1))
    scheduler = Scheduler(SchedulerConfig(**config), kv)
    checker = KVChecker(scheduler)
    copier.slots = checker.slots
    return scheduler, checker, copier


def test_a_prefix_evicted_then_reloaded_holds_its_own_kv() -> None:
    scheduler, checker, _ = make_tiered(4, 4, False, max_num_seqs=2, max_num_batched_tokens=16)
    for request_id, prompt in (("a", range(13)), ("b", range(50, 63)), ("c", range(14))):
        scheduler.add_request(request(request_id, prompt, max_tokens=1))
        while scheduler.num_unfinished:
            step(scheduler, checker)  # checks every chunk's KV (reloaded blocks included)
    c = scheduler.kv_cache.host_tier.stats()  # type: ignore[union-attr]
    assert c.num_hit_blocks == 3  # c's first three blocks, a's, came back from the host


class TieredSchedulerMachine(SchedulerMachine):
    @initialize(num_blocks=st.integers(3, 10), num_host_blocks=st.integers(1, 6),
                in_flight=st.booleans(), max_num_seqs=st.integers(1, 4),
                extra_budget=st.integers(0, 10),
                prefill_chunk_tokens=st.one_of(st.none(), st.integers(1, 6)))
    def setup(self, num_blocks, num_host_blocks, in_flight, max_num_seqs, extra_budget,
              prefill_chunk_tokens):
        self.scheduler, self.checker, self.copier = make_tiered(
            num_blocks, num_host_blocks, in_flight, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + extra_budget,
            prefill_chunk_tokens=prefill_chunk_tokens)
        self.ids: list[str] = []
        self.reservations: list[str] = []

    @rule(data=st.data())
    def copies_complete(self, data):
        for done in self.copier.pending:
            done.done = done.done or data.draw(st.booleans())
        self.copier.pending = [d for d in self.copier.pending if not d.done]

    def _step(self):
        super()._step()
        stats = self.scheduler.kv_cache.host_tier.stats()
        if stats.num_hit_blocks:
            event("host hit")
        if stats.num_dropped_blocks:
            event("dropped: every host slot busy")

    def teardown(self):
        super().teardown()
        if hasattr(self, "scheduler"):
            tier = self.scheduler.kv_cache.host_tier
            tier.check_invariants()
            assert tier.num_held_blocks <= tier.num_host_blocks
            assert not tier._pins, "a host block pinned by an admission was never reloaded"


TieredSchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                    deadline=None)
test_random_traffic_with_a_host_tier_keeps_kv_right = TieredSchedulerMachine.TestCase
