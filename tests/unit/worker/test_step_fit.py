"""The step-time model a worker fits from its own steps recovers known coefficients, never
goes negative, and says which terms it has seen."""

from __future__ import annotations

import random

import pytest

from engine.step_shape import StepShape
from worker.step_fit import StepFit, fit


def synthetic(n: int, rng: random.Random, base=0.002, per_prefill=1e-5, per_seq=2e-4,
              per_ctx=1e-7, noise=0.0, prefill=True, decode=True):
    samples = []
    for _ in range(n):
        p = rng.randint(0, 2048) if prefill else 0
        d = rng.randint(0 if prefill else 1, 64) if decode else 0
        c = d * rng.randint(16, 1024)
        if p == 0 and d == 0:
            d, c = 1, 100
        t = base + per_prefill * p + per_seq * d + per_ctx * c
        samples.append((p, d, c, t * (1 + rng.uniform(-noise, noise))))
    return samples


def test_the_fit_recovers_the_coefficients_of_a_linear_step_time() -> None:
    model = fit(synthetic(300, random.Random(0), noise=0.02))
    assert model is not None
    assert model.base_s == pytest.approx(0.002, rel=0.2)
    assert model.prefill_token_s == pytest.approx(1e-5, rel=0.05)
    assert model.decode_seq_s == pytest.approx(2e-4, rel=0.1)
    assert model.context_token_s == pytest.approx(1e-7, rel=0.2)
    assert model.step_s(2048, 0, 0) == pytest.approx(0.002 + 2048e-5, rel=0.05)
    assert model.num_samples == 300 and model.num_prefill_samples > 250


def test_no_coefficient_is_negative_even_when_the_data_pulls_one_below_zero() -> None:
    rng = random.Random(1)
    # Bigger batches were *faster* per step here (noise): the decode term must clamp at 0.
    samples = [(0, d, 0, 0.01 - 1e-5 * d + rng.uniform(0, 1e-4)) for d in range(1, 65)] * 2
    model = fit(samples)
    assert model is not None
    assert min(model.base_s, model.prefill_token_s, model.decode_seq_s,
               model.context_token_s) >= 0
    assert model.base_s == pytest.approx(0.0097, rel=0.1)


def test_a_decode_only_worker_reports_its_prefill_term_unknown() -> None:
    model = fit(synthetic(100, random.Random(2), prefill=False))
    assert model is not None
    assert model.num_prefill_samples == 0 and model.prefill_token_s == 0
    assert model.num_decode_samples == 100


def test_too_few_samples_give_no_model_and_empty_steps_are_not_samples() -> None:
    assert fit(synthetic(5, random.Random(3))) is None
    window = StepFit(window_size=32, min_samples=4)
    for _ in range(10):
        window.observe(StepShape(), 0.01)  # a step that computed nothing
        window.observe(StepShape(prefill_tokens=100), 0.0)  # a command, not a step
    assert window.model() is None
    for i in range(40):
        window.observe(StepShape(prefill_tokens=10 * (i + 1), decode_seqs=i % 3,
                                 context_tokens=50 * (i % 3)), 0.001 + 1e-5 * 10 * (i + 1))
    window.check_invariants()
    model = window.model()
    assert model is not None and model.num_samples == 32
    assert model.prefill_token_s == pytest.approx(1e-5, rel=0.05)


def test_rare_prefill_steps_keep_their_own_window_so_one_slow_one_does_not_set_the_rate() -> None:
    """A worker that mostly decodes: 1000 decode steps, and 40 prefill steps of which the
    first took a second (a kernel compile). One window of the latest 256 steps would keep
    only a few prefills and the compile; the prefill window keeps all 40 (and, once more
    prefills come, forgets the compile)."""
    window = StepFit(window_size=256)
    window.observe(StepShape(prefill_tokens=100, decode_seqs=8, context_tokens=800), 1.0)
    for i in range(1000):
        window.observe(StepShape(decode_seqs=8 + i % 8, context_tokens=800 + 100 * (i % 8)),
                       0.002 + 1e-4 * (8 + i % 8))
        if i % 25 == 0:
            window.observe(StepShape(prefill_tokens=64 * (1 + i % 16), decode_seqs=8,
                                     context_tokens=800), 0.002 + 8e-4 + 1e-5 * 64 * (1 + i % 16))
    window.check_invariants()
    model = window.model()
    assert model is not None and model.num_prefill_samples == 41
    assert model.num_samples == 256 + 41
    for i in range(300):  # the compile leaves the prefill window
        window.observe(StepShape(prefill_tokens=64 * (1 + i % 16), decode_seqs=8,
                                 context_tokens=800), 0.002 + 8e-4 + 1e-5 * 64 * (1 + i % 16))
    model = window.model()
    assert model is not None and model.prefill_token_s == pytest.approx(1e-5, rel=0.02)


def test_a_worker_whose_steps_turned_slow_is_predicted_slow_after_a_few_dozen_steps() -> None:
    """256 decode steps at 50 ms, then 20 at 550 ms (a fault delaying each step by 500 ms,
    the agent's test): the model predicts the new speed's side, not a blend that keeps the
    worker looking 2x its peers; equal weights predicted 89 ms."""
    window = StepFit(window_size=256)
    for i in range(256):
        window.observe(StepShape(decode_seqs=1 + i % 4, context_tokens=100 * (1 + i % 4)), 0.05)
    for i in range(20):
        window.observe(StepShape(decode_seqs=1 + i % 4, context_tokens=100 * (1 + i % 4)), 0.55)
    model = window.model()
    assert model is not None
    assert model.step_s(0, 2, 200) > 3 * 0.05
    for i in range(256):  # and back: the slow steps age out of the model
        window.observe(StepShape(decode_seqs=1 + i % 4, context_tokens=100 * (1 + i % 4)), 0.05)
    model = window.model()
    assert model is not None and model.step_s(0, 2, 200) == pytest.approx(0.05, rel=0.05)


def test_weights_must_be_one_positive_weight_per_sample() -> None:
    samples = synthetic(20, random.Random(4))
    with pytest.raises(ValueError):
        fit(samples, weights=[1.0] * 19)
    with pytest.raises(ValueError):
        fit(samples, weights=[0.0] * 20)
