"""The agent's restarters against real processes and a real HTTPS server standing in for
the Kubernetes API (a self-signed certificate the restarter must verify, a bearer token,
the pod's labels checked before anything is deleted)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from agent.restarters import KubernetesRestarter, LocalRestarter, RestartError
from protocol.messages import Role, WorkerInfo

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


def info(worker_id: str, pid: int = 0, url: str = "http://127.0.0.1:1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=Role.DECODE, model="tiny", control_url=url,
                      num_kv_blocks=8, block_size=16, pid=pid)


def sleeper(*argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *argv],
                            start_new_session=True)


async def test_local_restarts_kill_the_worker_and_never_a_stranger() -> None:
    worker = sleeper("--worker-id", "decode-7")
    stranger = sleeper("--worker-id", "decode-8")  # a pid the registry might still name
    try:
        outcome = await LocalRestarter().restart(info("decode-7", worker.pid), "hung")
        assert "killed pid" in outcome and worker.wait(5) == -9
        outcome = await LocalRestarter().restart(info("decode-7", stranger.pid), "hung")
        assert "gone already" in outcome and stranger.poll() is None
        with pytest.raises(RestartError):
            await LocalRestarter().restart(info("decode-7"), "hung")  # no pid registered
    finally:
        for process in (worker, stranger):
            process.kill()
            process.wait()


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
