"""Fits a worker's `StepModel` online from its own engine steps.

Each step gives one sample (prefill tokens, decoding sequences, context tokens, seconds).
The model is a least-squares fit of

    seconds = base + a * prefill_tokens + b * decode_seqs + c * context_tokens

over the last `window_size` steps that prefilled something and the last `window_size`
that only decoded, with every coefficient kept >= 0 (a term the data does not support, or
that comes out negative, is dropped and the rest refitted: a small active-set
non-negative least squares over four unknowns). Two windows, because a worker that
prefills and decodes runs many more decode-only steps than prefill steps: one window of
the latest steps would hold a handful of prefills and fit the prefill cost to whatever
those few did (a warm-up compile, a one-token chunk). Empty steps are not samples. `fit()`
is a pure function of the samples; `StepFit` only keeps the windows.

Invariants: each window holds at most window_size samples, the prefill window only steps
with prefill tokens and the decode window only steps without; every sample has
non-negative counts and a positive duration.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.step_shape import StepShape
from protocol.worker_load import StepModel

MIN_SAMPLES = 16
Sample = tuple[int, int, int, float]  # (prefill tokens, decoding seqs, context tokens, s)


class StepFit:
    def __init__(self, window_size: int = 256, min_samples: int = MIN_SAMPLES) -> None:
        self.window_size = window_size
        self.min_samples = min_samples
        self._prefills: deque[Sample] = deque(maxlen=window_size)
        self._decodes: deque[Sample] = deque(maxlen=window_size)
        self._cached: StepModel | None = None
        self._dirty = False

    def observe(self, shape: StepShape, step_s: float) -> None:
        if step_s <= 0 or not (shape.prefill_tokens or shape.decode_seqs):
            return
        window = self._prefills if shape.prefill_tokens else self._decodes
        window.append((shape.prefill_tokens, shape.decode_seqs, shape.context_tokens, step_s))
        self._dirty = True

    def model(self) -> StepModel | None:
        """The fit of the current windows (recomputed only after new samples)."""
        if self._dirty:
            self._cached = fit([*self._prefills, *self._decodes], self.min_samples)
            self._dirty = False
        return self._cached

    def check_invariants(self) -> None:
        assert len(self._prefills) <= self.window_size >= len(self._decodes)
        assert all(p > 0 for p, _, _, _ in self._prefills), "a decode step in the prefill window"
        assert all(p == 0 for p, _, _, _ in self._decodes), "a prefill step in the decode window"
        for prefill, decodes, context, seconds in (*self._prefills, *self._decodes):
            assert prefill >= 0 and decodes >= 0 and context >= 0 and seconds > 0


def fit(samples: list[Sample], min_samples: int = MIN_SAMPLES
        ) -> StepModel | None:
    """Non-negative least squares of step time on [1, prefill, decodes, context]."""
    if len(samples) < min_samples:
        return None
    data = np.asarray(samples, dtype=np.float64)
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]])
    y = data[:, 3]
    active = [j for j in range(4) if j == 0 or np.any(x[:, j] != 0)]
    coef = np.zeros(4)
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if np.all(solution >= 0):
            coef[active] = solution
            break
        # Drop the most negative term and refit (each pass removes one of four).
        active.pop(int(np.argmin(solution)))
    return StepModel(base_s=float(coef[0]), prefill_token_s=float(coef[1]),
                     decode_seq_s=float(coef[2]), context_token_s=float(coef[3]),
                     num_samples=len(samples),
                     num_prefill_samples=int(np.count_nonzero(data[:, 0])),
                     num_decode_samples=int(np.count_nonzero(data[:, 1])))
