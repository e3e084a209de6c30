"""A degraded network, as a drill sets it on one worker's control port: when each chunk of
bytes may leave (pure; rpc/fault_proxy.py moves the bytes).

What `tc netem` does to an interface's traffic, for one TCP connection's byte stream:

    delay      every chunk leaves `delay_s` after it came
    loss       a chunk is lost with probability `loss_ratio` and sent again after TCP's
               minimum retransmission timeout (RETRANSMIT_S): it, and everything behind
               it, is late by that much (a byte stream stays in order)
    partition  nothing leaves until the partition heals; what came meanwhile is held and
               leaves then, as TCP would retransmit it (a caller whose deadline passed
               has closed its connection by then)

A fault starts at `from_s` and heals by itself at `until_s` (the proxy's monotonic clock):
a partitioned worker cannot be told to heal, because the telling would cross the partition
too, and the answer to the request that set the fault leaves before it starts.

Invariant: release times of one direction never decrease (`release_at(..., previous)` is
at least `previous`): bytes leave in the order they came.
"""

from __future__ import annotations

from dataclasses import dataclass

RETRANSMIT_S = 0.2  # Linux's minimum TCP retransmission timeout


@dataclass(frozen=True, slots=True)
class NetFault:
    delay_s: float = 0.0
    loss_ratio: float = 0.0
    partition: bool = False
    until_s: float = 0.0  # heals then (monotonic seconds); 0 with nothing set: no fault
    from_s: float = 0.0  # starts then

    def __post_init__(self) -> None:
        if self.delay_s < 0 or not 0 <= self.loss_ratio <= 1 or \
                not 0 <= self.from_s <= self.until_s:
            raise ValueError(f"not a network fault: {self}")

    @property
    def is_set(self) -> bool:
        return self.delay_s > 0 or self.loss_ratio > 0 or self.partition

    def active(self, now_s: float) -> bool:
        return self.is_set and self.from_s <= now_s < self.until_s


NO_FAULT = NetFault()


def release_at(fault: NetFault, now_s: float, previous_s: float, draw: float) -> float:
    """When a chunk that came at `now_s` leaves, the one before it having left (or being
    due) at `previous_s`; `draw` is uniform in [0, 1) (a loss when below the ratio)."""
    if not fault.active(now_s):
        return max(now_s, previous_s)
    due = now_s + fault.delay_s + (RETRANSMIT_S if draw < fault.loss_ratio else 0.0)
    if fault.partition:
        due = max(due, fault.until_s)
    return max(due, previous_s)
