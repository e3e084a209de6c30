"""The faults a drill can inject, and which of them a cluster's layout allows (pure).

    kill-prefill, kill-decode   SIGKILL of one worker: `pdserve up` starts it again; the
                                gateway retries or migrates what it held
    stop-prefill, stop-decode   SIGSTOP of one worker, left stopped until the agent acts (it
                                finds it hung, ejects it and has it restarted)
    slow-decode                 every engine step of one decode worker sleeps --slow-step-ms
                                more (a FaultRequest), until the agent ejects it
    stall-transfer              every layer a prefill worker pushes waits --stall-layer-ms
                                (a FaultRequest) for --fault-s: transfers stall mid-way
    fail-decode, fail-prefill   the next engine step of one worker raises (a FaultRequest; a
                                stand-in for a device error): its streams end with the error,
                                the worker exits and `pdserve up` starts it again
    delay-decode                one decode worker's control port (every caller: gateways, the
                                agent, prefill peers) gets --net-delay-ms each way and loses
                                --net-loss of its chunks (each sent again 200 ms late), for
                                --fault-s (rpc/fault_proxy.py; the KV data path is stall-transfer's)
    partition-decode,           one worker's control port is cut off from every caller for
    partition-prefill           --fault-s; its Redis heartbeats go on: the agent finds its
                                control API dead, ejects it and has it restarted
    kill-agent, kill-redis      SIGKILL of the operations agent or of Redis: the supervisor
                                starts them again
    kill-gateway                SIGKILL of one of several gateway replicas (--gateways 2)
    stop-agent, stop-redis,     SIGSTOP of the agent, of Redis or of one gateway replica:
    stop-gateway                `pdserve up` finds it frozen (no heartbeat; no PONG), kills it
                                and starts it again (launcher/liveness.py)

A worker target is a role group: "decode" is any worker that decodes (decode, both,
colocated), "prefill" any that prefills (prefill, both). A scenario is allowed when its
target exists, its faults can be set (fault injection on, the cluster's token known) and
its process can be signalled (this host); `peers` says whether another worker of the group
remains, which decides whether failed requests are excused (docs/operations.md, "Drills").
"""

from __future__ import annotations

import enum

import msgspec


class FaultKind(enum.StrEnum):
    KILL = "kill"
    STOP = "stop"
    SLOW = "slow"
    STALL = "stall"
    FAIL = "fail"
    DELAY = "delay"  # the control port's network, delayed and lossy
    PARTITION = "partition"  # the control port's network, cut


