"""Fits a worker's `StepModel` online from its own engine steps.

Each step gives one sample (prefill tokens, decoding sequences, context tokens, seconds).
The model is a least-squares fit of

    seconds = base + a * prefill_tokens + b * decode_seqs + c * context_tokens

over the last `window_size` steps that prefilled something and the last `window_size`
that only decoded, each sample weighted by its recency within its window (its weight halves
every `half_life` newer samples of its kind), with every coefficient kept >= 0 (a term the data does not support, or
that comes out negative, is dropped and the rest refitted: a small active-set
non-negative least squares over four unknowns). Two windows, because a worker that
prefills and decodes runs many more decode-only steps than prefill steps: one window of
the latest steps would hold a handful of prefills and fit the prefill cost to whatever
those few did (a warm-up compile, a one-token chunk). Recency, because the model must say
how fast the worker is now: a worker whose steps turned 10x slower (a throttled GPU, a
noisy neighbour) is, after a few dozen steps, predicted slow by its own model, which is
what routes around it and what the agent judges it by while it is ejected and runs nothing
(a 256-step window with equal weights still predicted a blend of old and new). Empty steps
are not samples. `fit()` is a pure function of the samples and their weights; `StepFit`
only keeps the windows.

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
HALF_LIFE = 32  # samples of one kind: the weight of a step this many steps older halves
Sample = tuple[int, int, int, float]  # (prefill tokens, decoding seqs, context tokens, s)


class StepFit:
    def __init__(self, window_size: int = 256, min_samples: int = MIN_SAMPLES,
                 half_life: float = HALF_LIFE) -> None:
        self.window_size = window_size
        self.min_samples = min_samples
        self.half_life = half_life
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
            self._cached = fit([*self._prefills, *self._decodes], self.min_samples,
                               [*recency_weights(len(self._prefills), self.half_life),
                                *recency_weights(len(self._decodes), self.half_life)])
            self._dirty = False
        return self._cached

    def check_invariants(self) -> None:
        assert len(self._prefills) <= self.window_size >= len(self._decodes)
        assert all(p > 0 for p, _, _, _ in self._prefills), "a decode step in the prefill window"
        assert all(p == 0 for p, _, _, _ in self._decodes), "a prefill step in the decode window"
        for prefill, decodes, context, seconds in (*self._prefills, *self._decodes):
            assert prefill >= 0 and decodes >= 0 and context >= 0 and seconds > 0


def recency_weights(n: int, half_life: float) -> list[float]:
    """Weights for n samples, oldest first: 1 for the newest, halving every half_life."""
    return [0.5 ** ((n - 1 - i) / half_life) for i in range(n)]


def fit(samples: list[Sample], min_samples: int = MIN_SAMPLES,
        weights: list[float] | None = None) -> StepModel | None:
    """Non-negative least squares of step time on [1, prefill, decodes, context], each
    sample's squared error weighted by `weights` (all 1 when None)."""
    if len(samples) < min_samples:
        return None
    if weights is not None and (len(weights) != len(samples) or min(weights) <= 0):
        raise ValueError("one positive weight per sample")
    data = np.asarray(samples, dtype=np.float64)
    root = np.sqrt(np.asarray(weights if weights is not None else np.ones(len(data))))
    x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]]) * root[:, None]
    y = data[:, 3] * root
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
