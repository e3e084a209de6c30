"""Hitting one process of the cluster, and lifting what the drill set.

    inject(...)  picks the victim (the last worker of the target's role group by id, the
                 agent, Redis, the last gateway replica) and hits it: SIGKILL, SIGSTOP or
                 a FaultRequest (worker/faults.py: slow steps, stalled pushes, failing
                 steps, its control port's network delayed or cut)
    lift(...)    clears a FaultRequest the drill set (on the same process, if it still
                 runs) and sends SIGCONT to a process the drill stopped, if it is still
                 there: called once per scenario, whatever happened, so nothing is left
                 slowed or stopped behind a drill
"""

from __future__ import annotations

import msgspec

from drill import processes
from drill.recovery import Victim
from drill.scenario import TARGET_ROLES, FaultKind, Scenario, Target
from drill.target_cluster import TargetCluster, WorkerRow
from protocol.agent_messages import FaultRequest
from rpc.errors import ControlError, RemoteError


class FaultSettings(msgspec.Struct, frozen=True):
    slow_step_ms: int  # slow-decode: added to every engine step
    stall_layer_ms: int  # stall-transfer: before each layer pushed
    net_delay_ms: int = 0  # delay-decode: each way
    net_loss_ratio: float = 0.0  # delay-decode: chunks sent again 200 ms late
    net_fault_ms: int = 0  # delay-* and partition-*: how long, then it heals by itself


def pick_worker(scenario: Scenario, workers: list[WorkerRow]) -> WorkerRow:
    group = sorted((w for w in workers if w.role in TARGET_ROLES[scenario.target]
                    and w.state == "ready" and w.pid), key=lambda w: w.id)
    if not group:
        raise RuntimeError(f"{scenario.name}: no ready {scenario.target.value} worker")
    return group[-1]


def process_pids(target: Target, supervisor_pid: int) -> list[int]:
    if target is Target.AGENT:
        return processes.agent_pids(supervisor_pid)
    if target is Target.REDIS:
        return processes.redis_pids(supervisor_pid)
    return processes.gateway_pids(supervisor_pid)


async def inject(cluster: TargetCluster, scenario: Scenario, workers: list[WorkerRow],
                 supervisor_pid: int | None, settings: FaultSettings) -> Victim:
    if not scenario.target.is_worker:
        if supervisor_pid is None:
            raise RuntimeError(f"{scenario.name}: `pdserve up` is not on this host")
        pids = process_pids(scenario.target, supervisor_pid)
        if not pids:
            raise RuntimeError(f"{scenario.name}: no {scenario.target.value} process found")
        pid = pids[-1]
        if scenario.fault is FaultKind.STOP:
            processes.stop(pid)
        else:
            processes.kill(pid)
        return Victim(f"{scenario.target.value} (pid {pid})", pid)
    worker = pick_worker(scenario, workers)
    if scenario.fault in (FaultKind.KILL, FaultKind.STOP) and not processes.runs_worker(
            worker.pid or 0, worker.id):
        raise RuntimeError(f"{scenario.name}: pid {worker.pid} is not {worker.id} on this host")
    victim = Victim(f"{worker.id} (pid {worker.pid})", worker.pid, worker.id, worker.epoch)
    if scenario.fault is FaultKind.KILL:
        processes.kill(worker.pid or 0)
    elif scenario.fault is FaultKind.STOP:
        processes.stop(worker.pid or 0)
    elif scenario.fault is FaultKind.SLOW:
        await cluster.set_fault(worker, FaultRequest(step_delay_ms=settings.slow_step_ms))
    elif scenario.fault is FaultKind.FAIL:
        await cluster.set_fault(worker, FaultRequest(fail_steps=True))
    elif scenario.fault is FaultKind.DELAY:
        await cluster.set_fault(worker, FaultRequest(
            net_delay_ms=settings.net_delay_ms, net_loss_ratio=settings.net_loss_ratio,
            net_fault_ms=settings.net_fault_ms))
    elif scenario.fault is FaultKind.PARTITION:
        await cluster.set_fault(worker, FaultRequest(net_partition=True,
                                                     net_fault_ms=settings.net_fault_ms))
    else:
        await cluster.set_fault(worker, FaultRequest(
            transfer_layer_delay_ms=settings.stall_layer_ms))
    return victim


async def lift(cluster: TargetCluster, scenario: Scenario, victim: Victim) -> None:
    """Undo what the drill set on the victim, when it is still the process hit."""
    if scenario.fault is FaultKind.STOP and victim.pid and processes.state(victim.pid) == "T":
        processes.cont(victim.pid)
    if scenario.fault not in (FaultKind.SLOW, FaultKind.STALL, FaultKind.DELAY):
        return  # a partition heals by itself (nothing could reach the worker to lift it)
    for worker in await cluster.workers() or []:
        if worker.id == victim.worker_id and worker.epoch == victim.epoch:
            try:
                await cluster.set_fault(worker, FaultRequest())
            except (ControlError, RemoteError, TimeoutError):
                pass  # gone meanwhile: a new process starts without faults
