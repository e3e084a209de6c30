"""What a FaultRequest sets on a worker: every fault at once, a network fault only with a
duration (it heals by itself), and nothing changed by a request refused."""

from __future__ import annotations

import pytest

from protocol.agent_messages import FaultRequest
from rpc.net_fault import NO_FAULT
from worker.faults import NET_FAULT_GRACE_S, BadFault, Faults


def test_a_request_sets_every_fault_and_an_empty_one_clears_them() -> None:
    faults = Faults()
    faults.set(FaultRequest(step_delay_ms=500, transfer_layer_delay_ms=300,
                            request_prefix="chatcmpl-", net_delay_ms=100, net_loss_ratio=0.05,
                            net_fault_ms=8000), now_s=10.0)
    assert (faults.step_delay_s, faults.transfer_layer_delay_s) == (0.5, 0.3)
    assert faults.delays_push("chatcmpl-1") and not faults.delays_push("cmpl-1")
    net = faults.net
    assert (net.delay_s, net.loss_ratio, net.partition) == (0.1, 0.05, False)
    # It starts once the answer left and heals by itself, fault_ms later.
    assert net.from_s == 10.0 + NET_FAULT_GRACE_S and net.until_s == net.from_s + 8.0
    assert not net.active(10.0) and net.active(net.from_s) and not net.active(net.until_s)
    assert "delay 100 ms, loss 5%" in faults.describe()
    faults.set(FaultRequest(), now_s=11.0)
    assert faults == Faults()


def test_a_network_fault_without_a_duration_is_refused_and_changes_nothing() -> None:
    faults = Faults()
    faults.set(FaultRequest(step_delay_ms=200), now_s=0.0)
    with pytest.raises(BadFault, match="net_fault_ms"):
        faults.set(FaultRequest(net_partition=True), now_s=1.0)
    assert faults.step_delay_s == 0.2 and faults.net is NO_FAULT
