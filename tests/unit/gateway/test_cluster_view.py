"""The gateway's cluster view without Redis: a scripted registry behind RedisState's reads.

What is checked: a worker marked unreachable leaves routing at once and comes back when it
registers with a new epoch (or the mark lapses); excluded workers are skipped for one
request only; an empty registry right after a full one (Redis restarted) keeps the last
snapshot for the grace period, and workers not back yet are kept while the others
re-register (or after Redis was unreachable), but not when one leaves while Redis answers;
the largest decoding KV pool bounds the context; a prompt planned with a request id counts
in its prefill worker's queue across polls until it is settled.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.routing.router import NoWorkers, RoutePlan
from gateway.upstream.cluster import ClusterView, lapsed_since, purgeable
from protocol.block_hashes import host_tier_hash
from protocol.messages import Role, WorkerInfo
from state.redis_state import Registry


class Index:
    holders: dict = {}


class Mirror:
    index = Index()


class ScriptedState:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}

    async def read_registry(self, timeout_s: float | None = None) -> Registry:
        return Registry(registered_ids=sorted(self.workers), workers=dict(self.workers),
                        loads={})


def info(worker_id: str, role: Role, epoch: int = 1, blocks: int = 100) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model="m", control_url="http://x",
                      num_kv_blocks=blocks, block_size=16, epoch=epoch)


@pytest.fixture
def view() -> tuple[ClusterView, ScriptedState]:
    state = ScriptedState()
    return ClusterView(state, Mirror(), random.Random(0), vanish_grace_s=0.5), state  # type: ignore[arg-type]


def plan(view: ClusterView, exclude: dict[str, int] | None = None) -> RoutePlan | NoWorkers:
    return view.plan(100, [], local_prefill=True, exclude=exclude)


def test_unreachable_workers_leave_routing_until_they_register_again(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    assert cluster.mark_unreachable("d0") and not cluster.mark_unreachable("d0")
    assert {plan(cluster).decode_worker_id for _ in range(20)} == {"d1"}
    assert cluster.num_decode_workers() == 1
    asyncio.run(cluster.poll())  # same epoch: still out
    assert {plan(cluster).decode_worker_id for _ in range(20)} == {"d1"}
    state.workers["d0"] = info("d0", Role.DECODE, epoch=2)  # restarted
    asyncio.run(cluster.poll())
    assert {plan(cluster).decode_worker_id for _ in range(40)} == {"d0", "d1"}
    assert not cluster.mark_unreachable("nobody")


def test_an_unreachable_mark_lapses(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE)}
    asyncio.run(cluster.poll())
    cluster.mark_unreachable("d0", for_s=0.05)
    assert isinstance(plan(cluster), NoWorkers)
    asyncio.run(asyncio.sleep(0.06))
    assert plan(cluster).decode_worker_id == "d0"


def test_exclusion_is_per_request(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    assert {plan(cluster, {"d0": 1}).decode_worker_id for _ in range(20)} == {"d1"}
    assert isinstance(plan(cluster, {"d0": 1, "d1": 1}), NoWorkers)
    assert {plan(cluster).decode_worker_id for _ in range(40)} == {"d0", "d1"}


def test_a_worker_restarted_since_it_failed_a_request_may_serve_it_again(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE)}
    asyncio.run(cluster.poll())
    assert cluster.epoch_of("d0") == 1 and cluster.epoch_of("nobody") is None
    assert isinstance(plan(cluster, {"d0": 1}), NoWorkers)
    state.workers["d0"] = info("d0", Role.DECODE, epoch=2)
    asyncio.run(cluster.poll())
    assert plan(cluster, {"d0": 1}).decode_worker_id == "d0"


def test_a_registry_emptied_by_a_redis_restart_keeps_the_last_snapshot_for_a_while(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE)}
    asyncio.run(cluster.poll())
    state.workers = {}  # Redis restarted empty; the worker has not republished yet
    asyncio.run(cluster.poll())
    assert plan(cluster).decode_worker_id == "d0" and cluster.num_decode_workers() == 1
    asyncio.run(asyncio.sleep(0.6))  # past the grace: the workers are really gone
    asyncio.run(cluster.poll())
    assert isinstance(plan(cluster), NoWorkers)


def test_workers_coming_back_one_by_one_after_a_restart_keep_the_others(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    state.workers = {}  # Redis restarted empty
    asyncio.run(cluster.poll())
    state.workers = {"d1": info("d1", Role.DECODE)}  # d1 republished first
    asyncio.run(cluster.poll())
    assert {plan(cluster).decode_worker_id for _ in range(30)} == {"d0", "d1"}
    assert cluster.num_decode_workers() == 2 and "d0" in cluster.workers
    cluster.check_invariants()
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())  # every worker is back: the window ends
    state.workers = {"d1": info("d1", Role.DECODE)}  # d0 leaves for real (deregistered)
    asyncio.run(cluster.poll())
    assert {plan(cluster).decode_worker_id for _ in range(10)} == {"d1"}


def test_after_redis_was_unreachable_a_worker_not_back_is_kept_for_the_grace(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    cluster.redis_connected = False  # as the poll loop marks a failed read
    state.workers = {"d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    assert cluster.num_decode_workers() == 2
    asyncio.run(asyncio.sleep(0.6))  # past the grace: d0 did not come back, it is gone
    asyncio.run(cluster.poll())
    assert {plan(cluster).decode_worker_id for _ in range(10)} == {"d1"}
    assert "d0" not in cluster.workers


def test_a_worker_leaving_while_redis_answers_leaves_at_once(view) -> None:
    cluster, state = view
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    state.workers = {"d1": info("d1", Role.DECODE)}
    asyncio.run(cluster.poll())
    assert cluster.num_decode_workers() == 1 and "d0" not in cluster.workers


def test_the_largest_decoding_pool_bounds_the_context(view) -> None:
    cluster, state = view
    assert cluster.max_kv_tokens() is None
    state.workers = {"p0": info("p0", Role.PREFILL, blocks=1000),
                     "d0": info("d0", Role.DECODE, blocks=10),
                     "c0": info("c0", Role.COLOCATED, blocks=30)}
    asyncio.run(cluster.poll())
    assert cluster.max_kv_tokens() == 30 * 16  # prefill pools do not count
    cluster.mark_unreachable("c0")
    assert cluster.max_kv_tokens() == 10 * 16


def test_a_lapsed_worker_is_purged_only_after_the_grace() -> None:
    # The agent must still find a frozen worker's lapsed entry to restart it: the purge of
    # its index waits purge_grace_s after the lapse was first seen, then takes it.
    live = {"d0": info("d0", Role.DECODE)}
    since = lapsed_since({}, ["d0", "d1"], live, now=100.0)
    assert since == {"d1": 100.0}
    assert purgeable(since, 105.0, grace_s=10.0) == []
    since = lapsed_since(since, ["d0", "d1"], live, now=108.0)
    assert since == {"d1": 100.0}, "the first sighting of the lapse is kept"
    assert purgeable(since, 110.0, grace_s=10.0) == ["d1"]
    # Back with a lease (or deregistered) before the grace: forgotten.
    assert lapsed_since(since, ["d0", "d1"], {**live, "d1": info("d1", Role.DECODE)},
                        now=109.0) == {}
    assert lapsed_since(since, ["d0"], live, now=109.0) == {}


def test_a_prompt_counts_in_its_prefill_workers_queue_until_settled(view) -> None:
    """A 5,000-token prompt goes to the prefill worker. Its load reports (none here) do not
    show it yet, and the poll rebuilds the snapshot from them: the prompt still counts
    there, so a 5-token prompt planned next is prefilled by the idle decode worker instead
    of waiting for the prefill worker's next step. Once settled, P is idle again."""
    cluster, state = view
    state.workers = {"p0": info("p0", Role.PREFILL), "d0": info("d0", Role.DECODE)}
    asyncio.run(cluster.poll())
    long = cluster.plan(5000, [], local_prefill=None, request_id="long")
    assert isinstance(long, RoutePlan) and long.prefill_worker_id == "p0"
    assert cluster.routed.totals("p0") == (1, 5000)
    asyncio.run(cluster.poll())
    for i in range(5):
        short = cluster.plan(5, [], local_prefill=None, request_id=f"short{i}")
        assert isinstance(short, RoutePlan) and short.kind == "local"
        cluster.check_invariants()
        cluster.settle(f"short{i}")
    retried = cluster.plan(5000, [], local_prefill=False, request_id="long")  # replaces it
    assert isinstance(retried, RoutePlan) and cluster.routed.totals("p0") == (1, 5000)
    cluster.settle("long")
    cluster.settle("long")  # at the first token, then at the end: once is counted
    assert cluster.routed.totals("p0") == (0, 0) and len(cluster.routed) == 0
    asyncio.run(cluster.poll())
    short = cluster.plan(5, [], local_prefill=None, request_id="after")
    assert isinstance(short, RoutePlan) and short.kind == "split"
    cluster.check_invariants()


def test_a_prefix_in_a_workers_host_tier_routes_the_prompt_there() -> None:
    # The index holds d1's copies of the prompt's two blocks under their host-tier names
    # (what its worker publishes when its host KV tier takes them), at d1's live epoch.
    state = ScriptedState()
    state.workers = {"d0": info("d0", Role.DECODE), "d1": info("d1", Role.DECODE)}

    class HostIndex:
        holders = {host_tier_hash(11): {"d1": 1}, host_tier_hash(12): {"d1": 1},
                   13: {"d0": 1}}  # a later block alone is no usable prefix

    class HostMirror:
        index = HostIndex()

    cluster = ClusterView(state, HostMirror(), random.Random(0))  # type: ignore[arg-type]
    asyncio.run(cluster.poll())
    routed = cluster.plan(40, [11, 12, 13], local_prefill=True)
    assert isinstance(routed, RoutePlan)
    assert routed.decode_worker_id == "d1" and routed.cached_tokens == 32
