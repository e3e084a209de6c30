"""How the agent restarts a worker process, one way per kind of deployment.

    local       the worker runs on this host under the supervisor that started this agent
                (`pdserve up`): ask that supervisor, over the line only the two share
                (launcher/restart_line.py), to restart the worker it started under this
                id; it SIGKILLs that child's process group by its own handle and starts it
                again (a new process, a new epoch). Works on a frozen (SIGSTOP) or hung
                process too. The agent never signals a process itself: a pid read from the
                registry (which a process that can reach Redis may write) names nothing to
                kill; the supervisor refuses any id it did not start (the gateway, Redis,
                the agent, a stranger), and kills only while the worker still runs as the
                pid the agent saw.
    exit        ask the worker to exit (POST /internal/exit): its orchestrator (compose
                `restart: unless-stopped`, systemd) starts it again. A frozen worker cannot
                answer: the call fails, the ejection stays, and an operator must act. The
                request names the epoch judged, so a replacement the orchestrator started
                at the same address refuses it (stale_epoch: done already).
    kubernetes  delete the worker's pod through the Kubernetes API (the worker id is the
                pod name; the pod's service-account token and CA); its Deployment starts a
                new one. Only a pod labelled as a worker (app.kubernetes.io/component
                prefill or decode) is deleted: a registry entry naming another pod (the
                gateway's, Redis's) is refused. Deleted with no grace period: the worker is
                frozen, hung or failing, and its streams move elsewhere anyway.
    auto        local for workers whose control API is on a loopback address when a
                supervisor's line was given (`--supervisor-fd`), else exit.
    none        never restart: eject only.

Every restarter returns what happened as one line for the audit log, or raises
RestartError with why it could not.
"""

from __future__ import annotations

import asyncio
import enum
import os
import secrets
import socket
import ssl
from pathlib import Path
from typing import Protocol
from urllib.parse import quote

import aiohttp

from agent.observer import is_local
from protocol.agent_messages import (ExitRequest, ExitResponse, RestartStatus, RestartWorkerRequest,
                                     RestartWorkerResponse)
from protocol.messages import ErrorCode, MessageDecoder, ProtocolError, WorkerInfo, encode
from rpc.channel_client import ChannelPool
from rpc.control_client import ControlClient
from rpc.errors import ControlError, RemoteError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
WORKER_COMPONENTS = frozenset({"prefill", "decode"})  # the pools' pod labels (deploy/)


class RestartError(RuntimeError):
    pass


class RestartMode(enum.StrEnum):
    AUTO = "auto"
    LOCAL = "local"
    EXIT = "exit"
    KUBERNETES = "kubernetes"
    NONE = "none"


class Restarter(Protocol):
    async def restart(self, info: WorkerInfo, reason: str) -> str: ...


class SupervisorRestarter:
    """`local`: ask the supervisor that started the worker (see the module docstring).

    Lifecycle of a request: sent → answered (matched by its random number: an answer to an
    earlier request that timed out, or to a previous agent on the same line, is skipped)
    → done; or no answer within `timeout_s`: RestartError. One request at a time."""

    def __init__(self, line: socket.socket, timeout_s: float = 5.0) -> None:
        line.setblocking(False)
        self.line = line
        self.timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._answers: MessageDecoder[RestartWorkerResponse] = MessageDecoder(
            RestartWorkerResponse, 1 << 16)

    async def restart(self, info: WorkerInfo, reason: str) -> str:
        request = RestartWorkerRequest(number=secrets.randbits(62), worker_id=info.worker_id,
                                       pid=info.pid, reason=reason[:1000])
        loop = asyncio.get_running_loop()
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await loop.sock_sendall(self.line, encode(request))
                    while True:
                        data = await loop.sock_recv(self.line, 1 << 16)
                        if not data:
                            raise RestartError("the supervisor closed the restart line")
                        answer = self._answers.decode(data)
                        if answer.number == request.number:
                            break
            except TimeoutError:
                raise RestartError(f"the supervisor did not answer within "
                                   f"{self.timeout_s:g} s") from None
            except (OSError, ProtocolError) as exc:
                raise RestartError(f"the supervisor's restart line failed: {exc!r}") from None
        if answer.status is RestartStatus.REFUSED:
            raise RestartError(answer.outcome)
        return answer.outcome


