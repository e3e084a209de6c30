"""The cluster a drill runs against, as an operator on its host reaches it.

    the gateway     /admin/workers (who is routable, their pids and epochs),
                    /admin/agent/events (the agent's decisions), a probe completion;
                    with the admin token `pdserve up` wrote into its log folder
    each worker     /health, /ready and /admin/state on its control port (rpc/probe_client.py)
                    and a FaultRequest over its channel (rpc/control_client.py), both with
                    the cluster's internal token (the drill's own cluster: the one it gave
                    `pdserve up`; another: $PDSERVE_INTERNAL_TOKEN, when the operator set it)
    the processes   from /proc (drill/processes.py): `pdserve up` is every child's parent

Lifecycle: open() (its HTTP session, its channel pool) → calls → aclose(). Every call has
a deadline; a gateway that does not answer reads as an empty listing, not an exception.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import msgspec

from drill import processes
from protocol.agent_messages import FaultRequest, FaultResponse
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.probe_client import ProbeClient, WorkerState
from telemetry.options import ADMIN_TOKEN_FILE

HTTP_TIMEOUT_S = 3.0
PROBE_TIMEOUT_S = 30.0


class WorkerRow(msgspec.Struct, frozen=True):
    """One row of the gateway's /admin/workers (the fields a drill reads)."""

    id: str
    role: str
    pid: int | None
    epoch: int
    control_url: str
    state: str  # ready | draining | ejected | expired


class AgentEventRow(msgspec.Struct, frozen=True):
    at_unix_ms: int
    worker_id: str
    epoch: int
    rule: str
    action: str
    outcome: str


class _Workers(msgspec.Struct):
    workers: list[WorkerRow]


class _Events(msgspec.Struct):
    events: list[AgentEventRow]


def read_admin_token(log_dir: Path) -> str:
    """The admin token `pdserve up` generated (LOG_DIR/admin-token); raises OSError."""
    return (log_dir / ADMIN_TOKEN_FILE).read_text().strip()


class TargetCluster:
    def __init__(self, url: str, admin_token: str, internal_token: str | None) -> None:
        self.url = url.rstrip("/")
        self.admin_headers = {"Authorization": f"Bearer {admin_token}"}
        self.internal_token = internal_token
        self._session: aiohttp.ClientSession | None = None
        self._pool: ChannelPool | None = None
        self._probes = ProbeClient(internal_token, HTTP_TIMEOUT_S)

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=HTTP_TIMEOUT_S))
        self._pool = ChannelPool(self.internal_token)
        await self._probes.open()

    async def aclose(self) -> None:
        await self._probes.aclose()
        if self._pool is not None:
            await self._pool.aclose()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("TargetCluster.open() was not called")
        return self._session

    async def _get(self, path: str) -> bytes | None:
        try:
            async with asyncio.timeout(HTTP_TIMEOUT_S):
                async with self.session.get(self.url + path,
                                            headers=self.admin_headers) as response:
                    return await response.read() if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    async def workers(self) -> list[WorkerRow] | None:
        """The gateway's listing; None when it did not answer."""
        body = await self._get("/admin/workers")
        try:
            return None if body is None else msgspec.json.decode(body, type=_Workers).workers
        except msgspec.DecodeError:
            return None

    async def agent_events(self, limit: int = 200) -> list[AgentEventRow]:
        body = await self._get(f"/admin/agent/events?limit={limit}")
        try:
            return [] if body is None else msgspec.json.decode(body, type=_Events).events
        except msgspec.DecodeError:
            return []

    async def probe_completion(self, model: str) -> bool:
        """Whether a tiny greedy completion is answered in full."""
        body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                async with self.session.post(self.url + "/v1/completions",
                                             json=body) as response:
                    answer = await response.json(content_type=None)
                    return response.status == 200 and bool(answer.get("choices"))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return False

    async def num_replicas_ready(self, num_expected: int) -> int:
        """How many gateway replicas answer /ready with 200, each named by the gateway id
        in its shared admission limits, over fresh connections (the kernel spreads them
        over the replicas sharing the port): up to 8 tries per replica expected. Replicas
        without names (no shared limits): all of them when every try answered 200."""
        seen: set[str] = set()
        num_ok = 0
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as fresh:
            for _ in range(8 * num_expected):
                try:
                    async with fresh.get(self.url + "/ready") as response:
                        body = await response.json(content_type=None)
                        if response.status == 200:
                            num_ok += 1
                            limits = body.get("admission_limits") or {}
                            seen.add(str(limits.get("gateway_id", "")))
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                    pass
                if len(seen) >= num_expected and "" not in seen:
                    break
        if seen == {""}:
            return num_expected if num_ok == 8 * num_expected else 0
        return len(seen - {""})

    async def worker_probes(self, worker: WorkerRow) -> tuple[int | None, int | None]:
        """(/health status, /ready status) of one worker; None: no answer."""
        health, ready = await asyncio.gather(self._probes.probe(worker.control_url, "/health"),
                                             self._probes.probe(worker.control_url, "/ready"))
        return health, ready

    async def num_pushes(self, worker: WorkerRow) -> float | None:
        """KV pushes the worker completed so far (pdserve_kv_pushes_total)."""
        return await self._probes.metric_sum(worker.control_url, "pdserve_kv_pushes_total")

    async def worker_state(self, worker: WorkerRow) -> WorkerState | None:
        return await self._probes.admin_state(worker.control_url)

    async def set_fault(self, worker: WorkerRow, fault: FaultRequest) -> FaultResponse:
        """Raises RemoteError when the worker takes no faults, ControlError when it is
        unreachable (rpc/errors.py)."""
        assert self._pool is not None, "TargetCluster.open() was not called"
        return await ControlClient(worker.control_url, self._pool).call(
            fault, FaultResponse, HTTP_TIMEOUT_S)

    def supervisor_pid(self, workers: list[WorkerRow]) -> int | None:
        """`pdserve up`'s pid: the parent of the workers (None: not on this host)."""
        parents = {processes.parent(w.pid) for w in workers if w.pid}
        parents.discard(None)
        return parents.pop() if len(parents) == 1 else None
