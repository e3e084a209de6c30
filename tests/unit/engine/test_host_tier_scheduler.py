"""The scheduler over a KV cache with a host tier, under random traffic (the scheduler's own
state machine, tests/unit/engine/test_scheduler.py, with a tiny host tier beside its tiny
pool).

The copier moves the `KVChecker`'s record of what each slot holds, as the real copier moves
tensors: a block offloaded after it was overwritten, reloaded into the wrong block, or
reloaded from a slot that was reused, makes a later chunk find the wrong prefix's KV.
Copies may stay in flight for a while (as on CUDA), so slots in flight are exercised too, and
then blocks are copied ahead of eviction, when they become cached-free (as on CUDA). A reload
in flight lands its records only when it is done (or when the engine's next work is ordered
after it): a chunk scheduled before then, of the reloading request or of one sharing its
blocks, reads KV that is not there yet.
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
    """A copy in flight; `land` (a reload's) runs when it is done."""

    def __init__(self, land=None) -> None:
        self.done = False
        self.land = land

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if not self.done and self.land is not None:
            self.land()
        self.done = True


class CheckerCopier:
    """Copies a block's slot records between the checker's pool and host slots."""

    def __init__(self, in_flight: bool) -> None:
        self.in_flight = in_flight
        self.asynchronous = in_flight
        self.slots: Slots = {}  # the checker's, set once it exists
        self.host: dict[int, dict[int, tuple[int, ...] | None]] = {}
        self.pending: list[Done] = []

    def _done(self, land=None) -> Done | None:
        if not self.in_flight:
            if land is not None:
                land()
            return None
        self.pending.append(done := Done(land))
        return done

    def to_host(self, copies: Sequence[tuple[int, int]], before_writes: bool) -> Done | None:
        for block_id, host_slot in copies:
            self.host[host_slot] = {s: self.slots.get((block_id, s)) for s in range(BS)}
        return self._done()

    def to_device(self, copies: Sequence[tuple[int, int]],
                  after: Sequence[Done]) -> Done | None:
        for host_slot, block_id in copies:  # until it lands, the blocks hold nothing known
            for s in range(BS):
                self.slots.pop((block_id, s), None)

        def land() -> None:
            for host_slot, block_id in copies:
                for s, held in self.host[host_slot].items():
                    if held is None:
                        self.slots.pop((block_id, s), None)
                    else:
                        self.slots[(block_id, s)] = held
        return self._done(land)

    def order_writes_after(self, done: Done) -> None:
        done.synchronize()  # what the engine queues next runs after the copy


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
            if data.draw(st.booleans()):
                done.synchronize()
        self.copier.pending = [d for d in self.copier.pending if not d.done]

    def _step(self):
        kv = self.scheduler.kv_cache
        super()._step()
        if kv.loading_ids:
            event("a request held back by its reload")
        if not self.scheduler.num_running - len(kv.loading_ids) and kv.wait_for_a_load():
            event("nothing else to run: waited for a reload")  # as the engine does
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
