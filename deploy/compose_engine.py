"""The container engine and compose tool under deploy/compose_smoke.py: podman with
podman-compose, or docker with `docker compose`; only what the smoke run asks of them.

Containers are found by the labels both compose tools put on them
(`com.docker.compose.project`, `com.docker.compose.service`), never by name, since the two
tools name replicas differently (`pdserve-smoke_decode_1`, `pdserve-smoke-decode-1`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
HEALTH_TICK_S = 2.0
# Run inside a container: SIGKILL every child of PID 1 (tini), which is the pdserve process.
KILL_CHILDREN_OF_INIT = (
    "import os, signal\n"
    "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try:\n"
    "        ppid = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1]\n"
    "    except OSError:\n"
    "        continue\n"
    "    if ppid == '1':\n"
    "        os.kill(int(pid), signal.SIGKILL)\n")


class SmokeFailure(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


def deadline_loop(what: str, timeout_s: float, done: Callable[[], bool],
                  period_s: float = 1.0) -> None:
    """Call `done` until it returns True; SmokeFailure naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if done():
                return
        except OSError:
            pass  # a port not yet open, a connection reset: try again until the deadline
        if time.monotonic() > deadline:
            raise SmokeFailure("wait", f"{what}: not done within {timeout_s:.0f} s")
        time.sleep(period_s)


