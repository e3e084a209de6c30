"""A simulated P/D cluster for the agent's rebalancer: stub workers with scripted latencies,
driven by discrete events, observed and rebalanced by the real policy (agent/rebalance.py)
the way agent/role_mover.py does it. No GPU, no processes, no clock: simulated seconds only.

Lifecycle of a request:

    arrival ─▶ prefill FIFO (the prefill worker with the least backlog) ─▶ prefilled: first
    token ─▶ KV transfer (a fixed delay) ─▶ decode waiting (the decode worker with the fewest
    running + waiting) ─▶ batch (once a slot is free and its prompt + output KV fits) ─▶ one
    token per step ─▶ done
    (no routable worker of the role it needs: pending, until one comes back)

A prefill worker prefills its FIFO at a fixed rate (tokens/s). A decode step of B sequences
takes base + per_seq * B. Every tick the agent records `pool_signals` over `RoleView`s built
from the workers' state (keeping the last 30 s, as the agent does); every period, while no
role change is under way, it asks `plan_rebalance` and applies the move:

    start: nothing new; queued and waiting work goes to peers ─▶ drain_s: the prefill head
    and the decode batch go on ─▶ end: what is left goes to peers (a prefill starts over, a
    sequence keeps its tokens) ─▶ serves the new role under a new epoch

A failure ejects a worker at once and moves its work to peers the same way; it comes back
in the same role under a new epoch. After the last phase, arrivals and the agent stop, and
the run goes on until every request is done.

Invariants (check_invariants): a request is held in at most one place and is not held once
done; a worker's KV blocks in use are its batch's reservations; a dead worker holds nothing.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agent.rebalance import (PoolSignals, RebalanceConfig, RoleMove, RoleView, plan_rebalance,
                             pool_signals)
from protocol.messages import Role
from protocol.worker_load import StepModel, WorkerLoad

BLOCK_TOKENS = 16
HISTORY_S = 30.0  # the agent's window_s (agent/control_loop.py)
RATE_WINDOW_S = 10.0  # the span a worker's token rates are measured over


@dataclass(frozen=True, slots=True)
class Traffic:
    name: str
    rate_per_s: float
    prompt_tokens: int  # mean
    output_tokens: int  # mean


@dataclass(frozen=True, slots=True)
class Hardware:
    prefill_tokens_per_s: float = 8000.0
    decode_base_s: float = 0.020
    decode_per_seq_s: float = 0.0005
    max_batch: int = 64
    kv_tokens: int = 65536  # per decode worker
    transfer_s: float = 0.05
    drain_s: float = 5.0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    phases: tuple[tuple[Traffic, float], ...]  # (traffic, seconds), in order
    num_workers: int
    num_prefill: int  # at the start; the others decode
    failures: tuple[tuple[int, float, float], ...] = ()  # (worker index, dies at s, back at s)


@dataclass(eq=False, slots=True)
class Request:
    index: int
    phase: str
    arrival_s: float
    prompt: int
    output: int  # >= 2: the first token comes from the prefill, the rest one per step
    remaining: int  # decode steps left
    first_token_s: float | None = None
    done_s: float | None = None
    finish_step: int = 0  # the decode step that ends it, on its worker


@dataclass(slots=True)
class Worker:
    index: int
    worker_id: str
    role: Role
    epoch: int = 1
    alive: bool = True
    switch_to: Role | None = None  # draining towards this role
    gen: int = 0  # bumped whenever its scheduled events become void
    queue: deque[Request] = field(default_factory=deque)  # prefill FIFO, the head excluded
    head: Request | None = None  # being prefilled since head_start_s
    head_start_s: float = 0.0
    prefilled: int = 0  # prompt tokens finished, in all
    waiting: deque[Request] = field(default_factory=deque)  # for a decode batch slot
    batch: dict[int, Request] = field(default_factory=dict)
    finishing: dict[int, list[Request]] = field(default_factory=dict)  # step -> ends there
    step_count: int = 0
    stepping: bool = False  # a step is under way (or about to start)
    kv_used: int = 0  # blocks reserved by the batch
    decoded: int = 0  # tokens decoded, in all
    rates: deque[tuple[float, float, int]] = field(default_factory=deque)  # (t, prefilled, decoded)

    @property
    def routable(self) -> bool:
        return self.alive and self.switch_to is None


def blocks(r: Request) -> int:
    return math.ceil((r.prompt + r.output) / BLOCK_TOKENS)


def arrivals(scenario: Scenario, seed: int) -> list[Request]:
    rng, start = random.Random(seed), 0.0
    out: list[Request] = []
    for traffic, seconds in scenario.phases:
        t = start + rng.expovariate(traffic.rate_per_s)
        while t < start + seconds:
            prompt = rng.randint(traffic.prompt_tokens // 2, traffic.prompt_tokens * 3 // 2)
            output = max(2, rng.randint(traffic.output_tokens // 2, traffic.output_tokens * 3 // 2))
            out.append(Request(len(out), traffic.name, t, prompt, output, output - 1))
            t += rng.expovariate(traffic.rate_per_s)
        start += seconds
    return out


class Simulation:
    def __init__(self, scenario: Scenario, hw: Hardware, cfg: RebalanceConfig | None,
                 period_s: float, tick_s: float, seed: int) -> None:
        self.hw, self.cfg, self.period_s, self.tick_s = hw, cfg, period_s, tick_s
        self.end_s = sum(seconds for _, seconds in scenario.phases)
        self.model = StepModel(base_s=hw.decode_base_s, prefill_token_s=1 / hw.prefill_tokens_per_s,
                               decode_seq_s=hw.decode_per_seq_s, context_token_s=0.0,
                               num_samples=100, num_prefill_samples=50, num_decode_samples=50)
        self.kv_blocks = hw.kv_tokens // BLOCK_TOKENS
        self.workers = [Worker(i, f"w-{i}",
                               Role.PREFILL if i < scenario.num_prefill else Role.DECODE)
                        for i in range(scenario.num_workers)]
        self.requests = arrivals(scenario, seed)
        self.events: list[tuple[float, int, Worker | None, int, Callable[..., None],
                                tuple[object, ...]]] = []
        self.order = itertools.count()  # ties in time run in the order they were scheduled
        self.pending: deque[Request] = deque()  # no routable worker of the role it needs
        self.history: deque[PoolSignals] = deque()
        self.last_move_s: float | None = None
        self.last_decision_s: float | None = None
        self.moves: list[tuple[float, RoleMove]] = []  # (decided at s, move)
        self.splits: list[tuple[float, int, int]] = []  # (t, routable prefill, routable decode)
        for r in self.requests:
            self.at(r.arrival_s, None, self.route, (r,))
        for index, dies_s, back_s in scenario.failures:
            self.at(dies_s, None, self.fail, self.workers[index])
            self.at(back_s, None, self.recover, self.workers[index])
        self.at(0.0, None, self.tick)

    def at(self, t: float, owner: Worker | None, fn: Callable[..., None], *args: object) -> None:
        """Call fn(*args, t) at t, unless `owner` has voided its events by then."""
        heapq.heappush(self.events, (t, next(self.order), owner, owner.gen if owner else 0, fn,
                                     args))

    def run(self, check: bool = False) -> Simulation:
        """Until no event is left; `check`: check_invariants() after every event (slow)."""
        while self.events:
            t, _, owner, gen, fn, args = heapq.heappop(self.events)
            if owner is None or owner.gen == gen:
                fn(*args, t)
                if check:
                    self.check_invariants()
        return self

    def check_invariants(self) -> None:
        held = list(self.pending)
        for w in self.workers:
            mine = [*([w.head] if w.head else []), *w.queue, *w.waiting, *w.batch.values()]
            assert w.alive or not mine, f"{w.worker_id} is dead but holds requests"
            assert w.kv_used == sum(blocks(r) for r in w.batch.values()), w.worker_id
            assert all(r.finish_step > w.step_count for r in w.batch.values()), w.worker_id
            held += mine
        assert len({r.index for r in held}) == len(held), "a request is held in two places"
        assert all(r.done_s is None for r in held), "a request is held after it is done"

    def route(self, requests: Iterable[Request], t: float) -> None:
        """Hand each request to a routable worker of the role its stage needs, or hold it."""
        for r in requests:
            role = Role.PREFILL if r.first_token_s is None else Role.DECODE
            ready = [w for w in self.workers if w.role == role and w.routable]
            if not ready:
                self.pending.append(r)
            elif role is Role.PREFILL:
                w = min(ready, key=lambda w: (self.backlog(w, t), w.index))
                w.queue.append(r)
                self.next_prefill(w, t)
            else:
                w = min(ready, key=lambda w: (len(w.batch) + len(w.waiting), w.index))
                w.waiting.append(r)
                if not w.stepping:
                    w.stepping = True
                    self.at(t, w, self.step, w)

    def backlog(self, w: Worker, t: float) -> float:
        """Prompt tokens `w` has still to prefill."""
        head = 0.0 if w.head is None else \
            max(0.0, w.head.prompt - (t - w.head_start_s) * self.hw.prefill_tokens_per_s)
        return head + sum(r.prompt for r in w.queue)

    def next_prefill(self, w: Worker, t: float) -> None:
        if w.head is None and w.queue and w.routable:
            w.head, w.head_start_s = w.queue.popleft(), t
            self.at(t + w.head.prompt / self.hw.prefill_tokens_per_s, w, self.prefilled, w, w.head)

    def prefilled(self, w: Worker, r: Request, t: float) -> None:
        r.first_token_s, w.head = t, None
        w.prefilled += r.prompt
        self.at(t + self.hw.transfer_s, None, self.route, (r,))
        self.next_prefill(w, t)

    def step(self, w: Worker, t: float) -> None:
        w.step_count += 1  # the step that just ended gave each sequence a token (none: idle)
        w.decoded += len(w.batch)
        for r in w.finishing.pop(w.step_count, ()):
            r.done_s = t
            del w.batch[r.index]
            w.kv_used -= blocks(r)
        while w.routable and w.waiting and len(w.batch) < self.hw.max_batch:
            r = w.waiting[0]
            if w.batch and w.kv_used + blocks(r) > self.kv_blocks:
                break
            w.waiting.popleft()
            w.kv_used += blocks(r)
            w.batch[r.index] = r
            r.finish_step = w.step_count + r.remaining
            w.finishing.setdefault(r.finish_step, []).append(r)
        w.stepping = bool(w.batch)
        if w.stepping:
            self.at(t + self.hw.decode_base_s + self.hw.decode_per_seq_s * len(w.batch), w,
                    self.step, w)

    def start_switch(self, w: Worker, role: Role, t: float) -> None:
        w.switch_to = role
        queued, w.queue, w.waiting = [*w.queue, *w.waiting], deque(), deque()
        self.route(queued, t)  # what it has not started goes to peers now
        self.at(t + self.hw.drain_s, w, self.switched, w)

    def switched(self, w: Worker, t: float) -> None:
        role = w.switch_to
        assert role is not None
        self.evict(w, t)  # still unroutable: nothing comes back to it
        w.role, w.switch_to, w.epoch = role, None, w.epoch + 1
        self.recover(w, t)

    def evict(self, w: Worker, t: float) -> None:
        """Move what `w` holds to its peers (a prefill starts over) and void its events."""
        for r in w.batch.values():
            r.remaining = r.finish_step - w.step_count
        held = [*([w.head] if w.head else []), *w.queue, *w.waiting, *w.batch.values()]
        w.gen, w.head, w.queue, w.waiting = w.gen + 1, None, deque(), deque()
        w.batch, w.finishing, w.kv_used, w.rates, w.stepping = {}, {}, 0, deque(), False
        self.route(held, t)

    def fail(self, w: Worker, t: float) -> None:
        w.alive, w.switch_to = False, None  # a role change under way fails with it
        self.evict(w, t)

    def recover(self, w: Worker, t: float) -> None:
        w.epoch, w.alive = w.epoch + (not w.alive), True  # back from the dead: a new epoch
        pending, self.pending = list(self.pending), deque()
        self.route(pending, t)

    def view(self, w: Worker, t: float) -> RoleView:
        """`w` as the agent's observer would report it."""
        backlog = self.backlog(w, t)
        prefilled = w.prefilled + (0.0 if w.head is None else w.head.prompt
                                   - min(w.head.prompt, backlog))
        w.rates.append((t, prefilled, w.decoded))
        while w.rates[0][0] < t - RATE_WINDOW_S:
            w.rates.popleft()
        span = max(t - w.rates[0][0], 1e-9)
        context = sum(r.prompt + r.output - r.finish_step + w.step_count for r in w.batch.values())
        load = WorkerLoad(num_waiting=len(w.queue) + len(w.waiting),
                          num_running=len(w.batch) + (w.head is not None),
                          num_kv_blocks_used=w.kv_used, num_kv_blocks_total=self.kv_blocks,
                          num_queued_prefill_tokens=round(backlog), num_decoding=len(w.batch),
                          num_context_tokens=context,
                          prefill_tokens_per_s=(prefilled - w.rates[0][1]) / span,
                          decode_tokens_per_s=(w.decoded - w.rates[0][2]) / span,
                          step_model=self.model)
        return RoleView(w.worker_id, w.epoch, w.role, load, ejected=not w.routable)

    def tick(self, t: float) -> None:
        """The agent's tick (agent/role_mover.py): record the signals; every period, at most
        one role change, and none while another is under way."""
        views = [self.view(w, t) for w in self.workers]
        self.history.append(signals := pool_signals(views, t))
        while self.history[0].at_s < t - HISTORY_S:
            self.history.popleft()
        self.splits.append((t, signals.num_prefill, signals.num_decode))
        if t + self.tick_s < self.end_s:
            self.at(t + self.tick_s, None, self.tick)
        if self.cfg is None or any(w.switch_to is not None for w in self.workers) or \
                (self.last_decision_s is not None and t - self.last_decision_s < self.period_s):
            return
        self.last_decision_s = t
        move = plan_rebalance(list(self.history), views, self.last_move_s, t, self.cfg)
        if move is not None:
            self.last_move_s = t
            self.moves.append((t, move))
            self.start_switch(next(w for w in self.workers if w.worker_id == move.worker_id),
                              move.to_role, t)
