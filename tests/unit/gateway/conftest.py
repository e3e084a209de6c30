"""Fixtures of the gateway tests (the harness itself lives in gateway_harness.py)."""

from __future__ import annotations

import pytest
from gateway_harness import Harness, ScriptedBackend


@pytest.fixture
def harness_factory():
    made: list[Harness] = []

    def make(**kwargs) -> Harness:
        harness = Harness(kwargs.pop("backend", None) or ScriptedBackend(), **kwargs)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()
