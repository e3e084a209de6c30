"""What each engine step cost the device, from CUDA events: the step-time samples of an
engine whose steps overlap.

An overlapped step (engine/inflight_step.py) returns before the device has run it, and a
step that samples nothing (a prompt's chunks before its last) is never waited for at all:
the wall time of one `LLMEngine.step()` call is the host's work for the step it queues
plus whatever wait the step before needed, so it says little about either. The engine's
step model (worker/step_fit.py, which the router predicts from) needs the cost of
each step against that step's own shape. Two events bracket each step's launch on the
stream:

    host     start(shape) -> uploads, kernels or a graph replay queued -> stop()
    device   [start] ........ the step's kernels ........ [end]
             start runs when the stream reaches it: once the step before is done, or at
             once on an idle device, which then counts the host's preparation too

so end - start is what the step took on the device's timeline, the host's part included
where the device waited for it.

Lifecycle of a step: started -> stopped (pending) -> drained once its end event has run,
as (shape, seconds), in launch order. CUDA only.

Invariants: at most one step is open (started, not stopped); pending steps leave in launch
order, each exactly once; at most `max_pending` are pending (the oldest are dropped and
counted in `num_dropped` when nobody drains).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.step_shape import StepShape


@dataclass(frozen=True, slots=True)
class TimedStep:
    shape: StepShape
    seconds: float


class StepTimer:
    def __init__(self, max_pending: int = 1024) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be positive, got {max_pending}")
        self.max_pending = max_pending
        self._open: tuple[StepShape, torch.cuda.Event] | None = None
        self._pending: deque[tuple[StepShape, torch.cuda.Event, torch.cuda.Event]] = deque()
        self.num_dropped = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def start(self, shape: StepShape) -> None:
        """Before the step's first upload or launch, on the stream the step runs on."""
        if self._open is not None:
            raise RuntimeError("a step is already being timed: stop() it first")
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._open = (shape, event)

    def stop(self) -> None:
        """After the step's last launch."""
        if self._open is None:
            raise RuntimeError("stop() without start()")
        (shape, start), self._open = self._open, None
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((shape, start, end))
        if len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.num_dropped += 1

    def drain(self) -> list[TimedStep]:
        """The steps the device has finished since the last drain, in launch order. Never
        waits: a step still running, and every step after it, stay pending."""
        done: list[TimedStep] = []
        while self._pending and self._pending[0][2].query():
            shape, start, end = self._pending.popleft()
            done.append(TimedStep(shape, max(0.0, start.elapsed_time(end)) / 1e3))
        return done

    def check_invariants(self) -> None:
        if len(self._pending) > self.max_pending:
            raise AssertionError(f"{len(self._pending)} steps pending, over {self.max_pending}")
