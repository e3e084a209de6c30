"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hf_reference import HFReference

# Without a GPU, Triton kernels run on its interpreter (in fp32: tests/gpu/conftest.py). It
# must be chosen before triton is first imported, by whichever test file imports it first.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from launcher.redis_server import RedisServer


@pytest.fixture(scope="session", autouse=True)
def float32_workers() -> Iterator[None]:
    """Every worker the tests start (directly or through `pdserve up`, which passes its
    environment on) computes in float32, the precision of the transformers reference the
    answers are compared with exactly. Left to `--dtype auto`, a CPU with native bf16
    (AVX-512 BF16, AMX) would run bfloat16, whose greedy answers legitimately differ."""
    previous = os.environ.get("PDSERVE_DTYPE")
    os.environ["PDSERVE_DTYPE"] = "float32"
    yield
    if previous is None:
        os.environ.pop("PDSERVE_DTYPE", None)
    else:
        os.environ["PDSERVE_DTYPE"] = previous


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real Redis-protocol server on a free loopback port for the whole session, with a
    password as `pdserve up`'s has (its `url` carries it; a client without it is refused).

    Tests that share it must use their own key namespace (or worker ids) rather than flush
    it; a test that needs to stop and restart a server starts its own RedisServer.
    """
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests (`@pytest.mark.anyio`) run on asyncio, the loop pdserve runs on."""
    return "asyncio"


@pytest.fixture(scope="session")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> HFReference:
    """transformers' model, tokenizer and chat template for the default model: the
    independent reference greedy output is compared with (built once, ~14 s of CPU). Under
    `make test`'s several test processes (pytest-xdist), the first to ask builds it and the
    others load its saved copy from the run's shared temporary directory."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return HFReference.shared(tmp_path_factory.getbasetemp().parent / "hf-reference")
    return HFReference()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that hold a slow test (marked `slow`: whole clusters, drills) run first, each
    still whole and in collection order, the rest after. `make test` spreads modules over
    two workers (`-n 2 --dist loadfile`), handing each the next module when it is free: with
    the long modules first, the short ones fill in at the end and both workers finish
    together, instead of one running a long module alone at the end."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow)  # stable
