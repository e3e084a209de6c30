"""deploy/docker-compose.yml and its GPU override, resolved by the real Compose v2 binary."""

from __future__ import annotations

import importlib.util
import json
import os
import posixpath
import shutil
import subprocess
import time
from types import ModuleType

import pytest
import redis
import redis.exceptions
from deploy_tools import (COMPOSE_SECRETS, DEPLOY, compose_config, invocation_errors,
                          parsed_namespace, resolved_compose)

from launcher.redis_server import free_port
from telemetry.options import INTERNAL_TOKEN_ENV, REDIS_PASSWORD_ENV

pytestmark = pytest.mark.timeout(120)
PDSERVE_SERVICES = ("prefill", "decode", "gateway", "agent")
WORKERS = ("prefill", "decode")
# Variables a subcommand reads by name rather than through an option: `pdserve agent` takes
# the internal token from the environment only (agent/main.py), never as a flag.
ENV_ONLY = {"agent": {INTERNAL_TOKEN_ENV}}


def option_env(service: str, env: dict[str, str]) -> dict[str, str]:
    """The service's variables that must each map to an option of its subcommand."""
    return {k: v for k, v in env.items() if k not in ENV_ONLY.get(service, set())}


@pytest.fixture(scope="module")
def cluster() -> dict:
    return resolved_compose()


@pytest.fixture(scope="module")
def gpu_cluster() -> dict:
    return resolved_compose(("docker-compose.yml", "docker-compose.gpu.yml"))


def test_compose_files_resolve_quietly() -> None:
    for files in (("docker-compose.yml",), ("docker-compose.yml", "docker-compose.gpu.yml")):
        result = compose_config(files, COMPOSE_SECRETS, ("monitoring",))
        assert result.returncode == 0, f"{files}: {result.stderr}"


@pytest.mark.parametrize("missing", sorted(COMPOSE_SECRETS))
def test_compose_refuses_to_start_without_each_secret(missing: str) -> None:
    given = {k: v for k, v in COMPOSE_SECRETS.items() if k != missing}
    result = compose_config(("docker-compose.yml",), given)
    assert result.returncode != 0
    assert missing in result.stderr


