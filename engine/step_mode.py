"""How an engine thread steps its engine: the choice a worker's `--pipelined-steps` makes.

    PLAIN       every output of a step is made before the next step is planned
    PIPELINED   the text of a step's tokens is made during the next step, while the device
                computes it (engine/output_processor.py)
    OVERLAPPED  the next step is also planned and queued before this step's tokens reach
                the host (engine/inflight_step.py); needs a runner that reads tokens on the
                device (not tensor parallelism)

`choose_step_mode` is the policy: a pure function of the option and the device.
"""

from __future__ import annotations

import enum


class StepMode(enum.Enum):
    PLAIN = "off"
    PIPELINED = "on"
    OVERLAPPED = "overlap"


STEP_MODE_CHOICES = ("auto", "on", "off", "overlap")


def choose_step_mode(option: str, device: str) -> StepMode:
    """`option` is one of STEP_MODE_CHOICES. auto, on CUDA: OVERLAPPED, for every role
    (measured against PIPELINED on one H200: docs/benchmark_journal.md "Overlapped steps" for the
    decode loop, "The handoff on the H200 with early prefill" for a prefill worker, whose
    chunked prompts lost about 1.5 ms between chunks while each step waited for the device,
    and whose KV pushes were not slower overlapped). Elsewhere PLAIN: on the CPU the model
    runs on the host's cores, so nothing would overlap."""
    if option == "auto":
        return StepMode.OVERLAPPED if device.startswith("cuda") else StepMode.PLAIN
    return StepMode(option)
