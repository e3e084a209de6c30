"""A worker's HTTP side, as an operator or a drill reads it: the probes and /admin/state.

    probe(url, path)          GET /health or /ready: the status, or None when no answer
                              came within the deadline (refused, reset, stopped process)
    metric_sum(url, name)     GET /metrics: one counter's value summed over its labels
    admin_state(url)          GET /admin/state with the cluster's token: the worker's own
                              bookkeeping (held tables, reservations, KV blocks in use)

The channel (rpc/control_client.py) carries every request-serving call; these are the plain
HTTP paths the same control port serves beside it (rpc/control_server.py).

Lifecycle: open() (its own HTTP session) → calls → aclose(). Every call has a deadline and
raises nothing but cancellation.
"""

from __future__ import annotations

import asyncio

import aiohttp

WorkerState = dict[str, object]


class ProbeClient:
    def __init__(self, token: str | None, timeout_s: float) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        self._session = aiohttp.ClientSession()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("ProbeClient.open() was not called")
        return self._session

    async def probe(self, control_url: str, path: str) -> int | None:
        """The HTTP status of GET `path` on the worker's control port; None: no answer."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.get(control_url.rstrip("/") + path) as response:
                    await response.read()
                    return response.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def metric_sum(self, control_url: str, name: str) -> float | None:
        """The sum of every sample of metric `name` on the worker's /metrics (0 when it has
        none yet); None: no answer."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.get(control_url.rstrip("/") + "/metrics") as response:
                    if response.status != 200:
                        return None
                    text = await response.text()
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeError):
            return None
        total = 0.0
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                try:
                    total += float(line.rsplit(" ", 1)[1])
                except ValueError:
                    pass
        return total

    async def admin_state(self, control_url: str) -> WorkerState | None:
        """The worker's GET /admin/state (its token-guarded view); None: no (valid) answer
        or no token."""
        if self.token is None:
            return None
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.get(control_url.rstrip("/") + "/admin/state",
                                            headers=headers) as response:
                    if response.status != 200:
                        return None
                    body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        return body if isinstance(body, dict) else None
