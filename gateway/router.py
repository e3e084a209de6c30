"""Where a request runs: a pure function from a snapshot of the workers to a `RoutePlan`.

Short prompts (the tier's local-prefill threshold, decided by `tiers.classify`) go to one
decode worker, which prefills them itself: moving their KV would cost more than
computing it. Long prompts go to a (prefill, decode) pair, and the KV moves between them.

Each candidate gets a cost in *tokens of work ahead of this request*:

    prefill side:  prompt_len - cached_prefix_tokens(w)       (work left for this prompt)
                   + waiting_cost * num_waiting(w) + running_cost * num_running(w)
                   + kv_pressure_cost * kv_usage(w) ** 2         (eviction risk near full)
    decode side:   the same load terms; plus the prefill term when it prefills locally

so a cached prefix is worth exactly the tokens it saves, and affinity gives way once a
worker's queue costs more than the prefix saves. Among the candidates within
`tie_margin_tokens` of the best, two are drawn at random (the injected `random.Random`)
and the cheaper is taken (power of two choices): identical workers share the load
instead of the first in the list taking it all.

The snapshot is whatever the gateway last saw (Redis index mirror, worker heartbeats);
when Redis is unreachable the gateway keeps routing on its last snapshot, and applies
its own decisions to it with `with_assignment` so a burst routed between two refreshes
does not all land on one worker.

Cached prefix of a worker: block hashes are chained (block i's hash covers blocks 0..i),
so a worker's usable prefix is the longest run of leading blocks it holds:

    block_hashes   h0  h1  h2  h3
    worker A        x   x   -   x     -> 2 blocks (h3 alone is useless without h2)
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import msgspec

from common.contract.protocol import Role, WorkerLoad


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: str
    role: Role
    load: WorkerLoad


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    workers: tuple[WorkerView, ...]
    prefix_index: Mapping[int, frozenset[str]]  # block hash -> ids of workers holding it
    block_size: int

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
    local_prefill: bool  # from the tier: the decode worker prefills this prompt


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    waiting_cost_tokens: float = 512.0  # a queued request delays us by about this much work
    running_cost_tokens: float = 32.0  # a running request slows each step a little
    kv_pressure_cost_tokens: float = 2_048.0  # at a full KV pool; quadratic in usage
    tie_margin_tokens: float = 64.0  # costs this close are a tie, settled by two choices


@dataclass(frozen=True, slots=True)
class RoutePlan:
    decode_worker_id: str
    prefill_worker_id: str | None  # None: the decode worker prefills the prompt itself
    cached_tokens: int  # prompt tokens already in the prefilling worker's prefix cache


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
    overlap = prefix_overlap_blocks(request.block_hashes, snapshot.prefix_index)

    def cached(worker: WorkerView) -> int:
        return min(request.prompt_len, overlap.get(worker.worker_id, 0) * snapshot.block_size)

    def prefill_cost(worker: WorkerView) -> float:
        return request.prompt_len - cached(worker) + _load_cost(worker.load, weights)

    prefillers = [w for w in snapshot.workers if w.role.prefills_for_others]
    receivers = [w for w in decoders if w.role.takes_reservations]

    def local(candidates: list[WorkerView]) -> RoutePlan:
        worker = _pick([(prefill_cost(w), w) for w in candidates], rng, weights.tie_margin_tokens)
        return RoutePlan(decode_worker_id=worker.worker_id, prefill_worker_id=None,
                         cached_tokens=cached(worker))

    # Without a prefill worker a long prompt is still served: its decode worker prefills.
    if request.local_prefill or not prefillers:
        return local(decoders)
    prefill = _pick([(prefill_cost(w), w) for w in prefillers], rng, weights.tie_margin_tokens)
    if prefill.role is Role.COLOCATED:
        # A colocated worker that prefills may as well decode: no KV has to move.
        return RoutePlan(decode_worker_id=prefill.worker_id, prefill_worker_id=None,
                         cached_tokens=cached(prefill))
    if not receivers:  # only colocated workers decode: one of them does it all
        return local(decoders)
    decode = _pick([(_load_cost(w.load, weights), w) for w in receivers], rng,
                   weights.tie_margin_tokens)
    return RoutePlan(decode_worker_id=decode.worker_id, prefill_worker_id=prefill.worker_id,
                     cached_tokens=cached(prefill))


def with_assignment(snapshot: ClusterSnapshot, plan: RoutePlan) -> ClusterSnapshot:
    """The snapshot as it will look once the plan's workers have queued the request."""
    chosen = {plan.decode_worker_id, plan.prefill_worker_id} - {None}
    workers = tuple(
        replace(w, load=msgspec.structs.replace(w.load, num_waiting=w.load.num_waiting + 1))
        if w.worker_id in chosen else w
        for w in snapshot.workers)
    return replace(snapshot, workers=workers)


def _load_cost(load: WorkerLoad, weights: RoutingWeights) -> float:
    return (weights.waiting_cost_tokens * load.num_waiting
            + weights.running_cost_tokens * load.num_running
            + weights.kv_pressure_cost_tokens * load.kv_usage ** 2)


def _pick(candidates: list[tuple[float, WorkerView]], rng: random.Random,
          margin: float) -> WorkerView:
    best = min(cost for cost, _ in candidates)
    near_best = [(cost, w) for cost, w in candidates if cost <= best + margin]
    if len(near_best) == 1:
        return near_best[0][1]
    first, second = rng.sample(near_best, 2)
    return first[1] if first[0] <= second[0] else second[1]
