"""Where an engine step's host time goes, without a profiler: timers around its phases.

`HostSplit(engine)` wraps, on that engine's own objects only (instance attributes that
shadow the class's methods; nothing global changes), the calls one step makes:

    scheduler.schedule        plan the step
    runner.execute            fill the step's inputs and launch it (on CUDA: queue it)
    sampler.launch            queue the sampling of its logits
    _resolve                  an overlapped step: the previous step's tokens to the host,
                              then their outputs (stop rules, text, output records)
    scheduler.update_from_output   apply the step to the requests

and adds up the seconds each takes until `close()` removes the wrappers. Inside
runner.execute it also times each captured graph's `replay()` (REPLAY: on CUDA the driver's
graph launch, which is host time too; zero where no graph runs). A profiler's own
cost per call (cProfile's, several microseconds) swamps calls of a few microseconds per
row; a timer per phase costs well under one per call, so a host-bound loop keeps its pace.
What the phases do not cover (the engine's own glue, the caller's loop) is the wall time
less their sum.

Lifecycle: constructed (wrappers on) -> steps -> `per_step_ms(steps)` -> `close()` (off).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

PHASES = ("scheduler.schedule", "runner.execute", "sampler.launch", "_resolve",
          "scheduler.update_from_output")
REPLAY = "graph replay"  # a part of runner.execute, not a phase of its own


class HostSplit:
    def __init__(self, engine: Any) -> None:
        self.seconds: Counter[str] = Counter()
        self._wrapped: list[tuple[object, str]] = []
        for phase in PHASES:
            owner_name, _, method_name = phase.rpartition(".")
            owner = getattr(engine, owner_name) if owner_name else engine
            setattr(owner, method_name, self._timed(phase, getattr(owner, method_name)))
            self._wrapped.append((owner, method_name))
        for graph in _captured_graphs(engine.runner):
            graph.replay = self._timed(REPLAY, graph.replay)
            self._wrapped.append((graph, "replay"))

    def _timed(self, phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
        seconds, clock = self.seconds, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[phase] += clock() - started

        return timed

    def per_step_ms(self, num_steps: int) -> dict[str, float]:
        """Milliseconds per step in each phase, in PHASES order, then REPLAY."""
        return {phase: self.seconds[phase] / max(num_steps, 1) * 1e3
                for phase in (*PHASES, REPLAY)}

    def close(self) -> None:
        """Remove the wrappers: the instances use their classes' methods again."""
        for owner, method_name in self._wrapped:
            delattr(owner, method_name)
        self._wrapped.clear()


def _captured_graphs(runner: Any) -> list[Any]:
    """The runner's captured CUDA graphs (decode and mixed); none on the CPU."""
    holders = (getattr(runner, "graphs", None), getattr(runner, "mixed_graphs", None))
    return [graph for holder in holders if holder is not None
            for graph in holder.captured_graphs()]
