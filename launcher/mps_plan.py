"""What `pdserve up` asks of CUDA MPS: which GPUs are shared, each worker's environment.

`plan_mps` (side-effect free but for PATH and device lookups) decides whether a daemon is
needed; `mps_setup` builds it (not started) with each worker's share (launcher/mps.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.mps import GpuShare, MpsDaemon, MpsWorker
from protocol.messages import Role



@dataclass(frozen=True, slots=True)
class MpsPlan:
    binary: str  # nvidia-cuda-mps-control
    shares: list[GpuShare]  # the shared GPUs
    workers: list[MpsWorker]  # by worker position


@dataclass(frozen=True, slots=True)
class MpsSetup:
    daemon: MpsDaemon
    worker_envs: list[dict[str, str]]  # by worker position
    lines: list[str]  # one per shared GPU, for the operator


def plan_mps(roles: Sequence[Role], names: Sequence[str], devices: Sequence[str],
              sm_share: dict[str, int]) -> MpsPlan | None:
    """What MPS is to do, when some GPU has several workers and nvidia-cuda-mps-control is
    on PATH; else None. Raises ValueError when --sm-share does not fit the workers."""
    from launcher.mps import find_control_binary, gpu_index, plan_gpu_shares

    if not any(gpu_index(device) is not None for device in devices):
        return None
    binary = find_control_binary(os.environ.get("PATH"))
    if binary is None:
        return None
    workers = [MpsWorker(name, role.value, device)
               for role, name, device in zip(roles, names, devices)]
    shares = plan_gpu_shares(workers, sm_share)
    return MpsPlan(binary, shares, workers) if shares else None


def mps_setup(plan: MpsPlan, log_dir: Path) -> MpsSetup:
    """The daemon (not started yet), each worker's environment, the lines to print; asks
    nvidia-smi for each shared GPU's memory (without it: no memory limit, and the line
    says why)."""
    from launcher.mps import (VISIBLE_DEVICES_ENV, MpsDaemon, MpsError, describe, mps_root,
                              query_total_memory_mib, smi_device_id, worker_envs)

    daemon = MpsDaemon(plan.binary, mps_root(log_dir))
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    totals: dict[int, int] = {}
    lines = []
    for share in plan.shares:
        problem = None
        try:
            totals[share.gpu_index] = query_total_memory_mib(
                smi_device_id(share.gpu_index, visible))
        except MpsError as exc:
            problem = str(exc)
        lines.append(describe(share, plan.workers, totals.get(share.gpu_index), problem))
    envs = worker_envs(len(plan.workers), plan.shares, daemon.env, totals, visible)
    return MpsSetup(daemon, envs, lines)
