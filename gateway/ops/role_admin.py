"""POST /admin/workers/{worker_id}/role: change a worker's role at run time, through the
gateway (which holds the cluster's internal token).

    request   {"role": "prefill" | "decode" | "both" | "colocated", "drain_timeout_s": 30}
    answer    {"id", "role", "epoch", "num_aborted"}  (the worker's RoleChangeResponse)
    errors    400 bad body, 401/403 no admin token or admin key (gateway/ops/admin_access.py),
              403 a foreign Origin, 415 not application/json, 404 unknown worker, 502 the
              worker failed or did not answer within drain_timeout_s + 10 s

The worker refuses new work its new role forbids at once, lets what it has in flight finish
for drain_timeout_s, then registers the new role under a new epoch
(worker/role_gate.py); the gateway routes by the new role from its next poll.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web

from gateway.api.errors import ApiError, invalid_request
from gateway.upstream.cluster import ClusterView
from protocol.messages import MAX_TIMEOUT_MS, Role, RoleChangeRequest, RoleChangeResponse
from rpc.control_client import ControlClient
from rpc.errors import ControlError

MAX_BODY_BYTES = 4096
ANSWER_MARGIN_S = 10.0


class RoleChange(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    drain_timeout_s: float = 30.0


class RoleChanged(msgspec.Struct):
    id: str
    role: str
    epoch: int
    num_aborted: int


def parse_role_change(body: bytes) -> RoleChangeRequest:
    """The request body as a RoleChangeRequest; ApiError(400) with a clear message if not."""
    if len(body) > MAX_BODY_BYTES:
        raise invalid_request(f"the body must be under {MAX_BODY_BYTES} bytes")
    try:
        change = msgspec.json.decode(body, type=RoleChange)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise invalid_request(f"expected {{\"role\": ..., \"drain_timeout_s\": ...}}: {exc}")
    roles = [r.value for r in Role]
    if change.role not in roles:
        raise invalid_request(f"role must be one of {', '.join(roles)}", param="role")
    if not 0 < change.drain_timeout_s * 1000 <= MAX_TIMEOUT_MS:
        raise invalid_request(f"drain_timeout_s must be in (0, {MAX_TIMEOUT_MS // 1000}]",
                              param="drain_timeout_s")
    return RoleChangeRequest(role=Role(change.role),
                             drain_timeout_ms=max(1, int(change.drain_timeout_s * 1000)))


async def change_worker_role(cluster: ClusterView, client_for: Callable[[str], ControlClient],
                             worker_id: str, body: bytes) -> RoleChanged:
    change = parse_role_change(body)
    info = cluster.workers.get(worker_id)
    if info is None:
        raise ApiError(404, f"No live worker {worker_id!r}.", code="worker_not_found")
    client = client_for(info.control_url)
    try:
        answer = await client.call(change, RoleChangeResponse,
                                   timeout_s=change.drain_timeout_ms / 1000 + ANSWER_MARGIN_S)
    except ControlError as exc:
        raise ApiError(502, f"Worker {worker_id} did not change its role: {exc}",
                       code="worker_failed") from None
    return RoleChanged(id=worker_id, role=answer.role.value, epoch=answer.epoch,
                       num_aborted=answer.num_aborted)


def json_answer(changed: RoleChanged) -> web.Response:
    return web.Response(body=msgspec.json.encode(changed), content_type="application/json")
