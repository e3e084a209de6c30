"""Acting ahead of the capacity plan (pure policy): one role move toward the prefill/decode
split that the forecast needs, before the pools' pressure shows it.

The capacity plan (agent/capacity_plan.py) says how many prefill and decode workers the
demand forecast `horizon_s` ahead needs. Workers are added or removed by an autoscaler; what
the agent can do itself is move a role inside the pools it has. Of the n routable workers of
role prefill or decode, the plan's share of prefill workers is

    wanted_prefill = n * desired.prefill / (desired.prefill + desired.decode), rounded
                     (a half to decode: its workers hold the running requests), kept
                     within [min_per_role, n - min_per_role]

and when the pools differ from it, the least loaded worker of the larger-than-wanted role
moves to the other (one move per decision, none within `cooldown_s` of the last move of
either kind: the same guard rails as the reactive rebalancer, agent/rebalance.py, which is
asked first). Workers of role `both` or `colocated` already do both and are left alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agent.capacity_plan import PoolSizes
from agent.rebalance import RebalanceConfig, RoleMove, RoleView, least_loaded
from protocol.messages import Role


def wanted_prefill(desired: PoolSizes, num_workers: int, min_per_role: int) -> int | None:
    """How many of `num_workers` prefill/decode workers the plan wants prefilling (None:
    no split to follow: too few workers, or the plan asks for neither role)."""
    asked = desired.prefill + desired.decode
    if asked <= 0 or num_workers < 2 * min_per_role:
        return None
    share = math.ceil(num_workers * desired.prefill / asked - 0.5)
    return min(max(share, min_per_role), num_workers - min_per_role)


def plan_ahead(desired: PoolSizes | None, views: Sequence[RoleView], last_move_s: float | None,
               now_s: float, cfg: RebalanceConfig) -> RoleMove | None:
    """At most one role change toward the plan's split, or None; side-effect free."""
    if desired is None or (last_move_s is not None and now_s - last_move_s < cfg.cooldown_s):
        return None
    routable = [v for v in views if not v.ejected and v.role in (Role.PREFILL, Role.DECODE)]
    prefill = [v for v in routable if v.role is Role.PREFILL]
    decode = [v for v in routable if v.role is Role.DECODE]
    wanted = wanted_prefill(desired, len(routable), cfg.min_per_role)
    if wanted is None or wanted == len(prefill):
        return None
    donor, taker, pool = ((Role.DECODE, Role.PREFILL, decode) if wanted > len(prefill)
                          else (Role.PREFILL, Role.DECODE, prefill))
    if len(pool) - 1 < cfg.min_per_role:
        return None
    pick = least_loaded(pool)
    return RoleMove(pick.worker_id, pick.epoch, donor, taker,
                    f"capacity plan: {desired.prefill} prefill and {desired.decode} decode "
                    f"workers for the forecast ({desired.reason}); of the {len(routable)} here "
                    f"{wanted} should prefill, {len(prefill)} do; {pick.worker_id} is the "
                    f"least loaded {donor.value} worker")
