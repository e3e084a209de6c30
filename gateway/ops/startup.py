"""The gateway's start-up gate: not ready until the workers it was told to expect are.

`pdserve up` starts the gateway next to workers that take a while to load the model, and
tells it how many (`--expect-workers N`). Until N workers have registered at once the gate
is closed: `/ready` answers 503 and names how many are ready, and the OpenAI API answers
503 "pdserve is starting" with Retry-After instead of routing to the first worker that
happens to be up (or failing for want of one). Once open it stays open: a worker lost
later is the failure handling's business (gateway/routing/retry_policy.py), not start-up's.

    closed --(ready workers >= expected)--> open        expected 0: open from the start
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.api.errors import overloaded
from gateway.api.http_api import Handler

RETRY_AFTER_S = 5.0


class StartupGate:
    def __init__(self, expected: int, num_ready: Callable[[], int]) -> None:
        if expected < 0:
            raise ValueError(f"expected workers must be >= 0, got {expected}")
        self.expected = expected
        self._num_ready = num_ready
        self._open = expected == 0

    @property
    def is_open(self) -> bool:
        """Latched: checks the count until it first reaches `expected`."""
        if not self._open and self._num_ready() >= self.expected:
            self._open = True
        return self._open

    def status(self) -> dict[str, object]:
        return {"started": self.is_open, "workers_ready": self._num_ready(),
                "workers_expected": self.expected}

    def refusal(self) -> str:
        return (f"pdserve is starting: {self._num_ready()} of {self.expected} workers are "
                f"ready (loading the model); retry in a few seconds.")


STARTUP = web.AppKey("startup_gate", StartupGate)


@web.middleware
async def startup_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 for the OpenAI API while the gate is closed (inside the error middleware)."""
    gate = request.app[STARTUP]
    if request.path.startswith("/v1/") and not gate.is_open:
        raise overloaded(gate.refusal(), retry_after_s=RETRY_AFTER_S)
    return await handler(request)


def install(app: web.Application, gate: StartupGate) -> None:
    app[STARTUP] = gate
    app.middlewares.append(startup_middleware)
