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


def choose_step_mode(option: str, device: str, prefill_role: bool = False) -> StepMode:
    """`option` is one of STEP_MODE_CHOICES. auto, on CUDA: OVERLAPPED (measured against
    PIPELINED on one H200: docs/benchmarks.md "Overlapped steps"), except for a worker that
    starts in the prefill role (`prefill_role`): its steps are long prompt chunks, whose
    host work already hides behind the device, while its event loop must answer each KV
    handshake at once, which an overlapped step (it rarely waits for the device, so it
    rarely lets go of the interpreter lock) delays; PIPELINED there. Elsewhere PLAIN: on the
    CPU the model runs on the host's cores, so nothing would overlap."""
    if option == "auto":
        if not device.startswith("cuda"):
            return StepMode.PLAIN
        return StepMode.PIPELINED if prefill_role else StepMode.OVERLAPPED
    return StepMode(option)
