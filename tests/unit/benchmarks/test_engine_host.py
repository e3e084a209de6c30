"""benchmarks/engine_host.py measures with each runner, in a closed loop or not, and the
graphs runner is the real ModelRunner (its graphs' steps must stay where it replaces them)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("triton")

from benchmarks.engine_host import measure  # noqa: E402
from testing.random_model import export_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    export_tokenizer(out)
    return out


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    """measure() freezes the heap and raises the young threshold, as a worker does."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.parametrize("runner, closed_loop", [("null", False), ("graphs", True)])
def test_a_measurement_runs(tokenizer_dir: Path, runner: str, closed_loop: bool) -> None:
    seconds = measure(str(tokenizer_dir), 4, "greedy", 10, None, 256, True, runner, closed_loop)
    assert 0 < seconds < 1