def test_every_component_gives_redis_the_password_it_was_started_with(cluster: dict) -> None:
    services = cluster["services"]
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        assert env[REDIS_PASSWORD_ENV] == "test-redis-password", name
        assert "@" not in env["PDSERVE_REDIS_URL"], name  # the URL carries no password
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "test-redis-password"
    assert "test-redis-password" not in json.dumps(services["redis"]["command"])


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="needs redis-server and redis-cli (make test-tools)")
def test_the_compose_redis_run_for_real_asks_for_the_password(cluster: dict) -> None:
    """The redis service's command and health check, run here as the container would run
    them (on a free port): a client without the password is refused, the check passes."""
    redis_service = cluster["services"]["redis"]
    shell, flag, script = redis_service["command"]
    script = script.replace("$$", "$")  # `config` keeps Compose's escape; the container not
    port = free_port()
    env = {**os.environ, **redis_service["environment"]}
    server = subprocess.Popen([shell, flag, f"{script} --port {port} --bind 127.0.0.1"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cli, *check = redis_service["healthcheck"]["test"][1:]  # after "CMD"
        health = [cli, "-p", str(port), *check]
        deadline = time.monotonic() + 10
        while subprocess.run(health, env=env, capture_output=True, text=True).stdout.strip() \
                != "PONG":
            assert time.monotonic() < deadline, "the health check never passed"
            time.sleep(0.05)
        with redis.Redis(port=port) as anonymous:
            with pytest.raises(redis.exceptions.AuthenticationError):
                anonymous.get("pdserve:workers")
        with redis.Redis(port=port, password="test-redis-password") as client:
            assert client.ping()
    finally:
        server.terminate()
        server.wait(10)


def test_every_component_shares_the_same_token(cluster: dict) -> None:
    tokens = {cluster["services"][s]["environment"]["PDSERVE_INTERNAL_TOKEN"]
              for s in PDSERVE_SERVICES}
    assert tokens == {"test-token"}


def test_only_the_gateway_port_is_published(cluster: dict) -> None:
    services = cluster["services"]
    assert [p["target"] for p in services["gateway"]["ports"]] == [8000]
    assert services["gateway"]["ports"][0]["host_ip"] == "127.0.0.1"
    for name in WORKERS + ("redis", "agent"):
        assert not services[name].get("ports"), f"{name} publishes a port"
    # Fixed names would stop `--scale` (`--scale agent=0` turns the agent off).
    for name in WORKERS + ("agent",):
        assert "container_name" not in services[name]


def test_the_gateway_scales_like_the_pools() -> None:
    result = compose_config(("docker-compose.yml",), {**COMPOSE_SECRETS,
                                                        "GATEWAY_REPLICAS": "3"})
    assert result.returncode == 0, result.stderr
    gateway = json.loads(result.stdout)["services"]["gateway"]
    assert gateway["deploy"]["replicas"] == 3
    assert gateway["environment"]["PDSERVE_REPLICAS"] == "3"  # the 1/N fallback's N
    assert "container_name" not in gateway
    (port,) = gateway["ports"]
    assert port["published"] == "8000-8007"  # one host port per replica


def test_start_order_is_gated_on_health(cluster: dict) -> None:
    services = cluster["services"]
    for name in WORKERS:
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "/ready" in services[name]["healthcheck"]["test"]
    gateway_deps = services["gateway"]["depends_on"]
    for name in ("redis",) + WORKERS:
        assert gateway_deps[name]["condition"] == "service_healthy", name
    assert services["redis"]["healthcheck"]["test"][-2:] == ["redis-cli", "ping"]
    # The agent needs only Redis; nothing waits on it, and it serves no /ready.
    assert set(services["agent"]["depends_on"]) == {"redis"}
    assert services["agent"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["agent"]["healthcheck"]["test"] == ["CMD", "pdserve-healthcheck",
                                                        "/health"]
    assert "agent" not in services["gateway"]["depends_on"]


def test_workers_get_time_to_drain(cluster: dict) -> None:
    for name in WORKERS:
        service = cluster["services"][name]
        drain_s = float(service["command"][service["command"].index("--drain-timeout-s") + 1])
        grace = service["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) > drain_s, name


def test_tiers_file_is_mounted_where_the_gateway_reads_it(cluster: dict) -> None:
    gateway = cluster["services"]["gateway"]
    mounts = {v["target"]: v for v in gateway["volumes"]}
    tiers_path = gateway["environment"]["PDSERVE_TIERS"]
    assert mounts[tiers_path]["source"] == str(DEPLOY / "tiers.toml")
    assert mounts[tiers_path]["read_only"] is True


def test_monitoring_is_an_opt_in_profile() -> None:
    assert set(resolved_compose()["services"]) == {"redis", "prefill", "decode", "gateway",
                                                   "agent"}
    with_monitoring = resolved_compose(profiles=("monitoring",))["services"]
    assert {"prometheus", "grafana"} <= set(with_monitoring)
    grafana_sources = {v["source"] for v in with_monitoring["grafana"]["volumes"]}
    assert str(DEPLOY / "grafana" / "dashboards") in grafana_sources


@pytest.mark.parametrize("service", PDSERVE_SERVICES)
def test_service_runs_a_real_subcommand_with_real_options(cluster: dict, service: str) -> None:
    spec = cluster["services"][service]
    assert invocation_errors(f"compose {service}", spec["command"],
                             option_env(service, spec["environment"])) == []


@pytest.mark.parametrize("service", PDSERVE_SERVICES)
def test_service_environment_reaches_the_parser(cluster: dict, service: str) -> None:
    """Every PDSERVE_* variable of the service lands in the option it is meant for."""
    spec = cluster["services"][service]
    invocation_errors(f"compose {service}", spec["command"],
                      option_env(service, spec["environment"]))  # fails on a missing subcommand
    namespace = parsed_namespace(spec["command"], spec["environment"])
    for name, value in spec["environment"].items():
        dest = name.removeprefix("PDSERVE_").lower()
        if dest in namespace and value != "":
            assert _same(namespace[dest], value), \
                f"{service}: {name}={value!r} parsed as {namespace[dest]!r}"


def _same(parsed: object, text: str) -> bool:
    if str(parsed) == text:
        return True
    try:
        return float(parsed) == float(text)  # "30" -> 30.0
    except (TypeError, ValueError):
        return False


def healthcheck_module() -> ModuleType:
    """deploy/docker/healthcheck.py, the image's `pdserve-healthcheck` (not a package)."""
    spec = importlib.util.spec_from_file_location("pdserve_healthcheck",
                                                  DEPLOY / "docker" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_agent_restarts_workers_through_their_orchestrator(cluster: dict) -> None:
    """Compose has neither a supervisor the agent could signal nor a Kubernetes API: the
    agent asks a worker to exit, and the workers' `restart: unless-stopped` starts it again."""
    services = cluster["services"]
    agent = services["agent"]
    namespace = parsed_namespace(agent["command"], agent["environment"])
    assert namespace["command"] == "agent" and namespace["restart"] == "exit"
    assert not namespace["dry_run"]
    for name in WORKERS + ("agent",):
        assert services[name]["restart"] == "unless-stopped", name
    assert agent["image"] == services["gateway"]["image"]
    assert agent["environment"][INTERNAL_TOKEN_ENV] == "test-token"
    assert agent["environment"]["PDSERVE_REDIS_URL"] == \
        services["gateway"]["environment"]["PDSERVE_REDIS_URL"]


def test_agent_healthcheck_asks_the_port_the_agent_serves(cluster: dict) -> None:
    agent = cluster["services"]["agent"]
    namespace = parsed_namespace(agent["command"], agent["environment"])
    # What pdserve-healthcheck computes from the same variables, inside the container.
    url = healthcheck_module().base_url(agent["environment"])
    assert url == f"http://127.0.0.1:{namespace['port']}"
    assert namespace["port"] == 8300 and namespace["host"] == "0.0.0.0"


def test_agent_audit_log_lives_on_a_named_volume(cluster: dict) -> None:
    agent = cluster["services"]["agent"]
    audit_log = agent["environment"]["PDSERVE_AUDIT_LOG"]
    assert parsed_namespace(agent["command"], agent["environment"])["audit_log"] == audit_log
    mounts = {v["target"]: v for v in agent["volumes"]}
    mount = mounts[posixpath.dirname(audit_log)]
    # A named volume outlives `docker compose down` (without -v) and a recreated container.
    assert mount["type"] == "volume"
    assert mount["source"] in cluster["volumes"]
    assert not mount.get("read_only")


def test_gpu_override_gives_each_pool_its_own_gpu(gpu_cluster: dict) -> None:
    device_ids = []
    for name in WORKERS:
        service = gpu_cluster["services"][name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        device_ids += device["device_ids"]
        assert service["environment"]["PDSERVE_DEVICE"] == "cuda"
        assert service["image"] == gpu_cluster["services"]["gateway"]["image"]
        assert service["build"]["dockerfile"].endswith("Dockerfile.cuda")
    assert len(set(device_ids)) == len(device_ids) == 2


@pytest.mark.parametrize("service", WORKERS)
def test_gpu_services_still_run_real_options(gpu_cluster: dict, service: str) -> None:
    spec = gpu_cluster["services"][service]
    assert invocation_errors(f"gpu compose {service}", spec["command"],
                             option_env(service, spec["environment"])) == []