class Target(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    AGENT = "agent"
    REDIS = "redis"
    GATEWAY = "gateway"

    @property
    def is_worker(self) -> bool:
        return self in (Target.PREFILL, Target.DECODE)


# Faults set through a FaultRequest (worker/faults.py), not a signal.
SET_FAULTS = frozenset({FaultKind.SLOW, FaultKind.STALL, FaultKind.FAIL, FaultKind.DELAY,
                        FaultKind.PARTITION})
# Faults that stay on for --fault-s: lifted (or healed by themselves) then.
TIMED_FAULTS = frozenset({FaultKind.STALL, FaultKind.DELAY, FaultKind.PARTITION})

# The worker roles (protocol.messages.Role values) each worker target covers.
TARGET_ROLES = {Target.PREFILL: frozenset({"prefill", "both"}),
                Target.DECODE: frozenset({"decode", "both", "colocated"})}


class Scenario(msgspec.Struct, frozen=True):
    name: str
    fault: FaultKind
    target: Target
    expects_ejection: bool  # recovery counts only once the agent took the worker out


SCENARIOS = (
    Scenario("kill-decode", FaultKind.KILL, Target.DECODE, False),
    Scenario("kill-prefill", FaultKind.KILL, Target.PREFILL, False),
    Scenario("stop-decode", FaultKind.STOP, Target.DECODE, True),
    Scenario("stop-prefill", FaultKind.STOP, Target.PREFILL, True),
    Scenario("slow-decode", FaultKind.SLOW, Target.DECODE, True),
    Scenario("stall-transfer", FaultKind.STALL, Target.PREFILL, False),
    Scenario("fail-decode", FaultKind.FAIL, Target.DECODE, False),
    Scenario("fail-prefill", FaultKind.FAIL, Target.PREFILL, False),
    Scenario("delay-decode", FaultKind.DELAY, Target.DECODE, False),
    Scenario("partition-decode", FaultKind.PARTITION, Target.DECODE, True),
    Scenario("partition-prefill", FaultKind.PARTITION, Target.PREFILL, True),
    Scenario("kill-agent", FaultKind.KILL, Target.AGENT, False),
    Scenario("kill-redis", FaultKind.KILL, Target.REDIS, False),
    Scenario("kill-gateway", FaultKind.KILL, Target.GATEWAY, False),
    Scenario("stop-agent", FaultKind.STOP, Target.AGENT, False),
    Scenario("stop-redis", FaultKind.STOP, Target.REDIS, False),
    Scenario("stop-gateway", FaultKind.STOP, Target.GATEWAY, False),
)
BY_NAME = {s.name: s for s in SCENARIOS}


class Layout(msgspec.Struct, frozen=True):
    """What the drill found of the cluster before its first scenario."""

    roles: list[str]  # one per worker
    num_gateways: int
    has_agent: bool
    has_redis: bool  # a Redis the supervisor started (and restarts)
    can_set_faults: bool  # fault injection on and the cluster's token known
    has_local_processes: bool  # the workers are children of one `pdserve up` on this host


def num_in_group(layout: Layout, target: Target) -> int:
    return sum(role in TARGET_ROLES[target] for role in layout.roles)


def why_not(scenario: Scenario, layout: Layout) -> str | None:
    """None when the layout allows `scenario`, else why not; pure."""
    target = scenario.target
    if target.is_worker and num_in_group(layout, target) == 0:
        return f"no {target.value} worker"
    if scenario.fault in (FaultKind.KILL, FaultKind.STOP) and not layout.has_local_processes:
        return "its processes are not children of a `pdserve up` on this host"
    if scenario.fault in SET_FAULTS and not layout.can_set_faults:
        return "faults cannot be set (fault injection off, or the cluster's token unknown)"
    if scenario.fault is FaultKind.SLOW and num_in_group(layout, target) < 2:
        return "the agent finds a worker slow only against a peer of its role"
    if scenario.fault is FaultKind.STALL and num_in_group(layout, Target.DECODE) == 0:
        return "no decode worker to push to"
    if target is Target.AGENT and not layout.has_agent:
        return "no operations agent"
    if target is Target.REDIS and not layout.has_redis:
        return "Redis was not started by this `pdserve up`"
    if target is Target.GATEWAY and layout.num_gateways < 2:
        return "one gateway: losing it is an outage, not a drill (--gateways 2)"
    return None


def has_peer(scenario: Scenario, layout: Layout) -> bool:
    """Whether the cluster keeps another process doing the target's job; pure."""
    if scenario.target.is_worker:
        return num_in_group(layout, scenario.target) >= 2
    return scenario.target is not Target.GATEWAY or layout.num_gateways >= 2


def select(names: list[str] | None, layout: Layout) -> tuple[list[Scenario], list[str]]:
    """The scenarios to run, in the table's order, and a line per one left out; pure.
    `names` None: every scenario the layout allows. Raises ValueError for an unknown name
    or a named scenario the layout does not allow."""
    if names is None:
        chosen = [s for s in SCENARIOS if why_not(s, layout) is None]
        return chosen, [f"{s.name}: {why}" for s in SCENARIOS
                        if (why := why_not(s, layout)) is not None]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown} (known: {', '.join(BY_NAME)})")
    refused = [f"{n}: {why}" for n in names if (why := why_not(BY_NAME[n], layout))]
    if refused:
        raise ValueError("not possible on this cluster: " + "; ".join(refused))
    return [BY_NAME[n] for n in names], []
