"""The agent's restarters against real processes and a real HTTPS server standing in for
the Kubernetes API (a self-signed certificate the restarter must verify, a bearer token,
the pod's labels checked before anything is deleted). The local restarter asks a real
supervisor (launcher/supervisor.py) over its restart line (launcher/restart_line.py), as
under `pdserve up`: only processes that supervisor started as workers can be killed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from agent.actuator import ActionError, Actuator
from agent.restarters import ExitRestarter, KubernetesRestarter, RestartError, SupervisorRestarter
from launcher.restart_line import RestartLine
from launcher.supervisor import Child, Supervisor
from protocol.agent_messages import (ExitRequest, ExitResponse, RestartWorkerRequest,
                                     RestartWorkerResponse)
from protocol.messages import ErrorCode, MessageDecoder, Role, WorkerInfo, encode
from rpc.channel_client import ChannelPool
from rpc.control_server import ControlServer, RequestRejected, add_call, make_app
from worker.runtime import exit_refusal

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def info(worker_id: str, pid: int = 0, url: str = "http://127.0.0.1:1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=Role.DECODE, model="tiny", control_url=url,
                      num_kv_blocks=8, block_size=16, pid=pid)


SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def sleeper(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*SLEEP, *argv], start_new_session=True)


@contextlib.asynccontextmanager
async def supervised(tmp_path: Path, allow: bool = True
                     ) -> AsyncIterator[tuple[Supervisor, dict[str, Child], RestartLine]]:
    """A supervisor with one worker (decode-7) and one child that is no worker (the
    gateway, started with the worker's id among its arguments, as `launcher.cli gateway`
    has "gateway"), its restart line answered every 20 ms."""
    supervisor = Supervisor(tmp_path)
    workers = {"decode-7": supervisor.start("decode worker 0", [*SLEEP, "--worker-id",
                                                                "decode-7"])}
    supervisor.start("gateway", [*SLEEP, "gateway", "decode-7"], essential=True)
    line = RestartLine()

    async def answer() -> None:
        while True:
            line.answer(supervisor, workers, allow)
            await asyncio.sleep(0.02)

    answering = asyncio.create_task(answer())
    try:
        yield supervisor, workers, line
    finally:
        answering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answering
        supervisor.stop_all(5.0)
        line.close()


def agent_end(line: RestartLine) -> SupervisorRestarter:
    return SupervisorRestarter(socket.socket(fileno=os.dup(line.agent_fd)), timeout_s=2.0)


async def test_local_restarts_go_through_the_supervisor_and_never_hit_a_stranger(
        tmp_path: Path) -> None:
    stranger = sleeper("--worker-id", "decode-7")  # a pid a registry entry might name
    try:
        async with supervised(tmp_path) as (supervisor, workers, line):
            worker = workers["decode-7"]
            gateway = next(c for c in supervisor.children if c.name == "gateway")
            restarter = agent_end(line)
            # The worker's id with another process's pid (the stranger's, the gateway's):
            # the supervisor's own child is not that process, and nothing else is touched.
            for pid in (stranger.pid, gateway.pid, os.getpid()):
                outcome = await restarter.restart(info("decode-7", pid), "hung")
                assert "nothing killed" in outcome, outcome
            # An id this supervisor did not start as a worker: refused.
            for worker_id in ("decode-8", "gateway-0"):
                with pytest.raises(RestartError, match="no worker this supervisor started"):
                    await restarter.restart(info(worker_id, gateway.pid), "hung")
            assert stranger.poll() is None and gateway.returncode() is None
            assert worker.returncode() is None
            # Its own worker, as the registry names it: killed by the supervisor's handle.
            pid = worker.pid
            outcome = await restarter.restart(info("decode-7", pid), "hung")
            assert outcome.startswith(f"killed pid {pid} (decode worker 0")
            assert worker.process is not None and worker.process.wait(5) == -9
            assert "exited already" in await restarter.restart(info("decode-7", pid), "hung")
            supervisor.restart(worker)  # what `pdserve up`'s supervise() does next
            assert worker.pid != pid and worker.returncode() is None
            assert stranger.poll() is None and gateway.returncode() is None
            restarter.line.close()
    finally:
        stranger.kill()
        stranger.wait()


async def test_the_line_refuses_what_is_no_worker_and_everything_while_starting(
        tmp_path: Path) -> None:
    async with supervised(tmp_path, allow=False) as (supervisor, workers, line):
        restarter = agent_end(line)
        with pytest.raises(RestartError, match="still starting"):
            await restarter.restart(info("decode-7", workers["decode-7"].pid), "hung")
        # A request naming the gateway, written to the line by hand (no agent would: the
        # id does not decode as a worker id), is dropped; so is garbage.
        agent = socket.socket(fileno=os.dup(line.agent_fd))
        agent.setblocking(False)
        bogus = RestartWorkerRequest(number=1, worker_id="gateway", pid=0)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(agent, encode(bogus))
        await loop.sock_sendall(agent, b"\xc1 not a message")
        await asyncio.sleep(0.2)
        with pytest.raises(BlockingIOError):
            agent.recv(4096)  # no answer to either
        assert all(child.returncode() is None for child in supervisor.children)
        agent.close()
        restarter.line.close()
        # And the agent never asks for one: the actuator refuses an id that is no worker's.
        actuator = Actuator(None, restarter, ChannelPool(None))  # type: ignore[arg-type]
        with pytest.raises(ActionError, match="not a worker id"):
            await actuator.restart(info("gateway", os.getpid()), "hung")


async def test_a_late_answer_is_not_taken_for_the_next_one(tmp_path: Path) -> None:
    """An answer to a request that timed out is skipped by its number."""
    theirs, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    restarter = SupervisorRestarter(ours, timeout_s=2.0)
    requests: MessageDecoder[RestartWorkerRequest] = MessageDecoder(RestartWorkerRequest)

    def supervisor_side() -> None:
        request = requests.decode(theirs.recv(4096))
        for number, outcome in ((request.number + 1, "stale"), (request.number, "fresh")):
            theirs.send(encode(RestartWorkerResponse(number=number, status="killed",
                                                     outcome=outcome)))

    answering = asyncio.get_running_loop().run_in_executor(None, supervisor_side)
    assert await restarter.restart(info("decode-7", 1), "hung") == "fresh"
    await answering
    theirs.close()
    ours.close()


@pytest.fixture
def account(tmp_path: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "ca.crt")],
                   check=True, capture_output=True)
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "namespace").write_text("serving\n")
    return tmp_path


@pytest.fixture
async def kube_api(account: Path, monkeypatch) -> AsyncIterator[dict]:
    """A Kubernetes API holding three pods; records every call it gets."""
    seen: dict = {"calls": [], "pods": {
        "decode-abc": {"app.kubernetes.io/component": "decode"},
        "gateway-xyz": {"app.kubernetes.io/component": "gateway"}}}

    async def pod(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        seen["calls"].append((request.method, request.match_info["namespace"], name,
                              request.headers.get("Authorization"), dict(request.query)))
        if name not in seen["pods"]:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        if request.method == "DELETE":
            del seen["pods"][name]
            return web.json_response({"kind": "Pod"})
        return web.json_response({"metadata": {"name": name, "labels": seen["pods"][name]}})

    app = web.Application()
    app.router.add_route("*", "/api/v1/namespaces/{namespace}/pods/{name}", pod)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(account / "ca.crt", account / "key.pem")
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(runner.addresses[0][1]))
    yield seen
    await runner.cleanup()


async def test_kubernetes_deletes_the_worker_pod_only(account: Path, kube_api: dict) -> None:
    async with aiohttp.ClientSession() as session:
        restarter = KubernetesRestarter(session, account=account)
        outcome = await restarter.restart(info("decode-abc"), "hung")
        assert outcome == "deleted pod serving/decode-abc: its Deployment starts another"
        get, delete = kube_api["calls"]
        assert get[:4] == ("GET", "serving", "decode-abc", "Bearer sa-token")
        assert delete == ("DELETE", "serving", "decode-abc", "Bearer sa-token",
                          {"gracePeriodSeconds": "0"})
        # A registry entry naming the gateway's pod deletes nothing.
        with pytest.raises(RestartError, match="not a worker"):
            await restarter.restart(info("gateway-xyz"), "hung")
        assert "gateway-xyz" in kube_api["pods"]
        assert [c[0] for c in kube_api["calls"]] == ["GET", "DELETE", "GET"]
        assert "gone already" in await restarter.restart(info("decode-abc"), "hung")


async def test_kubernetes_refuses_without_a_service_account(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RestartError, match="no Kubernetes service account"):
            await KubernetesRestarter(session, account=tmp_path).restart(info("d"), "hung")


async def test_an_exit_for_a_dead_epoch_does_not_stop_its_replacement() -> None:
    """Under compose a restarted container keeps its address (and often its worker id): the
    exit the agent meant for epoch 1 reaches the process that registered epoch 2, which
    refuses it; the agent records the restart as done already."""
    taken: list[ExitRequest] = []

    async def on_exit(request: ExitRequest) -> ExitResponse:
        refusal = exit_refusal(request, {2})
        if refusal is not None:
            raise RequestRejected(ErrorCode.STALE_EPOCH, refusal)
        taken.append(request)
        return ExitResponse(pid=4242)

    app = make_app(None)
    add_call(app, ExitRequest, on_exit)
    server = ControlServer(app)
    url = await server.start()
    pool = ChannelPool(None)
    try:
        restarter = ExitRestarter(pool)
        dead = msgspec.structs.replace(info("decode-x-6", url=url), epoch=1)
        assert "exited already" in await restarter.restart(dead, "dead")
        assert taken == []
        live = msgspec.structs.replace(dead, epoch=2)
        assert await restarter.restart(live, "hung") == \
            "pid 4242 exits: its orchestrator restarts it"
        assert [request.epoch for request in taken] == [2]
    finally:
        await pool.aclose()
        await server.stop()