class ExitRestarter:
    def __init__(self, channels: ChannelPool, timeout_s: float = 2.0) -> None:
        self.channels = channels
        self.timeout_s = timeout_s

    async def restart(self, info: WorkerInfo, reason: str) -> str:
        client = ControlClient(info.control_url, self.channels)
        try:
            answer = await client.call(ExitRequest(reason=reason[:1000], epoch=info.epoch),
                                       ExitResponse, timeout_s=self.timeout_s)
        except RemoteError as exc:
            if exc.frame.code is ErrorCode.STALE_EPOCH:
                # Its orchestrator restarted it already, at the same address.
                return f"epoch {info.epoch} exited already: {exc.frame.message}"
            raise RestartError(f"the worker did not take the exit request: {exc}") from None
        except ControlError as exc:
            raise RestartError(f"the worker did not take the exit request: {exc}") from None
        return f"pid {answer.pid} exits: its orchestrator restarts it"


class KubernetesRestarter:
    def __init__(self, session: aiohttp.ClientSession, namespace: str | None = None,
                 timeout_s: float = 5.0, account: Path = SERVICE_ACCOUNT) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.account = account
        self.namespace = namespace

    def _api(self) -> tuple[str, str, ssl.SSLContext, str]:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        try:
            token = (self.account / "token").read_text().strip()
            namespace = self.namespace or (self.account / "namespace").read_text().strip()
            context = ssl.create_default_context(cafile=str(self.account / "ca.crt"))
        except (OSError, ssl.SSLError) as exc:
            raise RestartError(f"no Kubernetes service account here: {exc}") from None
        if not host:
            raise RestartError("KUBERNETES_SERVICE_HOST is not set: not in a pod")
        return f"https://{host}:{port}", token, context, namespace

    async def restart(self, info: WorkerInfo, reason: str) -> str:
        base, token, context, namespace = self._api()
        url = (f"{base}/api/v1/namespaces/{quote(namespace, safe='')}/pods/"
               f"{quote(info.worker_id, safe='')}")
        headers = {"Authorization": f"Bearer {token}"}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self.session.get(url, ssl=context, headers=headers,
                                        timeout=timeout) as response:
                if response.status == 404:
                    return f"pod {namespace}/{info.worker_id} is gone already"
                if response.status >= 300:
                    raise RestartError(f"reading pod {namespace}/{info.worker_id}: HTTP "
                                       f"{response.status}")
                pod = await response.json(content_type=None)
            labels = (pod.get("metadata") or {}).get("labels") or {}
            component = labels.get("app.kubernetes.io/component")
            if component not in WORKER_COMPONENTS:
                raise RestartError(f"pod {namespace}/{info.worker_id} is not a worker "
                                   f"(component {component!r}): not deleted")
            async with self.session.delete(
                    url, params={"gracePeriodSeconds": "0"}, ssl=context, headers=headers,
                    timeout=timeout) as response:
                if response.status == 404:
                    return f"pod {namespace}/{info.worker_id} is gone already"
                if response.status >= 300:
                    detail = (await response.content.read(500)).decode(errors="replace")
                    raise RestartError(f"deleting pod {namespace}/{info.worker_id}: HTTP "
                                       f"{response.status}: {detail}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise RestartError(f"the Kubernetes API did not answer: {exc!r}") from None
        return f"deleted pod {namespace}/{info.worker_id}: its Deployment starts another"


class NoRestarter:
    async def restart(self, info: WorkerInfo, reason: str) -> str:
        raise RestartError("restarts are off (--restart none): ejected only")


class AutoRestarter:
    def __init__(self, local: Restarter, remote: Restarter) -> None:
        self.local = local
        self.remote = remote

    async def restart(self, info: WorkerInfo, reason: str) -> str:
        chosen = self.local if is_local(info) else self.remote
        return await chosen.restart(info, reason)


def make_restarter(mode: RestartMode, session: aiohttp.ClientSession, channels: ChannelPool,
                   kube_namespace: str | None = None,
                   supervisor: socket.socket | None = None) -> Restarter:
    """`session`: for the Kubernetes API; `channels`: the workers' (an exit request);
    `supervisor`: the restart line to the supervisor that started this agent, if one did.
    Raises ValueError for `local` without a supervisor's line."""
    if mode is RestartMode.LOCAL:
        if supervisor is None:
            raise ValueError("--restart local restarts workers through the supervisor that "
                             "started them and this agent (`pdserve up` passes "
                             "--supervisor-fd); without one use exit, kubernetes or none")
        return SupervisorRestarter(supervisor)
    if mode is RestartMode.EXIT:
        return ExitRestarter(channels)
    if mode is RestartMode.KUBERNETES:
        return KubernetesRestarter(session, kube_namespace)
    if mode is RestartMode.NONE:
        return NoRestarter()
    exit_restarter = ExitRestarter(channels)
    local = exit_restarter if supervisor is None else SupervisorRestarter(supervisor)
    return AutoRestarter(local, exit_restarter)
