from __future__ import annotations

import dataclasses
import random
from collections import Counter

import msgspec
import pytest

from gateway.routing.router import (ClusterSnapshot, NoWorkers, RoutePlan, RouteRequest, WorkerView,
                                    host_overlap_blocks, load_at_routing, plan_route,
                                    prefix_overlap_blocks, reload_cost_tokens, with_assignment)
from protocol.messages import Role
from protocol.worker_load import StepModel, WorkerLoad

BLOCK = 16
IDLE = WorkerLoad(num_running=0, num_waiting=0, num_kv_blocks_used=0, num_kv_blocks_total=1000)


def worker(worker_id: str, role: Role, load: WorkerLoad = IDLE) -> WorkerView:
    return WorkerView(worker_id, role, load)


def snapshot(workers, index=None) -> ClusterSnapshot:
    return ClusterSnapshot(workers=tuple(workers), prefix_index=index or {}, block_size=BLOCK)


def long_request(hashes=(), prompt_len=2048) -> RouteRequest:
    return RouteRequest(prompt_len=prompt_len, block_hashes=hashes, local_prefill=False)


def test_prefix_overlap_counts_only_leading_blocks():
    index = {1: frozenset({"a", "b"}), 2: frozenset({"a"}), 3: frozenset({"a", "b"})}
    assert prefix_overlap_blocks([1, 2, 3], index) == {"a": 3, "b": 1}
    assert prefix_overlap_blocks([9, 1], index) == {}
    assert prefix_overlap_blocks([], index) == {}


def test_empty_pool_and_no_decode_worker_give_no_workers():
    rng = random.Random(0)
    assert isinstance(plan_route(long_request(), snapshot([]), rng), NoWorkers)
    only_prefill = snapshot([worker("p0", Role.PREFILL)])
    assert isinstance(plan_route(long_request(), only_prefill, rng), NoWorkers)


def test_short_prompt_goes_to_a_decode_worker_only():
    snap = snapshot([worker("p0", Role.PREFILL), worker("d0", Role.DECODE)])
    plan = plan_route(RouteRequest(prompt_len=20, block_hashes=(), local_prefill=True), snap,
                      random.Random(0))
    assert plan == RoutePlan(decode_worker_id="d0", prefill_worker_id=None, cached_tokens=0)


def test_long_prompt_gets_a_prefill_decode_pair():
    snap = snapshot([worker("p0", Role.PREFILL), worker("d0", Role.DECODE)])
    plan = plan_route(long_request(), snap, random.Random(0))
    assert (plan.prefill_worker_id, plan.decode_worker_id) == ("p0", "d0")


def test_long_prompt_without_prefill_workers_is_prefilled_by_decode():
    snap = snapshot([worker("d0", Role.DECODE)])
    plan = plan_route(long_request(), snap, random.Random(0))
    assert plan.prefill_worker_id is None and plan.decode_worker_id == "d0"


def test_colocated_worker_serves_both_sides_alone():
    snap = snapshot([worker("c0", Role.COLOCATED)])
    plan = plan_route(long_request(), snap, random.Random(0))
    assert plan == RoutePlan(decode_worker_id="c0", prefill_worker_id=None, cached_tokens=0)


def test_handoff_never_targets_a_colocated_worker():
    # A colocated worker takes no reservations: with no decode worker beside it, a prompt
    # the prefill worker would take is prefilled where it is decoded instead.
    snap = snapshot([worker("p0", Role.PREFILL), worker("c0", Role.COLOCATED)])
    for seed in range(20):
        plan = plan_route(long_request(), snap, random.Random(seed))
        assert plan == RoutePlan(decode_worker_id="c0", prefill_worker_id=None,
                                 cached_tokens=0)
    both = snapshot([worker("p0", Role.PREFILL), worker("c0", Role.COLOCATED),
                     worker("d0", Role.DECODE)])
    plans = [plan_route(long_request(), both, random.Random(seed)) for seed in range(40)]
    assert all(p.decode_worker_id == "d0" for p in plans if p.prefill_worker_id == "p0")
    assert {p.prefill_worker_id for p in plans} == {"p0", None}


