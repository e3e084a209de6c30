"""The memory `pdserve up` gives each worker when the operator names none (pure, but for
reading /proc/meminfo).

    --kv-cache-mb        CPU workers: a share of the memory available at start, split among
                         the workers (on CUDA the worker sizes its pool from the GPU's memory)
    --gpu-memory-fraction  CUDA workers, when no --kv-cache-mb is given: GPU_MEMORY_SHARE of
                         the device split among the workers on it; each sizes its KV pool
                         from that budget after its weights and measured activations
                         (engine/memory_plan.py)
    --kv-host-cache-gb   CUDA workers: a share of the memory available at start for the host
                         KV tier (engine/host_kv_tier.py), split among them; CPU workers: 0
                         (their device pool is host memory already: memory spent on a tier
                         is better spent on --kv-cache-mb, and CI keeps its memory small)
"""

from __future__ import annotations

GPU_MEMORY_SHARE = 0.9  # of each GPU, for all the workers on it (weights, activations, KV)
CPU_KV_MEMORY_SHARE = 0.15  # of MemAvailable at start, for all the workers' KV caches
HOST_TIER_MEMORY_SHARE = 0.25  # of MemAvailable at start, for all the CUDA workers' host tiers
MAX_HOST_TIER_GB = 64.0  # per worker: a larger tier rarely pays for its pinned memory


def cpu_kv_cache_mb(num_workers: int, mem_available_bytes: int | None) -> int:
    """Each CPU worker's KV cache: a share of the memory available, 256..4096 MiB (pure)."""
    if not mem_available_bytes:
        return 256  # unknown: the worker's own default
    share = int(mem_available_bytes * CPU_KV_MEMORY_SHARE / max(1, num_workers)) >> 20
    return max(256, min(4096, share))


def gpu_memory_fractions(devices: list[str]) -> list[float | None]:
    """Each worker's share of its GPU (pure): GPU_MEMORY_SHARE split evenly among the workers
    on that device; None for a CPU worker."""
    counts: dict[str, int] = {}
    for device in devices:
        counts[device] = counts.get(device, 0) + 1
    return [None if device == "cpu" else round(GPU_MEMORY_SHARE / counts[device], 4)
            for device in devices]


def host_kv_cache_gb(devices: list[str], mem_available_bytes: int | None) -> float:
    """Each worker's host KV tier in GiB, one tenth of a GiB at the finest (pure): a share
    of the memory available over the CUDA workers, up to MAX_HOST_TIER_GB; 0 (off) when
    a worker runs on the CPU or the memory available is unknown."""
    if not devices or not mem_available_bytes or any(d == "cpu" for d in devices):
        return 0.0
    share = mem_available_bytes * HOST_TIER_MEMORY_SHARE / len(devices) / (1 << 30)
    return min(MAX_HOST_TIER_GB, int(share * 10) / 10)


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
