"""Two CUDA streams over two SM partitions of one GPU: the prefill lane's and the decodes'.

A green context (CUDA 12.4+, `torch.cuda.green_contexts`) holds a share of the device's SMs;
kernels queued on its stream run only there, CUDA graph replays included. The prefill lane
(engine/prefill_lane.py) queues prompt chunks on one, the engine's decode steps run on the
other, so a decode step does not wait behind a chunk's kernels and the chunk takes the SMs
the decodes do not. Measured on one H100 (132 SMs) with a 2048-token GEMM beside a batch-64
decode GEMV: a 66 + 66 split slowed the decode pass 1.07x and the GEMM 1.61x against each
alone on the whole GPU; the same GEMM confined to 66 SMs beside a decode on the whole GPU
slowed the decode 1.55x; on two plain streams the decode pass kept its speed (1.00x) and
the GEMM took 1.14x (one probe, not kept in the repository).

`shared_lane_streams` makes the other arrangement the probe points to: two plain streams over
every SM, the decode steps' at the higher priority, so the block scheduler hands a freed SM to
a waiting decode kernel before the lane's next block (`--prefill-lane shared`).

Without green contexts (an older driver or torch, or no CUDA) `lane_streams` returns None and
says why in one log line: the engine then computes prompts in its decode steps (chunked
prefill, time-sliced) as a worker without a lane does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_SMS = 8  # neither side gets fewer SMs than this


@dataclass(frozen=True, slots=True)
class LaneStreams:
    decode: torch.cuda.Stream  # the engine's steps (decodes, and what the lane does not take)
    lane: torch.cuda.Stream  # the prefill lane's steps
    lane_sms: int
    decode_sms: int
    contexts: tuple[object, ...]  # the green contexts, alive as long as their streams


def split_sms(total_sms: int, lane_sms: int) -> tuple[int, int]:
    """Pure policy: (lane, decode) SM counts for a requested lane share, each at least
    MIN_SMS and together the device's."""
    if total_sms < 2 * MIN_SMS:
        raise ValueError(f"a device of {total_sms} SMs cannot be split into two of "
                         f"{MIN_SMS} or more")
    lane = min(max(lane_sms, MIN_SMS), total_sms - MIN_SMS)
    return lane, total_sms - lane


def lane_sms(asked: int | None, device: str) -> int:
    """The lane's SMs for `EngineConfig.prefill_lane_sms`: `asked` (None: auto, half the
    GPU's SMs on CUDA and no lane elsewhere; 0: no lane)."""
    if asked is not None:
        return asked
    if not device.startswith("cuda"):
        return 0
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count // 2


def shared_lane_streams(device: torch.device) -> LaneStreams:
    """Two plain streams on `device` (CUDA) sharing all of its SMs: the decode steps' at the
    device's highest stream priority, the lane's at the default (lowest) one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    # A lower number is a higher priority; torch maps one past the device's range to its end.
    streams = LaneStreams(decode=torch.cuda.Stream(device=index, priority=-100),
                          lane=torch.cuda.Stream(device=index, priority=0),
                          lane_sms=total, decode_sms=total, contexts=())
    log.info("prefill lane: shares all %d SMs with the decode steps, which run at the higher "
             "stream priority", total)
    return streams


def lane_streams(device: torch.device, lane_sms: int) -> LaneStreams | None:
    """A green-context stream of `lane_sms` SMs for the lane and one of the rest for the
    decodes; None (logged) where green contexts cannot be made on `device`."""
    if device.type != "cuda":
        return None
    from torch.cuda import green_contexts

    if not green_contexts.SUPPORTED:
        log.warning("prefill lane off: this torch has no CUDA green contexts; prompts are "
                    "computed in the decode steps (chunked prefill)")
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    lane, decode = split_sms(total, lane_sms)
    try:
        lane_ctx = green_contexts.GreenContext.create(num_sms=lane, device_id=index)
        decode_ctx = green_contexts.GreenContext.create(num_sms=decode, device_id=index)
        streams = LaneStreams(decode=decode_ctx.Stream(), lane=lane_ctx.Stream(),
                              lane_sms=lane, decode_sms=decode,
                              contexts=(lane_ctx, decode_ctx))
    except RuntimeError as error:  # the driver refused (too old, MIG, MPS limits, ...)
        log.warning("prefill lane off: no green contexts on cuda:%d (%s); prompts are "
                    "computed in the decode steps (chunked prefill)", index, error)
        return None
    log.info("prefill lane: %d of %d SMs for prompts, %d for decode steps", lane, total, decode)
    return streams