def test_prefix_affinity_wins_over_a_small_load_difference():
    hashes = tuple(range(100, 164))  # 64 blocks = 1024 tokens cached on p1
    index = {h: frozenset({"p1"}) for h in hashes}
    busier = WorkerLoad(num_running=2, num_waiting=1, num_kv_blocks_used=300, num_kv_blocks_total=1000)
    snap = snapshot([worker("p0", Role.PREFILL), worker("p1", Role.PREFILL, busier),
                     worker("d0", Role.DECODE)], index)
    for seed in range(20):
        plan = plan_route(long_request(hashes), snap, random.Random(seed))
        assert plan.prefill_worker_id == "p1" and plan.cached_tokens == 1024


def test_load_wins_over_a_prefix_when_the_holder_is_swamped():
    hashes = tuple(range(100, 164))
    index = {h: frozenset({"p1"}) for h in hashes}
    swamped = WorkerLoad(num_running=8, num_waiting=10, num_kv_blocks_used=900, num_kv_blocks_total=1000)
    snap = snapshot([worker("p0", Role.PREFILL), worker("p1", Role.PREFILL, swamped),
                     worker("d0", Role.DECODE)], index)
    plan = plan_route(long_request(hashes), snap, random.Random(0))
    assert plan.prefill_worker_id == "p0" and plan.cached_tokens == 0


def test_idle_identical_workers_share_load_through_two_choices():
    workers = [worker(f"d{i}", Role.DECODE) for i in range(4)]
    snap = snapshot(workers)
    rng = random.Random(7)
    picks = Counter(plan_route(long_request(), snap, rng).decode_worker_id for _ in range(400))
    assert set(picks) == {"d0", "d1", "d2", "d3"}
    assert min(picks.values()) > 50  # no worker starved, none hot-spotted


def test_hot_prefix_over_many_requests_spreads_once_its_holder_queues_up():
    """Every request shares a 512-token prefix cached on p0; as the gateway books its own
    decisions, p0's queue grows until a cold worker is cheaper."""
    hashes = tuple(range(32))
    index = {h: frozenset({"p0"}) for h in hashes}
    snap = snapshot([worker(f"p{i}", Role.PREFILL) for i in range(4)]
                    + [worker(f"d{i}", Role.DECODE) for i in range(4)], index)
    rng = random.Random(3)
    prefill_picks, decode_picks = Counter(), Counter()
    for _ in range(200):
        plan = plan_route(long_request(hashes, prompt_len=600), snap, rng)
        prefill_picks[plan.prefill_worker_id] += 1
        decode_picks[plan.decode_worker_id] += 1
        snap = with_assignment(snap, plan)
    assert set(prefill_picks) == {"p0", "p1", "p2", "p3"}
    # p0's cached prefix buys it only about one queued request's worth of extra share.
    assert prefill_picks["p0"] <= 200 / 4 + 5
    assert max(decode_picks.values()) - min(decode_picks.values()) <= 4


def test_routing_is_deterministic_for_a_given_rng_seed():
    snap = snapshot([worker(f"d{i}", Role.DECODE) for i in range(5)])
    a = [plan_route(long_request(), snap, r).decode_worker_id for r in [random.Random(11)] * 30]
    b = [plan_route(long_request(), snap, r).decode_worker_id for r in [random.Random(11)] * 30]
    assert a == b
    # ...and the generator decides: another seed draws another sequence (a router that
    # ignored it would repeat `a`).
    c = [plan_route(long_request(), snap, r).decode_worker_id for r in [random.Random(12)] * 30]
    assert c != a and set(a) == set(c) == {f"d{i}" for i in range(5)}


def test_a_decode_worker_without_room_for_the_prompt_is_passed_over():
    # 2048 tokens + 1 need 129 blocks of 16: d-full has 100 free, d-room 200.
    full = WorkerLoad(num_running=0, num_waiting=0, num_kv_blocks_used=900,
                      num_kv_blocks_total=1000)
    room = WorkerLoad(num_running=8, num_waiting=4, num_kv_blocks_used=800,
                      num_kv_blocks_total=1000)
    snap = snapshot([worker("p0", Role.PREFILL), worker("d-full", Role.DECODE, full),
                     worker("d-room", Role.DECODE, room)])
    # d-room is busier, so the load rule alone would prefer d-full.
    picks = {plan_route(long_request(), snap, random.Random(seed)).decode_worker_id
             for seed in range(20)}
    assert picks == {"d-room"}
    # With no worker having room, the request still goes somewhere (the worker queues it).
    both_full = snapshot([worker("p0", Role.PREFILL), worker("d-full", Role.DECODE, full)])
    assert plan_route(long_request(), both_full, random.Random(0)).decode_worker_id == "d-full"


