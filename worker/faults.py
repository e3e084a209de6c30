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
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Faults:
    step_delay_s: float = 0.0
    transfer_layer_delay_s: float = 0.0
    request_prefix: str = ""
    fail_steps: bool = False

    def delays_push(self, request_id: str) -> bool:
        return self.transfer_layer_delay_s > 0 and request_id.startswith(self.request_prefix)
