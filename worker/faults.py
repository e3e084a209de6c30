"""Faults a test or a drill injects into a running worker; all off unless it asks.

A worker started with `PDSERVE_FAULT_INJECTION=1` in its environment takes a FaultRequest
(protocol/agent_messages.py) over its channel and sets these; without it the request has
no route, and nothing here can change from zero. They are not options of the worker's
command line: production never configures them.

    step_delay_s            every engine step sleeps this long more (a slow worker;
                            applied by the engine thread, engine/engine_thread.py)
    transfer_layer_delay_s  a KV push of a request whose id starts with `request_prefix`
    request_prefix          sleeps this long before each layer (worker/kv_push.py): a
                            transfer stalled past its deadline, or cut mid-way
    fail_steps              the next engine step raises, as on a device error: every stream
                            ends with the error and the worker exits to be restarted
    net                     the control port's network (rpc/net_fault.py: delay, loss,
                            partition), applied by the fault proxy in front of the port
                            (rpc/fault_proxy.py), until it heals by itself
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.agent_messages import FaultRequest
from rpc.net_fault import NO_FAULT, NetFault


# A network fault starts this long after it is set: the answer saying so leaves first.
NET_FAULT_GRACE_S = 0.2


class BadFault(ValueError):
    """A FaultRequest that cannot be set as asked."""


@dataclass(slots=True)
class Faults:
    step_delay_s: float = 0.0
    transfer_layer_delay_s: float = 0.0
    request_prefix: str = ""
    fail_steps: bool = False
    net: NetFault = NO_FAULT

    def delays_push(self, request_id: str) -> bool:
        return self.transfer_layer_delay_s > 0 and request_id.startswith(self.request_prefix)

    def set(self, request: FaultRequest, now_s: float) -> None:
        """Every fault as `request` says (`now_s`: the proxy's monotonic clock); raises
        BadFault, changing nothing, for a network fault without a duration."""
        start_s = now_s + NET_FAULT_GRACE_S
        net = NetFault(request.net_delay_ms / 1000, request.net_loss_ratio,
                       request.net_partition, start_s + request.net_fault_ms / 1000, start_s)
        if net.is_set and not request.net_fault_ms:
            raise BadFault("a network fault needs net_fault_ms: it heals by itself then "
                           "(a partitioned worker cannot be told to heal)")
        self.step_delay_s = request.step_delay_ms / 1000
        self.transfer_layer_delay_s = request.transfer_layer_delay_ms / 1000
        self.request_prefix = request.request_prefix
        self.fail_steps = request.fail_steps
        self.net = net if net.is_set else NO_FAULT

    def describe(self) -> str:
        """One line for the log."""
        line = (f"every engine step sleeps {self.step_delay_s * 1000:.0f} ms more; pushes of "
                f"requests {self.request_prefix!r}* sleep {self.transfer_layer_delay_s * 1000:.0f}"
                f" ms before each layer; steps fail: {self.fail_steps}")
        net = self.net
        if net.is_set:
            line += (f"; the control port's network: delay {net.delay_s * 1000:.0f} ms, loss "
                     f"{100 * net.loss_ratio:.0f}%, partitioned: {net.partition}, until it "
                     "heals")
        return line
