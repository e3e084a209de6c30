"""One bounded load run against an OpenAI-compatible endpoint.

Lifecycle of a run: session opened -> requests sent (open loop: at seeded arrival times;
closed loop: N workers each sending its next request when the last one ends) -> sending
stops at `duration_s` or after `num_requests` -> in-flight requests finish or hit
`request_timeout_s` -> RunResult. So a run never lasts longer than
duration_s + request_timeout_s (plus connection teardown).

Invariants: every request task belongs to the run's TaskGroup and has ended when
`run_load` returns; `len(records) == num_sent` at the end; no request raises (faults are
recorded on its RequestRecord).

Client overhead: the next request's prompt is planned while waiting for its arrival time,
the connection pool is unbounded (so requests never queue in the client), and the run
reports the process CPU time it used and how late each request left against its schedule
(`send_lag_ms`). CPU use near one core means the client, not the server, set the pace.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass

import aiohttp
import msgspec

from bench.arrivals import ArrivalKind, arrival_gaps_s
from bench.planner import PlannedRequest, RequestPlanner
from bench.progress import ProgressBar
from bench.sse_client import Api, RequestRecord, build_headers, build_payload, send_request

CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class LoadConfig:
    base_url: str
    api: Api
    model: str
    rate_rps: float | None = None      # open loop; exactly one of rate / concurrency
    concurrency: int | None = None     # closed loop
    arrival: ArrivalKind = "poisson"
    burstiness: float = 1.0
    duration_s: float = 30.0
    num_requests: int | None = None   # None: --duration alone ends the sending
    request_timeout_s: float = 60.0
    seed: int = 0
    ignore_eos: bool = False
    temperature: float | None = None
    api_key: str | None = None
    extra_headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if (self.rate_rps is None) == (self.concurrency is None):
            raise ValueError("give exactly one of a rate (open loop) or a concurrency")
        if self.rate_rps is not None and self.rate_rps <= 0:
            raise ValueError(f"rate must be positive, got {self.rate_rps}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if (self.duration_s <= 0 or self.request_timeout_s <= 0
                or (self.num_requests is not None and self.num_requests < 1)):
            raise ValueError("duration, num_requests and request timeout must be positive")

    def under_limit(self, num_sent: int) -> bool:
        """Whether the --num-requests limit (if any) lets one more request go."""
        return self.num_requests is None or num_sent < self.num_requests


class RunResult(msgspec.Struct):
    records: list[RequestRecord]
    started_at_unix_s: float
    wall_s: float          # first send -> last request ended
    client_cpu_s: float    # user + system CPU of this process during the run


def api_root(base_url: str) -> str:
    """`http://h:p`, `http://h:p/` and `http://h:p/v1` all mean the same server."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def endpoint_url(base_url: str, api: Api) -> str:
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    return api_root(base_url) + path


async def fetch_model_id(base_url: str, timeout_s: float, api_key: str | None) -> str:
    """The first model the server lists at /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(api_root(base_url) + "/v1/models", headers=headers) as resp:
            resp.raise_for_status()
            body = await resp.json(content_type=None)
    models = body.get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


class _Run:
    """The mutable state of one run; owned by run_load."""

    def __init__(self, config: LoadConfig, planner: RequestPlanner, progress: ProgressBar,
                 session: aiohttp.ClientSession):
        self.config = config
        self.planner = planner
        self.progress = progress
        self.session = session
        self.url = endpoint_url(config.base_url, config.api)
        self.start_t = time.perf_counter()
        self.records: list[RequestRecord] = []
        self.num_sent = 0
        self.num_errors = 0

    def may_send(self) -> bool:
        return (self.config.under_limit(self.num_sent)
                and time.perf_counter() - self.start_t < self.config.duration_s)

    async def send(self, request: PlannedRequest, scheduled_s: float | None) -> None:
        cfg = self.config
        payload = build_payload(cfg.api, cfg.model, request, cfg.ignore_eos, cfg.temperature)
        headers = build_headers(request, cfg.api_key)
        headers.update(cfg.extra_headers)
        record = await send_request(self.session, self.url, cfg.api, payload, headers, request,
                                    cfg.request_timeout_s, self.start_t, scheduled_s)
        self.records.append(record)
        self.num_errors += record.error is not None
        self.progress.update(self.num_sent, len(self.records), self.num_errors)

    async def open_loop(self, tg: asyncio.TaskGroup) -> None:
        cfg = self.config
        # Own stream for arrivals: the request sequence does not depend on the rate.
        gaps = arrival_gaps_s(random.Random(f"arrivals:{cfg.seed}"), cfg.rate_rps,  # type: ignore[arg-type]
                              cfg.arrival, cfg.burstiness)
        scheduled_s = 0.0
        request = self.planner.next_request()
        while scheduled_s < cfg.duration_s and cfg.under_limit(self.num_sent):
            delay_s = self.start_t + scheduled_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tg.create_task(self.send(request, scheduled_s))
            self.num_sent += 1
            self.progress.update(self.num_sent, len(self.records), self.num_errors)
            scheduled_s += next(gaps)
            request = self.planner.next_request()

    async def closed_loop_worker(self) -> None:
        while self.may_send():
            request = self.planner.next_request()
            self.num_sent += 1
            await self.send(request, None)


async def run_load(config: LoadConfig, planner: RequestPlanner,
                   progress: ProgressBar) -> RunResult:
    connector = aiohttp.TCPConnector(limit=0)  # never queue requests inside the client
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    started_at = time.time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu_before = os.times()
        run = _Run(config, planner, progress, session)
        try:
            async with asyncio.TaskGroup() as tg:
                if config.rate_rps is not None:
                    await run.open_loop(tg)
                else:
                    for _ in range(config.concurrency):  # type: ignore[arg-type]
                        tg.create_task(run.closed_loop_worker())
        finally:
            progress.close()
        wall_s = time.perf_counter() - run.start_t
        cpu_after = os.times()
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    records = sorted(run.records, key=lambda r: r.index)
    return RunResult(records=records, started_at_unix_s=started_at, wall_s=wall_s,
                     client_cpu_s=cpu_s)