def test_a_short_prompt_stays_off_a_prefill_worker_busy_with_a_long_one():
    """The router decides (no tier threshold, no step models yet: the token-cost rule). On
    an idle cluster a prompt goes to the prefill pool; with a 5,000-token prompt on P, a
    5-token one would wait for P's next step, a full 2,048-token chunk of the long prompt
    (+ 32 for it running), where the idle D computes just its 5 tokens: local on D."""
    def short() -> RouteRequest:
        return RouteRequest(prompt_len=5, block_hashes=(), local_prefill=None)

    d = worker("d0", Role.DECODE)
    idle_p = worker("p0", Role.PREFILL)
    assert plan_route(short(), snapshot([idle_p, d]), random.Random(0)).kind == "split"
    busy = WorkerLoad(num_running=1, num_queued_prefill_tokens=5000, num_kv_blocks_total=1000)
    busy_p = worker("p0", Role.PREFILL, busy)
    for seed in range(10):
        assert plan_route(short(), snapshot([busy_p, d]), random.Random(seed)).kind == "local"
    # A D busy decoding costs more than P's next step: the prompt goes to P.
    decoding = WorkerLoad(num_running=80, num_decoding=80, num_kv_blocks_total=1000)
    busy_d = worker("d0", Role.DECODE, decoding)
    assert plan_route(short(), snapshot([busy_p, busy_d]), random.Random(0)).kind == "split"


def test_a_prompt_routed_a_moment_ago_counts_before_the_worker_reports_it():
    """P's last report is idle, but the gateway has just sent it a 5,000-token prompt (the
    report is up to a heartbeat old, taken between engine steps): counted as waiting there."""
    just_routed = dataclasses.replace(worker("p0", Role.PREFILL), num_routed_prefills=1,
                                      num_routed_prefill_tokens=5000)
    load = load_at_routing(just_routed)
    assert (load.num_waiting, load.num_queued_prefill_tokens) == (1, 5000)
    short = RouteRequest(prompt_len=5, block_hashes=(), local_prefill=None)
    for seed in range(10):
        plan = plan_route(short, snapshot([just_routed, worker("d0", Role.DECODE)]),
                          random.Random(seed))
        assert plan.kind == "local"
    # Once the report shows it (prefilling, part done), it is not counted twice.
    reported = WorkerLoad(num_running=1, num_queued_prefill_tokens=3000, num_kv_blocks_total=1000)
    seen = dataclasses.replace(just_routed, load=reported)
    seen_load = load_at_routing(seen)
    assert seen_load.num_waiting == 0 and seen_load.num_running == 1
    assert seen_load.num_queued_prefill_tokens == 5000  # the larger of the two
    # A tier threshold still decides: a forced split goes to P however busy it is.
    forced = RouteRequest(prompt_len=5, block_hashes=(), local_prefill=False)
    assert plan_route(forced, snapshot([just_routed, worker("d0", Role.DECODE)]),
                      random.Random(0)).kind == "split"


def test_two_both_workers_keep_a_short_prompt_local_by_the_rule_and_never_decode_it_on_a_busy_one():
    """The token-cost rule (no step models yet) on the default CPU layout, two BOTH workers.
    Both idle: the prefill goes to either, which decodes it too (a handoff buys nothing). One
    computes a 5,000-token prompt: the short one is prefilled on the idle one, and decoded
    there as well; its decode steps would otherwise share every step with that prompt."""
    short = RouteRequest(prompt_len=5, block_hashes=(), local_prefill=None)
    idle = [worker("a", Role.BOTH), worker("b", Role.BOTH)]
    for seed in range(10):
        assert plan_route(short, snapshot(idle), random.Random(seed)).kind == "local"
    busy = WorkerLoad(num_running=1, num_queued_prefill_tokens=5000, num_kv_blocks_total=1000)
    cluster = snapshot([worker("a", Role.BOTH, busy), worker("b", Role.BOTH)])
    for seed in range(10):
        plan = plan_route(short, cluster, random.Random(seed))
        assert (plan.kind, plan.decode_worker_id) == ("local", "b")
    # A tier that forces the handoff still gets one.
    forced = RouteRequest(prompt_len=5, block_hashes=(), local_prefill=False)
    for seed in range(10):
        assert plan_route(forced, snapshot(idle), random.Random(seed)).kind == "split"


