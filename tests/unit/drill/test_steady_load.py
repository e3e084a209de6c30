"""The drill's load runs until told to stop, lets the requests in flight finish, and keeps
each request's outcome and its start and end (against bench's stub server, in-process)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from bench.corpus import Corpus
from bench.planner import RequestPlanner
from bench.stub_server import build_app
from bench.workload import load_workload
from drill.steady_load import SteadyLoad


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_the_load_stops_when_told_and_keeps_every_outcome() -> None:
    async def main() -> None:
        runner, url = await serve(build_app(ttft_ms=20, tpot_ms=5,
                                            faults=("ok", "ok", "http_500")))
        try:
            planner = RequestPlanner(load_workload("steady"), Corpus.load(), seed=1)
            load = SteadyLoad(url, "stub", planner, rate_rps=40, request_timeout_s=10, seed=1)
            stop = asyncio.Event()
            task = asyncio.create_task(load.run(stop))
            await asyncio.sleep(0.5)
            stop.set()
            stopped_at = asyncio.get_running_loop().time()
            records = await asyncio.wait_for(task, 10)
            assert len(records) >= 5
            errors = [t.record.error for t in records]
            assert errors.count("http_500") >= 1 and errors.count(None) >= 2
            assert all(t.start_s <= t.end_s for t in records)
            assert all(t.start_s <= stopped_at for t in records)  # nothing sent after stop
            assert [t.start_s for t in records] == sorted(t.start_s for t in records)
            ok = [t for t in records if t.record.error is None]
            assert all(t.record.output_tokens > 0 for t in ok)
        finally:
            await runner.cleanup()

    asyncio.run(main())
