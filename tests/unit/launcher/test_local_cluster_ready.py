"""`pdserve up` is ready only once every gateway replica is (launcher/local_cluster.py).
The replicas share one port, so /ready is asked over fresh connections; here the answers
are scripted (the real replicas are in tests/integration/test_kv_pressure.py)."""

from __future__ import annotations

from itertools import cycle

from launcher.local_cluster import LocalCluster, WorkerSpec
from protocol.messages import Role


def cluster(tmp_path, num_gateways: int, ready_answers) -> LocalCluster:
    spec = WorkerSpec(Role.DECODE, "cpu", "decode-0-abc")
    up = LocalCluster([spec], [], [], "http://127.0.0.1:1", tmp_path, None, lambda _: None,
                      num_gateways=num_gateways)
    answers = cycle(ready_answers)
    workers = {"workers": [{"id": "decode-0-abc", "state": "ready"}]}
    up._get_json = lambda path: workers if path == "/admin/workers" else next(answers)
    return up


def ready(gateway_id: str | None, ok: bool = True) -> dict:
    body: dict = {"ready": ok}
    if gateway_id is not None:
        body["admission_limits"] = {"mode": "shared", "gateway_id": gateway_id}
    return body


def test_one_replica_answering_ready_is_not_enough(tmp_path) -> None:
    up = cluster(tmp_path, 2, [ready("a"), ready("a"), ready("b", ok=False)])
    assert up.ready_line() == "gateway replicas ready: 0/2"
    up = cluster(tmp_path, 2, [ready("a")])  # the other one never answered
    assert up.ready_line() == "gateway replicas ready: 1/2"


def test_every_replica_ready_is_ready(tmp_path) -> None:
    assert cluster(tmp_path, 2, [ready("a"), ready("a"), ready("b")]).ready_line() is None
    assert cluster(tmp_path, 1, [ready(None)]).ready_line() is None


def test_replicas_without_names_are_ready_when_every_probe_is(tmp_path) -> None:
    assert cluster(tmp_path, 2, [ready(None)]).ready_line() is None
    assert cluster(tmp_path, 2, [ready(None), ready(None, ok=False)]).ready_line() == \
        "gateway replicas ready: 0/2"
