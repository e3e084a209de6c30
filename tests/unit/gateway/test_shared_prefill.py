"""The n choices' shared prefill: followers get the leader's route only after its first
token, and nothing (plan on their own) when it ended without one."""

from __future__ import annotations

import asyncio

from gateway.api.shared_prefill import SharedPrefill
from gateway.routing.router import RoutePlan


def test_followers_wait_for_the_leaders_first_token_then_take_its_route():
    async def run() -> None:
        share = SharedPrefill("r-0")
        assert share.leads("r-0") and not share.leads("r-1")
        follower = asyncio.ensure_future(share.route())
        await asyncio.sleep(0.01)
        assert not follower.done()  # no route before the leader's first token
        plan = RoutePlan("decode-1", "prefill-1", 0)
        share.prefilled(plan)
        share.prefilled(None)  # the leader's end later changes nothing
        assert await follower is plan and await share.route() is plan

    asyncio.run(run())


def test_a_leader_that_ends_without_a_token_leaves_followers_to_plan_alone():
    async def run() -> None:
        share = SharedPrefill("r-0")
        follower = asyncio.ensure_future(share.route())
        share.prefilled(None)
        assert await follower is None

    asyncio.run(run())


def test_a_cancelled_follower_does_not_cancel_the_others():
    async def run() -> None:
        share = SharedPrefill("r-0")
        first, second = (asyncio.ensure_future(share.route()) for _ in range(2))
        await asyncio.sleep(0)
        first.cancel()
        share.prefilled(RoutePlan("decode-1", None, 0))
        assert (await second).decode_worker_id == "decode-1"

    asyncio.run(run())
