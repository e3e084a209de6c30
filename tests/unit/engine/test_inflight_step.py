"""An overlapped step in flight: one row per request, each with its PLACEHOLDER."""

from __future__ import annotations

import pytest
import torch

from engine.inflight_step import InFlightStep
from engine.output_processor import Tracked
from engine.pending_sample import PendingSample
from engine.request import PLACEHOLDER, Request
from engine.sampler import SamplingState
from protocol.sampling_params import SamplingParams


def step(outputs: list[list[int]]) -> InFlightStep:
    params = SamplingParams(temperature=0.0)
    rows = []
    for i, output in enumerate(outputs):
        request = Request(f"r{i}", (1, 2), params)
        request.output_token_ids.extend(output)
        rows.append(Tracked(request, SamplingState((1, 2)), None))  # type: ignore[arg-type]
    return InFlightStep(tuple(rows), PendingSample(torch.zeros(len(outputs), dtype=torch.long),
                                                   None, [params] * len(outputs)))


def test_rows_with_their_placeholders_hold() -> None:
    inflight = step([[PLACEHOLDER], [5, PLACEHOLDER]])
    inflight.check_invariants()
    assert inflight.device_tokens.rows == {"r0": 0, "r1": 1}
    assert inflight.holds("r1") and not inflight.holds("r2")


def test_a_row_without_its_placeholder_is_caught() -> None:
    with pytest.raises(AssertionError, match=r"\['r1'\] in flight without a PLACEHOLDER"):
        step([[PLACEHOLDER], [5, 6]]).check_invariants()