def test_a_host_tier_run_follows_the_kv_cache_run_of_the_same_worker():
    device = {1: frozenset({"a", "b"}), 2: frozenset({"a"})}
    host = {2: frozenset({"b"}), 3: frozenset({"a", "b"}), 4: frozenset({"c"})}
    overlap = prefix_overlap_blocks([1, 2, 3, 4], device)
    # a: 2 in its KV cache, then 3 on the host; b: 1, then 2 and 3; c: only h4, no prefix.
    assert host_overlap_blocks([1, 2, 3, 4], host, overlap) == {"a": 1, "b": 2}
    assert host_overlap_blocks([1, 2], {}, overlap) == {}


def test_a_host_hit_ranks_between_a_kv_cache_hit_and_a_miss():
    # Three idle decode workers, a 2048-token prompt of 128 blocks: `dev` holds it in its KV
    # cache, `host` in its host tier, `cold` nowhere. Without step models a reloaded token
    # counts half a computed one.
    hashes = list(range(100, 228))
    workers = [worker(w, Role.DECODE) for w in ("cold", "host", "dev")]
    request = RouteRequest(prompt_len=2048, block_hashes=hashes, local_prefill=True)
    device = {h: frozenset({"dev"}) for h in hashes}
    host = {h: frozenset({"host"}) for h in hashes}
    both = ClusterSnapshot(tuple(workers), device, BLOCK, host)
    plan = plan_route(request, both, random.Random(0))
    assert plan.decode_worker_id == "dev" and plan.cached_tokens == 2048
    no_device = ClusterSnapshot(tuple(workers), {}, BLOCK, host)
    plan = plan_route(request, no_device, random.Random(0))
    assert plan.decode_worker_id == "host" and plan.cached_tokens == 2048
    assert reload_cost_tokens(workers[1], 2048) == 1024


def test_a_host_hit_is_priced_at_its_copy_by_the_workers_own_rate():
    # 20 us per prefill token; 1000 bytes of KV a token at 1 GB/s: 1 us a token to reload.
    model = StepModel(base_s=0.005, prefill_token_s=20e-6, decode_seq_s=1e-4,
                      context_token_s=1e-6, num_samples=10, num_prefill_samples=5)
    load = msgspec.structs.replace(IDLE, step_model=model, host_reload_bytes_per_s=1e9)
    view = WorkerView("w", Role.DECODE, load, kv_bytes_per_token=1000)
    assert reload_cost_tokens(view, 2000) == pytest.approx(100.0)  # 2 ms of copy = 100 tokens
    slow = WorkerView("w", Role.DECODE, msgspec.structs.replace(
        load, host_reload_bytes_per_s=1e6), kv_bytes_per_token=1000)
    assert reload_cost_tokens(slow, 2000) == 2000  # never dearer than computing them


def test_a_handoff_pairs_only_workers_of_one_kv_dtype():
    fp8 = [dataclasses.replace(worker(f"p{i}", Role.PREFILL), kv_dtype="fp8_e4m3")
           for i in range(2)]
    bf16 = dataclasses.replace(worker("d0", Role.DECODE), kv_dtype="bfloat16")
    same = dataclasses.replace(worker("d1", Role.DECODE), kv_dtype="fp8_e4m3")
    for seed in range(20):
        plan = plan_route(long_request(), snapshot([*fp8, bf16, same]), random.Random(seed))
        assert plan.prefill_worker_id in ("p0", "p1") and plan.decode_worker_id == "d1"
    # No decode worker of the prefill pool's dtype: the decode worker prefills itself.
    plan = plan_route(long_request(), snapshot([*fp8, bf16]), random.Random(0))
    assert plan == RoutePlan(decode_worker_id="d0", prefill_worker_id=None, cached_tokens=0)
