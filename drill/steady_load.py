"""A drill's load: open-loop requests from a workload preset until told to stop.

`pdserve bench`'s run (bench/loadgen.py) ends after a fixed duration; a drill's phases last
as long as the cluster takes to recover, so this load runs until `stop` is set. It sends
bench's planned requests (bench/planner.py) at seeded Poisson arrivals, each through bench's
SSE client (never raises: a fault is a record's error kind), and keeps when each ended.

Lifecycle: run(stop) → sending → `stop` set → no more sent; the requests in flight finish
(each within its timeout) → the records. Invariant: every request task belongs to run()'s
TaskGroup and has ended when run() returns.
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import msgspec

from bench.arrivals import arrival_gaps_s
from bench.loadgen import CONNECT_TIMEOUT_S, endpoint_url
from bench.planner import PlannedRequest, RequestPlanner
from bench.sse_client import RequestRecord, build_headers, build_payload, send_request


class TimedRecord(msgspec.Struct):
    """One request, its start and end on the drill's clock (time.monotonic(), seconds)."""

    record: RequestRecord
    start_s: float
    end_s: float


class SteadyLoad:
    def __init__(self, base_url: str, model: str, planner: RequestPlanner, rate_rps: float,
                 request_timeout_s: float, seed: int) -> None:
        if rate_rps <= 0:
            raise ValueError(f"the rate must be positive, got {rate_rps}")
        self.url = endpoint_url(base_url, "chat")
        self.model = model
        self.planner = planner
        self.rate_rps = rate_rps
        self.request_timeout_s = request_timeout_s
        self.seed = seed

    async def _send(self, session: aiohttp.ClientSession, request: PlannedRequest,
                    out: list[TimedRecord]) -> None:
        payload = build_payload("chat", self.model, request, False, None)
        start_s = time.monotonic()
        record = await send_request(session, self.url, "chat", payload,
                                    build_headers(request, None), request,
                                    self.request_timeout_s, time.perf_counter(), None)
        out.append(TimedRecord(record, start_s, time.monotonic()))

    async def run(self, stop: asyncio.Event) -> list[TimedRecord]:
        out: list[TimedRecord] = []
        gaps = arrival_gaps_s(random.Random(f"drill:{self.seed}"), self.rate_rps)
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            async with asyncio.TaskGroup() as tg:
                while not stop.is_set():
                    tg.create_task(self._send(session, self.planner.next_request(), out))
                    try:
                        await asyncio.wait_for(stop.wait(), next(gaps))
                    except TimeoutError:
                        pass
        return sorted(out, key=lambda t: t.start_s)
