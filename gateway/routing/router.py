"""Where a request runs: a pure function from a snapshot of the workers to a `RoutePlan`.

Predicted (the default, once every worker has published a fitted step model): every plan
is enumerated, a local prefill on each decoding worker D and a (P, D) split for every
worker P that prefills for others and every D that takes reservations, with their prefix
cache hits; gateway/routing/plan_model.py predicts each one's TTFT, this request's TPOT and the
TPOT of the running requests it stretches, and its cost (the latency it adds to this
request and to the running ones). Among the plans that meet every target the cheapest
wins (near ties, within `tie_margin_cost`, go to a local plan, then to two random
choices); when none does, the smallest worst-ratio-to-target (the least miss; near ties
within `tie_margin_score` to the smaller sum of ratios). So short prompts stay local while
the decode worker has room, and move to an idle prefill worker as soon as prefilling them
locally would stall more running streams than the move costs. Decode workers whose KV pool
(as last published) lacks the blocks for the prompt are passed over while another has them.

Forced (the tier sets `local_prefill_max_tokens`, or a migrated stream must recompute
locally), or not predictable yet (a worker without a model): the token-cost rule below.
Short prompts go to one decode worker, which prefills them itself; long prompts go to a
(prefill, decode) pair, and the KV moves between them.

Each candidate gets a cost in *tokens of work ahead of this request*:

    prefill side:  W(w): the prompt tokens w computes until this prompt's last one (its own
                   uncached tokens, what its queue puts before them under the engine's
                   shortest-remaining-first order and fills those steps with: plan_model's
                   `prefill_work`)
                   + waiting_cost * num_waiting(w) + running_cost * num_running(w)
                   + kv_pressure_cost * kv_usage(w) ** 2         (eviction risk near full)
    decode side:   the same load terms, plus the prompt tokens queued there (its decode
                   steps share their chunks); plus the prefill term when it prefills locally

so a cached prefix is worth exactly the tokens it saves, and affinity gives way once a
worker's queue costs more than the prefix saves. Among the candidates within
`tie_margin_tokens` of the best, two are drawn at random (the injected `random.Random`)
and the cheaper is taken (power of two choices): identical workers share the load
instead of the first in the list taking it all. Where the router decides (no tier
threshold), a prompt goes to the prefill pool unless prefilling it on a decoding worker
costs less by more than `tie_margin_tokens`: a short prompt stays off a prefill worker busy
with a long one (its next step is a full chunk of that prompt) while a decoding worker can
prefill it at once. Where the router decides, a prefill worker that decodes too (role
both) keeps the request unless another decodes it for less by more than
`tie_margin_tokens`: between two idle `both` workers a handoff buys nothing, and one onto a
worker computing a long prompt would make every decode step share a chunk of it.

The snapshot is whatever the gateway last saw (Redis index mirror, worker heartbeats),
plus, per worker, the prompts this gateway routed there to prefill and has not yet seen
prefilled (`WorkerView.num_routed_prefills`): a load report is up to a heartbeat old and
taken between two engine steps, so a prompt routed a moment ago is not in it yet. Both
policies read the queue as of the moment of routing, `load_at_routing`: the report's, and
at least the routed prompts. When Redis is unreachable the gateway keeps routing on its
last snapshot, and applies its own decisions to it with `with_assignment` so a burst routed
between two refreshes does not all land on one worker.

Cached prefix of a worker: block hashes are chained (block i's hash covers blocks 0..i),
so a worker's usable prefix is the longest run of leading blocks it holds:

    block_hashes   h0  h1  h2  h3
    worker A        x   x   -   x     -> 2 blocks (h3 alone is useless without h2)

and then the run its host KV tier holds right after (`snapshot.host_index`), which it copies
back instead of computing:

    worker B (KV cache)   x   -   -   -
    worker B (host tier)  -   x   x   -   -> 1 block cached, 2 reloaded: 3 not computed

A reloaded token is priced at its copy (plan_model's `reload_s`): in the prediction, added to
the TTFT; in the token-cost rule, as the prefill tokens that take as long on that worker (by
its step model; half a token each before it has one), never more than computing it. So a
host hit ranks between a hit in the KV cache and a miss.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec

from gateway.routing.plan_model import (Prediction, Targets, WorkerSide, complete_models,
                                        predict_local, predict_split, prefill_work, reload_s)
from protocol.messages import Role
from protocol.worker_load import WorkerLoad


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: Role
    load: WorkerLoad
    max_batched_tokens: int = 2048  # the engine's step budget
    kv_bytes_per_token: int = 0  # KV of one token, all layers (what a handoff moves)
    kv_dtype: str = ""  # its KV pool's dtype: a handoff pairs only workers of one
    # Prompts this gateway routed here to prefill whose first token it has not seen yet,
    # and their uncached tokens: in the worker's queue, whether or not its last load
    # report shows them (`load_at_routing`).
    num_routed_prefills: int = 0
    num_routed_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    workers: tuple[WorkerView, ...]
    prefix_index: Mapping[int, frozenset[str]]  # block hash -> ids of workers holding it
    block_size: int
    # block hash -> ids of workers whose host KV tier holds it (empty: none has a tier)
    host_index: Mapping[int, frozenset[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        ids = [w.worker_id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ValueError("worker ids in a snapshot must be unique")


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_len: int
    block_hashes: Sequence[int]  # chained hashes of the prompt's full blocks
    # True: the decode worker must prefill it (tier threshold, or a migrated stream);
    # False: on the prefill pool when there is one (tier threshold); None: predicted
    local_prefill: bool | None
    targets: Targets | None = None  # the request's SLO; None: not predicted


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    waiting_cost_tokens: float = 512.0  # a queued request delays us by about this much work
    running_cost_tokens: float = 32.0  # a running request slows each step a little
    kv_pressure_cost_tokens: float = 2_048.0  # at a full KV pool; quadratic in usage
    tie_margin_tokens: float = 64.0  # costs this close are a tie, settled by two choices
    tie_margin_score: float = 0.02  # predicted scores this close are a tie
    tie_margin_cost: float = 0.02  # predicted costs within this fraction are a tie


@dataclass(frozen=True, slots=True)
class RoutePlan:
    decode_worker_id: str
    prefill_worker_id: str | None  # None: the decode worker prefills the prompt itself
    cached_tokens: int  # prompt tokens already in the prefilling worker's prefix cache
    predicted: Prediction | None = None  # set when the plan was chosen by prediction

    @property
    def kind(self) -> str:
        return "local" if self.prefill_worker_id is None else "split"


@dataclass(frozen=True, slots=True)
class NoWorkers:
    reason: str


def prefix_overlap_blocks(block_hashes: Sequence[int],
                          prefix_index: Mapping[int, frozenset[str]]) -> dict[str, int]:
    """Leading blocks of the prompt each worker holds (workers holding none are absent)."""
    overlap: dict[str, int] = {}
    alive: frozenset[str] | None = None
    for i, block_hash in enumerate(block_hashes):
        holders = prefix_index.get(block_hash, frozenset())
        alive = holders if alive is None else alive & holders
        if not alive:
            break
        for worker_id in alive:
            overlap[worker_id] = i + 1
    return overlap


def plan_route(request: RouteRequest, snapshot: ClusterSnapshot, rng: random.Random,
               weights: RoutingWeights = RoutingWeights()) -> RoutePlan | NoWorkers:
    """Pick the workers for one request; side-effect free apart from drawing from `rng`."""
    decoders = [w for w in snapshot.workers if w.role.decodes]
    if not decoders:
        return NoWorkers("no decode worker is available")
    # Workers whose KV pool has room for the prompt go first (the others would queue it).
    decoders = [w for w in decoders if has_room(w, request.prompt_len, snapshot.block_size)] \
        or decoders
    overlap = prefix_overlap_blocks(request.block_hashes, snapshot.prefix_index)
    on_host = host_overlap_blocks(request.block_hashes, snapshot.host_index, overlap)
    bs, prompt_len = snapshot.block_size, request.prompt_len

    def cached(worker: WorkerView) -> int:  # not computed: in its KV cache or host tier
        wid = worker.worker_id
        return min(prompt_len, (overlap.get(wid, 0) + on_host.get(wid, 0)) * bs)

    def reloaded(worker: WorkerView) -> int:  # of those, copied back from its host tier
        return cached(worker) - min(prompt_len, overlap.get(worker.worker_id, 0) * bs)

    def prefill_cost(worker: WorkerView) -> float:
        load = load_at_routing(worker)
        work, _ = prefill_work(load, prompt_len - cached(worker), worker.max_batched_tokens)
        return work + reload_cost_tokens(worker, reloaded(worker)) + _load_cost(load, weights)

    prefillers = [w for w in snapshot.workers if w.role.prefills_for_others]
    receivers = [w for w in decoders if w.role.takes_reservations]
    if request.local_prefill is None and request.targets is not None:
        plan = _predicted_plan(request, request.targets, decoders, prefillers, receivers,
                               cached, reloaded, rng, weights)
        if plan is not None:
            return plan

    def local(candidates: list[WorkerView]) -> RoutePlan:
        worker = _pick([(prefill_cost(w), w) for w in candidates], rng, weights.tie_margin_tokens)
        return RoutePlan(decode_worker_id=worker.worker_id, prefill_worker_id=None,
                         cached_tokens=cached(worker))

    # Without a prefill worker a long prompt is still served: its decode worker prefills.
    if request.local_prefill or not prefillers:
        return local(decoders)
    # A colocated worker competes for the prefill too: it then decodes what it prefilled.
    colocated = [w for w in decoders if w.role is Role.COLOCATED]
    prefill = _pick([(prefill_cost(w), w) for w in prefillers + colocated], rng,
                    weights.tie_margin_tokens)
    if request.local_prefill is None and min(map(prefill_cost, decoders)) \
            + weights.tie_margin_tokens < prefill_cost(prefill):
        return local(decoders)  # the prefill pool is busier than a local prefill costs
    others = [w for w in receivers
              if w.worker_id != prefill.worker_id and kv_compatible(prefill, w)]
    if prefill.role is Role.COLOCATED:
        return local([prefill])
    if not others:  # a BOTH worker alone: it may as well decode what it prefills
        return local([prefill] if prefill.role.decodes else decoders)
    decode = _pick([(_decode_cost(w, weights), w) for w in others], rng,
                   weights.tie_margin_tokens)
    if request.local_prefill is None and prefill.role.decodes and _decode_cost(
            prefill, weights) <= _decode_cost(decode, weights) + weights.tie_margin_tokens:
        return local([prefill])  # it decodes as well as any other: no handoff for nothing
    return RoutePlan(decode_worker_id=decode.worker_id, prefill_worker_id=prefill.worker_id,
                     cached_tokens=cached(prefill))


def _predicted_plan(request: RouteRequest, targets: Targets, decoders: list[WorkerView],
                    prefillers: list[WorkerView], receivers: list[WorkerView],
                    cached: Callable[[WorkerView], int], reloaded: Callable[[WorkerView], int],
                    rng: random.Random, weights: RoutingWeights) -> RoutePlan | None:
    involved = {w.worker_id: w for w in (*decoders, *prefillers)}
    models = complete_models([w.load.step_model for w in involved.values()])
    if models is None:
        return None
    sides = {wid: WorkerSide(load_at_routing(w), m, w.max_batched_tokens, w.kv_bytes_per_token)
             for (wid, w), m in zip(involved.items(), models)}
    candidates: list[RoutePlan] = []
    for d in decoders:
        candidates.append(RoutePlan(d.worker_id, None, cached(d), predict_local(
            sides[d.worker_id], request.prompt_len, cached(d), targets, reloaded(d))))
    for p in prefillers:
        for d in receivers:
            if d.worker_id != p.worker_id and kv_compatible(p, d):
                candidates.append(RoutePlan(d.worker_id, p.worker_id, cached(p), predict_split(
                    sides[p.worker_id], sides[d.worker_id], request.prompt_len, cached(p),
                    cached(d), targets, reloaded(p))))
    feasible = [c for c in candidates if _prediction(c).score < 1.0]
    if feasible:  # the cheapest plan that meets every target
        least_cost = min(_prediction(c).cost_s for c in feasible)
        near = [c for c in feasible
                if _prediction(c).cost_s <= least_cost * (1 + weights.tie_margin_cost)]
    else:  # none does: the least miss
        best = min(_prediction(c).score for c in candidates)
        near = [c for c in candidates if _prediction(c).score <= best + weights.tie_margin_score]
        least = min(_prediction(c).ratio_sum for c in near)
        near = [c for c in near if _prediction(c).ratio_sum <= least + weights.tie_margin_score]
    # Still tied: a local plan occupies one worker and moves no KV.
    near = [c for c in near if c.prefill_worker_id is None] or near
    return near[0] if len(near) == 1 else min(
        rng.sample(near, 2), key=lambda c: (_prediction(c).score, _prediction(c).cost_s))


def kv_compatible(prefill: WorkerView, decode: WorkerView) -> bool:
    """Can `prefill` hand a prompt's KV to `decode`? Only between pools of one KV dtype (a
    worker that did not say counts as any: an older entry)."""
    return not prefill.kv_dtype or not decode.kv_dtype or prefill.kv_dtype == decode.kv_dtype


def host_overlap_blocks(block_hashes: Sequence[int], host_index: Mapping[int, frozenset[str]],
                        overlap: Mapping[str, int]) -> dict[str, int]:
    """Blocks of the prompt each worker's host tier holds right after the leading blocks its
    KV cache holds (`overlap`, prefix_overlap_blocks'); workers with none are absent."""
    result: dict[str, int] = {}
    for worker_id in set().union(*host_index.values()) if host_index else ():
        start = end = overlap.get(worker_id, 0)
        while end < len(block_hashes) and worker_id in host_index.get(block_hashes[end], ()):
            end += 1
        if end > start:
            result[worker_id] = end - start
    return result


def reload_cost_tokens(worker: WorkerView, tokens: int) -> float:
    """A host hit of `tokens` tokens in the token-cost rule: the prefill tokens that take as
    long as its copy on this worker (by its step model), at most `tokens`; without a model,
    half of them."""
    model = worker.load.step_model
    if tokens <= 0:
        return 0.0
    if model is None or model.prefill_token_s <= 0:
        return tokens / 2
    return min(float(tokens), reload_s(worker.load, worker.kv_bytes_per_token, tokens)
               / model.prefill_token_s)


def _prediction(plan: RoutePlan) -> Prediction:
    assert plan.predicted is not None
    return plan.predicted


def with_assignment(snapshot: ClusterSnapshot, plan: RoutePlan,
                    prompt_len: int = 0) -> ClusterSnapshot:
    """The snapshot as it will look once the plan's workers have queued the request: one
    more waiting request on each, its uncached prompt queued where it is prefilled, and one
    more sequence decoding where it decodes."""
    prefiller = plan.prefill_worker_id or plan.decode_worker_id
    uncached = max(0, prompt_len - plan.cached_tokens)

    def assigned(w: WorkerView) -> WorkerView:
        load = w.load
        if w.worker_id not in (plan.decode_worker_id, plan.prefill_worker_id):
            return w
        changes: dict[str, int] = {"num_waiting": load.num_waiting + 1}
        if w.worker_id == prefiller:
            changes["num_queued_prefill_tokens"] = load.num_queued_prefill_tokens + uncached
        if w.worker_id == plan.decode_worker_id:
            changes["num_decoding"] = load.num_decoding + 1
            changes["num_context_tokens"] = load.num_context_tokens + prompt_len
        return replace(w, load=msgspec.structs.replace(load, **changes))

    return replace(snapshot, workers=tuple(assigned(w) for w in snapshot.workers))


def load_at_routing(worker: WorkerView) -> WorkerLoad:
    """The worker's queue as of now: its last report, with the prompts this gateway routed
    to it and has not seen prefilled counted where the report lacks them (as waiting)."""
    load = worker.load
    reported = load.num_waiting + load.num_running - load.num_decoding
    unreported = worker.num_routed_prefills - reported
    if unreported <= 0 and worker.num_routed_prefill_tokens <= load.num_queued_prefill_tokens:
        return load
    return msgspec.structs.replace(
        load, num_waiting=load.num_waiting + max(0, unreported),
        num_queued_prefill_tokens=max(load.num_queued_prefill_tokens,
                                      worker.num_routed_prefill_tokens))


def has_room(worker: WorkerView, prompt_len: int, block_size: int) -> bool:
    """Whether the worker's last published KV pool has the blocks for the prompt and its
    first token (prefix-cache hits not counted: a conservative guess)."""
    return load_has_room(worker.load, prompt_len, block_size)


def load_has_room(load: WorkerLoad, prompt_len: int, block_size: int, times: int = 1) -> bool:
    """Whether `load`'s free KV blocks hold the prompt and its first token `times` times
    over (an unknown, empty pool has no room)."""
    needed = -(-(prompt_len + 1) // block_size)
    return load.num_kv_blocks_total - load.num_kv_blocks_used >= times * needed


def _load_cost(load: WorkerLoad, weights: RoutingWeights) -> float:
    return (weights.waiting_cost_tokens * load.num_waiting
            + weights.running_cost_tokens * load.num_running
            + weights.kv_pressure_cost_tokens * load.kv_usage ** 2)


def _decode_cost(worker: WorkerView, weights: RoutingWeights) -> float:
    """What decoding one more request there costs: its load, and the prompt tokens queued
    there, whose chunks its decode steps will share (engine/scheduler.py)."""
    load = load_at_routing(worker)
    return _load_cost(load, weights) + load.num_queued_prefill_tokens


def _pick(candidates: list[tuple[float, WorkerView]], rng: random.Random,
          margin: float) -> WorkerView:
    best = min(cost for cost, _ in candidates)
    near_best = [(cost, w) for cost, w in candidates if cost <= best + margin]
    if len(near_best) == 1:
        return near_best[0][1]
    first, second = rng.sample(near_best, 2)
    return first[1] if first[0] <= second[0] else second[1]
