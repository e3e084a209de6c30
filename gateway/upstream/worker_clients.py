"""The gateway's control clients, one per worker control URL, and the aborts sent through them.

Every client shares the gateway's channels to the workers (rpc/channel_client.py), so a worker is
reached over one connection whatever the number of requests to it.

Lifecycle of an abort: sent from a task owned here (so a cancelled request handler cannot
stop it half-way) → answered, or failed and logged (the worker's own deadlines free what it
cannot hear about) → gone. `aclose()` lets pending aborts finish within `abort_s`, then
cancels the rest.

Invariants (`check_invariants`): every abort task is in `_background` until it ends.
"""

from __future__ import annotations

import asyncio
import logging

from protocol.messages import AbortRequest, AbortResponse
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import ControlError

log = logging.getLogger(__name__)

# What a failing worker call looks like from here; anything else is a bug and propagates.
CALL_FAILURES = (ControlError, OSError, TimeoutError)


class WorkerClients:
    def __init__(self, channels: ChannelPool, abort_s: float) -> None:
        self.channels = channels
        self.abort_s = abort_s
        self.num_aborts_sent = 0
        self._clients: dict[str, ControlClient] = {}
        self._background: set[asyncio.Task[None]] = set()

    def get(self, control_url: str) -> ControlClient:
        client = self._clients.get(control_url)
        if client is None:
            client = ControlClient(control_url, self.channels)
            self._clients[control_url] = client
        return client

    def owns(self, client: ControlClient) -> bool:
        return self._clients.get(client.base_url) is client

    def abort(self, legs: dict[str, ControlClient], request_id: str) -> None:
        """Tell every worker of `legs` (worker id -> client) to drop `request_id`."""
        loop = asyncio.get_running_loop()
        for worker_id, client in legs.items():
            task = loop.create_task(self._send_abort(client, worker_id, request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_abort(self, client: ControlClient, worker_id: str, request_id: str) -> None:
        self.num_aborts_sent += 1
        try:
            await client.call(AbortRequest(request_id=request_id, reason="gateway"),
                              AbortResponse, self.abort_s)
        except CALL_FAILURES as exc:
            # The worker's own deadlines free the request when it cannot hear us.
            log.info("abort of %s on %s failed: %s", request_id, worker_id, exc)

    @property
    def num_background_tasks(self) -> int:
        return len(self._background)

    async def aclose(self) -> None:
        """Let pending aborts finish (bounded), then cancel what is left."""
        if self._background:
            await asyncio.wait(self._background, timeout=self.abort_s)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def check_invariants(self) -> None:
        for task in self._background:
            assert not task.done(), "a finished abort task is still listed"
