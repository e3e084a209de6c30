"""The engine step's per-row loops, compiled (step_core.c, built by `make setup`).

A step of B running requests makes a handful of passes over its B rows: the scheduler's
decode chunks (`schedule_decodes`) and the step applied (`advance_chunks`), the runner's
inputs (`placeholder_sources`, `fill_decode_rows`, `write_table_rows`), the sampled tokens
resolved, stop-checked and turned into outputs (`resolve_rows`). In Python each pass costs
a few hundred nanoseconds per row, and on a small model those passes, not the GPU, set the
length of a step (docs/performance.md, "The serving loop"). Here each pass is one call per
step. What stays in Python: everything decided per request rather than per row (admission,
preemption, a new block, a request's last token), which the compiled loops call back into.

The functions work on the engine's own objects (Request, ScheduledChunk, Tracked), which
stay the one record of each request; each keeps the semantics of the Python loop it
replaced (the callers' docstrings), exceptions included.
"""

from __future__ import annotations

try:
    from engine.native._step_core import (advance_chunks, fill_decode_rows,
                                           placeholder_sources, resolve_rows, schedule_decodes,
                                           write_table_rows)
except ImportError as error:  # pragma: no cover - a checkout whose extension was not built
    raise ImportError("pdserve's compiled step core (engine/native/step_core.c) is not built: "
                      "run `make setup` (it needs a C compiler), or "
                      "`pip install -e .` in the checkout") from error

__all__ = ["advance_chunks", "fill_decode_rows", "placeholder_sources", "resolve_rows",
           "schedule_decodes", "write_table_rows"]