class ComposeEngine:
    def __init__(self, binary: str, compose_command: list[str], project: str,
                 compose_file: Path, env: dict[str, str]) -> None:
        self.binary = binary
        self.compose_command = compose_command
        self.project = project
        self.compose_file = compose_file
        self.env = env
        self._ticker: threading.Thread | None = None
        self._ticker_stop = threading.Event()

    def describe(self) -> str:
        return f"{self.binary} {self.version()}, {' '.join(self.compose_command)}"

    def version(self) -> str:
        return self.output([self.binary, "version", "--format", "{{.Client.Version}}"]).strip()

    # ------------------------------------------------------------ processes

    def check_call(self, args: Sequence[str], timeout_s: float) -> None:
        try:
            subprocess.run(args, check=True, env=self.env, timeout=timeout_s)
        except subprocess.CalledProcessError as exc:
            raise SmokeFailure("command", f"{' '.join(args)} exited {exc.returncode}") from None
        except subprocess.TimeoutExpired:
            raise SmokeFailure("command", f"{' '.join(args)}: over {timeout_s:.0f} s") from None

    def output(self, args: Sequence[str], timeout_s: float = 60) -> str:
        done = subprocess.run(args, capture_output=True, text=True, env=self.env,
                              timeout=timeout_s)
        if done.returncode != 0:
            raise SmokeFailure("command", f"{' '.join(args)} exited {done.returncode}: "
                                          f"{done.stderr.strip()[-2000:]}")
        return done.stdout

    def compose(self, args: Sequence[str], timeout_s: float,
                profiles: Sequence[str] = ()) -> None:
        command = list(self.compose_command)
        if self.binary == "podman":
            command += ["--in-pod", "false"]  # containers, not a pod: pools scale
        command += ["-p", self.project, "-f", str(self.compose_file)]
        for profile in profiles:
            command += ["--profile", profile]
        self.check_call(command + list(args), timeout_s)

    # ------------------------------------------------------------ images

    def image_exists(self, image: str) -> bool:
        return subprocess.run([self.binary, "image", "inspect", image], capture_output=True,
                              env=self.env).returncode == 0

    def image_size_mb(self, image: str) -> float:
        return int(self.output([self.binary, "image", "inspect", "--format", "{{.Size}}",
                                image]).strip()) / 1e6

    def build(self, image: str, python_image: str | None, timeout_s: float) -> None:
        command = [self.binary, "build", "-f", "deploy/docker/Dockerfile.cpu", "-t", image]
        if self.binary == "podman":
            command += ["--format", "docker"]  # OCI images drop HEALTHCHECK
        if python_image:
            command += ["--build-arg", f"PYTHON_IMAGE={python_image}"]
        self.check_call(command + [str(self.compose_file.parent.parent)], timeout_s)

    # ------------------------------------------------------------ containers

    def containers(self, service: str | None = None, running_only: bool = False) -> list[str]:
        command = [self.binary, "ps", "--format", "{{.Names}}",
                   "--filter", f"label={PROJECT_LABEL}={self.project}"]
        if not running_only:
            command.append("-a")
        if service:
            command += ["--filter", f"label={SERVICE_LABEL}={service}"]
        return sorted(self.output(command).split())

    def inspect(self, name: str) -> dict:
        return json.loads(self.output([self.binary, "container", "inspect", name]))[0]

    def health(self, name: str) -> str:
        state = self.inspect(name)["State"]
        health = state.get("Health") or state.get("Healthcheck") or {}
        return health.get("Status") or ("running" if state.get("Running") else "stopped")

    def wait_healthy(self, services: Sequence[str], timeout_s: float, count: int = 1) -> None:
        def healthy() -> bool:
            for service in services:
                names = self.containers(service)
                if len([n for n in names if self.health(n) == "healthy"]) < count:
                    return False
            return True
        deadline_loop(f"{', '.join(services)} healthy", timeout_s, healthy, period_s=2.0)

    def restart_count(self, name: str) -> int:
        return int(self.inspect(name).get("RestartCount") or 0)

    def container_by_ip(self, service: str, ip: str) -> str:
        for name in self.containers(service, running_only=True):
            networks = self.inspect(name)["NetworkSettings"]["Networks"]
            if any(net.get("IPAddress") == ip for net in networks.values()):
                return name
        raise SmokeFailure("migrate", f"no {service} container has the address {ip}")

    def kill_main_process(self, name: str) -> None:
        """SIGKILL the pdserve process, as the kernel's OOM killer would: tini then exits
        137 and the restart policy applies (an engine's `kill` counts as a user's stop)."""
        self.output([self.binary, "exec", name, "python", "-c", KILL_CHILDREN_OF_INIT])

    def show_state(self) -> None:
        for name in self.containers():
            try:
                print(f"--- {name}: {self.health(name)}; last log lines:", flush=True)
                subprocess.run([self.binary, "logs", "--tail", "15", name], env=self.env,
                               timeout=30)
            except (SmokeFailure, subprocess.SubprocessError):
                pass

    # ------------------------------------------------------------ health checks (podman)

    def start_health_ticker(self) -> None:
        """Podman < 4.6 without systemd schedules no health check: run them here."""
        if self.binary != "podman":
            return

        def tick() -> None:
            while not self._ticker_stop.wait(HEALTH_TICK_S):
                try:
                    for name in self.containers(running_only=True):
                        subprocess.run([self.binary, "healthcheck", "run", name],
                                       capture_output=True, env=self.env, timeout=15)
                except (SmokeFailure, subprocess.SubprocessError):
                    pass  # the containers are changing; the next tick sees them
        self._ticker = threading.Thread(target=tick, name="health-ticker", daemon=True)
        self._ticker.start()

    def stop_health_ticker(self) -> None:
        self._ticker_stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=30)

    # ------------------------------------------------------------ teardown

    def teardown(self) -> None:
        self.compose(["down", "-v", "--remove-orphans", "-t", "45"], timeout_s=600,
                     profiles=("monitoring",))

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label={PROJECT_LABEL}={self.project}"
        found = {"containers": self.containers()}
        for kind in ("network", "volume"):
            names = self.output([self.binary, kind, "ls", "-q", "--filter", label]).split()
            # podman-compose labels networks and volumes with io.podman.compose.project too;
            # names with the project's prefix catch a tool that labels neither.
            all_names = self.output([self.binary, kind, "ls", "-q"]).split()
            names += [n for n in all_names if n.startswith(f"{self.project}_")
                      or n.startswith(f"{self.project}-")]
            found[kind + "s"] = sorted(set(names))
        return {kind: names for kind, names in found.items() if names}

    def check_nothing_left(self, before_start: bool) -> None:
        left = self.leftovers()
        if left:
            when = ("from an earlier run (remove them, or pick another --project)"
                    if before_start else "after `down -v`")
            raise SmokeFailure("teardown", f"project {self.project} has {left} {when}")


def detect_engine(choice: str, project: str, compose_file: Path,
                  env: dict[str, str]) -> ComposeEngine:
    """docker when asked or when its daemon answers, else podman with podman-compose."""
    docker_up = shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, env=env, timeout=30).returncode == 0
    if choice == "docker" or (choice == "auto" and docker_up):
        if not docker_up:
            raise SmokeFailure("engine", "`docker info` fails: no Docker daemon answers")
        return ComposeEngine("docker", ["docker", "compose"], project, compose_file, env)
    if shutil.which("podman") is None:
        raise SmokeFailure("engine", "neither a Docker daemon nor podman: install one "
                                     "(Debian: apt-get install podman)")
    podman_compose = shutil.which("podman-compose", path=env.get("PATH"))
    if podman_compose is None:
        raise SmokeFailure("engine", "podman-compose is not on PATH "
                                     "(deploy/compose-smoke.sh installs it)")
    return ComposeEngine("podman", [podman_compose], project, compose_file, env)
