"""The /admin API of a real gateway process (stub workers, no API keys): closed by default.

A role change needs the cluster's admin token, as JSON, from no foreign Origin; the views
stay open on a loopback-only gateway, to loopback names only; a gateway with no admin
token takes no role change at all (gateway/ops/admin_access.py)."""

from __future__ import annotations

import httpx2 as httpx
import pytest
from gateway_cluster import GatewayCluster, launch, shutdown, start_gateway, wait_ready

from protocol.messages import Role

pytestmark = pytest.mark.timeout(60)
TOKEN = "test-admin-token-5f2c9a"
BODY = b'{"role": "prefill", "drain_timeout_s": 1}'


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    running = launch(redis_url, tmp_path_factory.mktemp("gateway"),
                     env={"PDSERVE_ADMIN_TOKEN": TOKEN})
    yield running
    assert shutdown(running) == 0


def change_role(url: str, worker_id: str, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/admin/workers/{worker_id}/role", content=BODY,
                      headers=headers, timeout=10)


def assert_refused(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


JSON = {"Content-Type": "application/json"}
AUTHORIZED = {**JSON, "Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("headers, status, code", [
    (JSON, 401, "missing_admin_token"),
    ({**JSON, "Authorization": "Bearer not-the-token"}, 401, "invalid_admin_token"),
    ({**AUTHORIZED, "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ({**AUTHORIZED, "Origin": "http://evil.example"}, 403, "foreign_origin"),
    ({**AUTHORIZED, "Origin": "null"}, 403, "foreign_origin"),  # a sandboxed page, a file
    ({**JSON, "Origin": "http://evil.example"}, 403, "foreign_origin"),  # a page's POST
])
def test_a_role_change_without_the_token_json_or_own_origin_is_refused(
        cluster: GatewayCluster, headers: dict[str, str], status: int, code: str) -> None:
    assert_refused(change_role(cluster.url, cluster.decode.worker_id, headers), status, code)
    assert cluster.decode.role_changes == []  # nothing reached the worker


def test_a_role_change_with_the_token_as_json_reaches_the_worker(
        cluster: GatewayCluster) -> None:
    own_page = {**AUTHORIZED, "Origin": cluster.url}  # the gateway's own page may ask too
    for headers in (AUTHORIZED, own_page):
        response = change_role(cluster.url, cluster.decode.worker_id, headers)
        assert response.status_code == 200, response.text
        assert response.json()["id"] == cluster.decode.worker_id
        assert response.json()["role"] == "prefill"
    assert cluster.decode.role_changes == [Role.PREFILL, Role.PREFILL]
    cluster.decode.role_changes.clear()


def test_the_views_are_open_to_loopback_names_only(cluster: GatewayCluster) -> None:
    for path in ("/admin/workers", "/admin/cluster", "/admin/state"):
        assert httpx.get(cluster.url + path, timeout=5).status_code == 200, path
        # A page whose own name resolves to 127.0.0.1 (DNS rebinding) sends that name.
        rebound = httpx.get(cluster.url + path, headers={"Host": "evil.example"}, timeout=5)
        assert_refused(rebound, 401, "missing_admin_token")
        authorized = httpx.get(cluster.url + path, timeout=5,
                               headers={"Host": "evil.example", "Authorization": f"Bearer {TOKEN}"})
        assert authorized.status_code == 200, authorized.text
    page = httpx.get(cluster.url + "/dashboard", timeout=5)  # holds no data: always served
    assert page.status_code == 200


def test_a_gateway_without_an_admin_token_takes_no_role_change(
        cluster: GatewayCluster, redis_url: str, tmp_path) -> None:
    tiers = tmp_path / "tiers.toml"
    tiers.write_text("")
    process, url = start_gateway(redis_url, cluster.namespace, tiers,
                                 env={"PDSERVE_ADMIN_TOKEN": ""})
    try:
        wait_ready(url)
        for headers in (JSON, AUTHORIZED):
            assert_refused(change_role(url, cluster.decode.worker_id, headers), 403,
                           "admin_disabled")
        assert httpx.get(url + "/admin/workers", timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(10)
        process.stdout.close()
    assert cluster.decode.role_changes == []
