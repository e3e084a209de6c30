"""Control messages the operations agent sends to a worker (msgpack envelopes, like
protocol/messages.py's), over the worker's token-guarded channel:

    HealthRequest -> HealthReport
        how the worker is doing, from its own counters: the agent's one source of a
        worker's health (its load, its steps, its requests and failures)
    ReclaimRequest -> ReclaimResponse   (decode-capable workers)
        free every reservation older than `older_than_ms` that no decode request joined:
        what a gateway stuck between reserve and decode leaves behind (one that died
        closed its channel, which freed them)
    ExitRequest -> ExitResponse
        answer, then exit with EXIT_CODE_RESTART at once (no drain): how the agent restarts
        a worker whose orchestrator restarts exited containers (compose)
    FaultRequest -> FaultResponse
        fault injection for tests and drills (worker/faults.py): only taken when the worker
        was started with PDSERVE_FAULT_INJECTION=1 in its environment (else BAD_REQUEST:
        the worker has no route for it)

And one the agent sends to its supervisor (`pdserve up`), not to a worker, over the line
only the two of them hold (launcher/restart_line.py):

    RestartWorkerRequest -> RestartWorkerResponse
        restart the worker process the supervisor started under `worker_id`, by the
        supervisor's own handle of it; `pid` (from the worker's bound registry entry) must
        be the process it runs now, else it was restarted already and nothing is killed
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from protocol.messages import Message, WorkerId
from protocol.worker_load import WorkerLoad

EXIT_CODE_RESTART = 75  # EX_TEMPFAIL: "restart me", not a crash of the worker's own
EXIT_CODE_ENGINE_FAILED = 70  # EX_SOFTWARE: its engine failed a step; the process cannot serve
FAULT_INJECTION_ENV = "PDSERVE_FAULT_INJECTION"
MAX_FAULT_DELAY_MS = 10_000
MAX_NET_FAULT_MS = 120_000
Reason = Annotated[str, msgspec.Meta(max_length=1024)]


NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class HealthRequest(Message, tag="health_request", frozen=True, kw_only=True):
    pass


class HealthReport(Message, tag="health_report", frozen=True, kw_only=True):
    """A worker's counters since it started (this process, its every epoch), and its load
    now. Deltas between two reports of one epoch say how the worker did meanwhile."""

    epoch: Count
    load: WorkerLoad  # the snapshot it publishes with its heartbeat
    num_steps: Count  # engine steps
    step_sum_s: NonNegFloat  # their time
    num_decode_steps: Count  # steps that only decoded (comparable across workers)
    decode_sum_s: NonNegFloat
    decode_seqs: NonNegFloat  # their sequences and context tokens, summed
    decode_context: NonNegFloat
    num_requests: Count  # requests ended, in all
    num_failed: Count  # of those, ended by an error
    # The KV handoff (root-cause reports, agent/root_cause.py); 0 from an older worker.
    num_kv_waits: Count = 0  # reservations that waited in line for free KV blocks
    num_kv_waiting: Count = 0  # ... waiting now
    num_transfers_mapped: Count = 0  # KV pushes completed through the mapped pool (fast)
    num_transfers_carrier: Count = 0  # ... through a carrier (UCX or TCP: the fallback)
    transfer_sum_s: NonNegFloat = 0.0  # their time
    num_transfer_failures: Count = 0  # pushes and receives that failed
    # Wall time of the engine's decode-only steps (0 from an older worker): above the
    # device's time (`decode_sum_s`, CUDA events) where the host feeds the device late.
    num_decode_walls: Count = 0
    decode_wall_sum_s: NonNegFloat = 0.0


class ReclaimRequest(Message, tag="reclaim_request", frozen=True, kw_only=True):
    older_than_ms: Annotated[int, msgspec.Meta(ge=1000, le=3_600_000)]


class ReclaimResponse(Message, tag="reclaim_response", frozen=True, kw_only=True):
    num_reclaimed: Annotated[int, msgspec.Meta(ge=0)]
    request_ids: Annotated[list[Reason], msgspec.Meta(max_length=4096)] = []


class ExitRequest(Message, tag="exit_request", frozen=True, kw_only=True):
    reason: Reason = ""
    # The registry epoch the agent judged. A process that never registered it refuses with
    # stale_epoch: an orchestrator that restarts a container keeps its address (and, PID
    # namespaces being per container, often its worker id), so the exit meant for a dead
    # process would reach its replacement. None: whatever process answers exits.
    epoch: Annotated[int, msgspec.Meta(ge=0)] | None = None


class ExitResponse(Message, tag="exit_response", frozen=True, kw_only=True):
    pid: Annotated[int, msgspec.Meta(ge=0)]


FaultDelayMs = Annotated[int, msgspec.Meta(ge=0, le=MAX_FAULT_DELAY_MS)]


class FaultRequest(Message, tag="fault_request", frozen=True, kw_only=True):
    """Sets every fault at once (0 turns one off): see worker/faults.py."""

    step_delay_ms: FaultDelayMs = 0
    transfer_layer_delay_ms: FaultDelayMs = 0
    request_prefix: Reason = ""  # the pushes `transfer_layer_delay_ms` delays
    fail_steps: bool = False  # the next engine step raises (a device error): the worker exits
    # The control port's network (rpc/net_fault.py), for `net_fault_ms`, then it heals by
    # itself: a partitioned worker cannot be told to heal. Taken by a worker whose control
    # port has a fault proxy in front (started with fault injection on).
    net_delay_ms: FaultDelayMs = 0
    net_loss_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    net_partition: bool = False
    net_fault_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_NET_FAULT_MS)] = 0


class FaultResponse(Message, tag="fault_response", frozen=True, kw_only=True):
    step_delay_ms: int
    transfer_layer_delay_ms: int = 0
    fail_steps: bool = False
    net_fault_ms: int = 0  # how long the network fault set lasts (0: none set)


class RestartStatus(enum.StrEnum):
    KILLED = "killed"  # its process group got SIGKILL; the supervisor starts it again
    GONE = "gone"  # that process exited already (or was replaced): nothing to kill
    REFUSED = "refused"  # not a worker this supervisor started, or not now


class RestartWorkerRequest(Message, tag="restart_worker_request", frozen=True, kw_only=True):
    number: Annotated[int, msgspec.Meta(ge=0)]  # echoed: a late answer is told apart
    worker_id: WorkerId
    pid: Count = 0  # the process the agent saw (0: any)
    reason: Reason = ""


class RestartWorkerResponse(Message, tag="restart_worker_response", frozen=True, kw_only=True):
    number: Annotated[int, msgspec.Meta(ge=0)]
    status: RestartStatus
    outcome: Reason  # one line for the audit trail
