"""The n choices of one prompt share one prefill: the first choice (the leader) is routed
and prefilled; the others (followers) wait for its first token, then go where it went, so
the prompt's KV is found in that worker's prefix cache instead of computed n times.

    leader    plan ──▶ prefill ──▶ first token ──▶ prefilled(plan) ──▶ decode ...
    follower  route() waits ─────────────────────────────▶ the leader's plan ──▶ prefill
              (cache hit: only the prompt's last, partial block is computed) ──▶ decode ...

A leader that ends before its first token (failure, client gone) hands out no plan, and
each follower is planned on its own (the router's prefix affinity still applies). A
follower whose leader's workers left routing meanwhile is planned on its own too
(gateway/upstream/upstream.py decides). Followers resumed after a failure are planned
afresh like any request.

Lifecycle: created per prompt by the handler → the leader's backend calls `prefilled`
once it has a first token or ends (the first call wins) → followers' `route()` return.
Invariant: `route()` returns the plan at most once set, and never before the leader's
first token.
"""

from __future__ import annotations

import asyncio

from gateway.routing.router import RoutePlan


class SharedPrefill:
    def __init__(self, leader_id: str) -> None:
        self.leader_id = leader_id
        self._plan: asyncio.Future[RoutePlan | None] = \
            asyncio.get_running_loop().create_future()

    def leads(self, request_id: str) -> bool:
        return request_id == self.leader_id

    def prefilled(self, plan: RoutePlan | None) -> None:
        """The leader's first token came by `plan` (None: it ended without one)."""
        if not self._plan.done():
            self._plan.set_result(plan)

    async def route(self) -> RoutePlan | None:
        """For a follower: the leader's plan once it has prefilled; None: plan afresh."""
        return await asyncio.shield(self._plan)
