"""The compose cluster run for real: build, start, serve, kill a decode worker, tear down.

Run by deploy/compose-smoke.sh (`make compose-smoke`), which provides the `openai` client
and, for podman, `podman-compose`. Each step has a deadline; the first that fails ends the
run with its message and a non-zero exit, after the teardown (unless --keep).

  1. images    the CPU image from deploy/docker/Dockerfile.cpu; with --base debian (the
               default) its base, Redis and Prometheus come from deploy/docker/make-base.sh
  2. start     deploy/docker-compose.yml as project `--project`, in the order its
               depends_on gates (Redis, then the pools, then gateway and agent), each stage
               waited on until every container is healthy
  3. serve     /v1/models, a chat completion and a streamed one through the published port
  4. migrate   decode scaled to 2; while a stream runs, the decode worker serving it is
               killed (SIGKILL to its pdserve process: a crash); the stream must end in
               full, the container be started again by its restart policy, and the gateway
               list it as ready again
  5. monitor   the `monitoring` profile's Prometheus: every pdserve job's targets up
  6. teardown  `down -v`; no container, network or volume of the project may remain

Podman before 4.6 runs no health check by itself without systemd (and podman-compose then
ignores depends_on conditions): this script runs `podman healthcheck run` for every
container of the project every two seconds, as Docker's daemon would.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from compose_engine import ComposeEngine, SmokeFailure, deadline_loop, detect_engine

if TYPE_CHECKING:
    from openai import OpenAI  # imported at run time only after --help and the engine checks

DEPLOY = Path(__file__).resolve().parent
REPO_ROOT = DEPLOY.parent
STREAM_MAX_TOKENS = 160
KILL_AFTER_CHUNKS = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Timings:
    def __init__(self) -> None:
        self.start_s = time.monotonic()
        self.rows: list[tuple[str, float]] = []
        self.notes: list[str] = []

    def mark(self, what: str, since_s: float, until_s: float | None = None) -> float:
        elapsed_s = (until_s or time.monotonic()) - since_s
        self.rows.append((what, elapsed_s))
        print(f">> {what}: {elapsed_s:.1f} s", flush=True)
        return elapsed_s

    def note(self, line: str) -> None:
        self.notes.append(line)
        print(f">> {line}", flush=True)

    def report(self) -> str:
        return "\n".join([f"  {what:<48} {seconds:8.1f} s" for what, seconds in self.rows]
                         + [f"  {line}" for line in self.notes])


def get_json(url: str, token: str | None = None, timeout_s: float = 5) -> dict:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------- the steps

def build_images(engine: ComposeEngine, args: argparse.Namespace, timings: Timings) -> None:
    if args.base == "debian":
        missing = [name for name in ("base", "redis", "prometheus")
                   if not engine.image_exists(f"localhost/pdserve-{name}:bookworm")]
        if missing:
            since = time.monotonic()
            engine.check_call(["bash", str(DEPLOY / "docker" / "make-base.sh"),
                               "--engine", engine.binary, *missing], timeout_s=1800)
            timings.mark(f"base images from Debian packages ({' '.join(missing)})", since)
    if args.no_build and engine.image_exists(args.image):
        return
    since = time.monotonic()
    engine.build(args.image, python_image=engine.env.get("PYTHON_IMAGE"), timeout_s=3600)
    timings.mark("CPU image build", since)
    timings.note(f"{args.image}: {engine.image_size_mb(args.image):.0f} MB")


def start_cluster(engine: ComposeEngine, timings: Timings) -> float:
    since = time.monotonic()
    for stage in (["redis"], ["prefill", "decode"], ["gateway", "agent"]):
        engine.compose(["up", "-d", "--no-build", *stage], timeout_s=300)
        engine.wait_healthy(stage, timeout_s=600)
        timings.mark(f"healthy: {' '.join(stage)}", since)
    return since


def serve(client: OpenAI, gateway_url: str, timings: Timings, up_since_s: float) -> str:
    """The served model's id, after one plain and one streamed chat completion."""
    models = [model.id for model in client.models.list().data]
    if not models:
        raise SmokeFailure("serve", f"{gateway_url}/v1/models lists no model")
    answer = client.chat.completions.create(
        model=models[0], messages=[{"role": "user", "content": "Say hello in one word."}],
        max_tokens=16)
    if not answer.choices or not answer.choices[0].message.content:
        raise SmokeFailure("serve", f"empty chat completion: {answer}")
    timings.mark("cold start: `up` to first answered request", up_since_s)
    print(f">> answer: {answer.choices[0].message.content!r}", flush=True)
    pieces = []
    for chunk in client.chat.completions.create(
            model=models[0], messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=32, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    if not pieces:
        raise SmokeFailure("serve", "the streamed chat completion sent no text")
    print(f">> streamed: {''.join(pieces)!r}", flush=True)
    return models[0]


def ready_decode_workers(gateway_url: str, admin_token: str) -> list[dict]:
    workers = get_json(f"{gateway_url}/admin/workers", admin_token)["workers"]
    return [w for w in workers if w["role"] == "decode" and w["state"] == "ready"]


def migrate(engine: ComposeEngine, client: OpenAI, model: str, gateway_url: str, admin_token: str,
            timings: Timings) -> None:
    since = time.monotonic()
    engine.compose(["up", "-d", "--no-build", "--no-deps", "--scale", "decode=2", "decode"],
                   timeout_s=300)
    engine.wait_healthy(["decode"], timeout_s=600, count=2)
    deadline_loop("two decode workers ready at the gateway", 120,
                  lambda: len(ready_decode_workers(gateway_url, admin_token)) >= 2)
    timings.mark("decode scaled to 2, both ready", since)

    result: dict = {}

    def consume() -> None:
        num_chunks, finish = 0, None
        try:
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=STREAM_MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    num_chunks += 1
                    result["num_chunks"] = num_chunks
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    result["completion_tokens"] = chunk.usage.completion_tokens
            result["finish"] = finish
            result["ended_at"] = time.monotonic()
        except Exception as exc:  # reported by the main thread with the step's name
            result["error"] = repr(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    deadline_loop(f"{KILL_AFTER_CHUNKS} chunks of the long stream", 120,
                  lambda: result.get("num_chunks", 0) >= KILL_AFTER_CHUNKS or "error" in result)
    if "error" in result:
        raise SmokeFailure("migrate", f"the long stream failed before the kill: {result['error']}")
    serving = [w for w in ready_decode_workers(gateway_url, admin_token)
               if (w.get("load") or {}).get("num_running", 0) > 0]
    if len(serving) != 1:
        raise SmokeFailure("migrate", f"expected one decode worker running the stream, "
                                      f"found {[w['id'] for w in serving]}")
    worker_ip = serving[0]["control_url"].split("//")[1].rsplit(":", 1)[0]
    victim = engine.container_by_ip("decode", worker_ip)
    restarts_before = engine.restart_count(victim)
    print(f">> killing the pdserve process of {victim} ({serving[0]['id']}) "
          f"after {result['num_chunks']} chunks", flush=True)
    killed_at = time.monotonic()
    engine.kill_main_process(victim)
    deadline_loop(f"{victim} restarted", 120,
                  lambda: engine.restart_count(victim) > restarts_before)
    engine.wait_healthy(["decode"], timeout_s=600, count=2)
    deadline_loop("the restarted worker ready at the gateway again", 300,
                  lambda: len(ready_decode_workers(gateway_url, admin_token)) >= 2)
    timings.mark("killed decode worker restarted and ready again", killed_at)
    consumer.join(timeout=300)
    if consumer.is_alive() or "error" in result or result.get("finish") is None:
        raise SmokeFailure("migrate", f"the stream did not end in full after the kill: {result}")
    if result.get("completion_tokens") != STREAM_MAX_TOKENS:
        raise SmokeFailure("migrate", f"the migrated stream sent {result} tokens, not "
                                      f"max_tokens={STREAM_MAX_TOKENS}")
    timings.mark("the stream's end, from the kill", killed_at, result["ended_at"])
    timings.note(f"stream: {result['completion_tokens']} tokens ({result['finish']}), "
                 f"{KILL_AFTER_CHUNKS}+ of them before the kill")
    time.sleep(15)  # the agent's probation: a second restart would show by now
    num_restarts = engine.restart_count(victim) - restarts_before
    if num_restarts != 1:
        raise SmokeFailure("migrate", f"{victim} was restarted {num_restarts} times for one "
                                      f"crash")


def monitor(engine: ComposeEngine, prometheus_url: str, timings: Timings) -> None:
    since = time.monotonic()
    engine.compose(["up", "-d", "--no-build", "--no-deps", "prometheus"], timeout_s=300,
                   profiles=("monitoring",))
    expected = {"pdserve-gateway": 1, "pdserve-prefill": 1, "pdserve-decode": 2,
                "pdserve-agent": 1}

    up: dict[str, int] = {}

    def all_up() -> bool:
        (name,) = engine.containers("prometheus")
        if engine.health(name) in ("stopped", "exited"):
            raise SmokeFailure("monitor", f"{name} exited: see `{engine.binary} logs {name}`")
        targets = get_json(f"{prometheus_url}/api/v1/targets")["data"]["activeTargets"]
        up.clear()
        for target in targets:
            if target["health"] == "up":
                up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
        return all(up.get(job, 0) >= n for job, n in expected.items())

    try:
        deadline_loop("Prometheus scraping every pdserve target", 180, all_up)
    except SmokeFailure as exc:
        raise SmokeFailure("monitor", f"{exc.message}; targets up: {up}, expected "
                                      f"{expected}") from None
    timings.mark("Prometheus: every target up", since)


# ---------------------------------------------------------------- the run

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="compose-smoke.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("auto", "podman", "docker"), default="auto",
                        help="container engine (auto: docker when its daemon answers, "
                             "else podman)")
    parser.add_argument("--base", choices=("debian", "official"), default="debian",
                        help="debian: base, Redis and Prometheus images made by "
                             "make-base.sh from Debian packages; official: Docker Hub's")
    parser.add_argument("--image", default="localhost/pdserve:cpu", help="the CPU image's tag")
    parser.add_argument("--no-build", action="store_true",
                        help="use the CPU image as it is when it exists")
    parser.add_argument("--project", default="pdserve-smoke", help="compose project name")
    parser.add_argument("--no-monitoring", action="store_true", help="skip Prometheus")
    parser.add_argument("--keep", action="store_true",
                        help="leave the cluster running (no teardown) for a look")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    timings = Timings()
    gateway_port, prometheus_port = free_port(), free_port()
    admin_token = secrets.token_hex(16)
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=secrets.token_hex(16),
               PDSERVE_REDIS_PASSWORD=secrets.token_hex(16), PDSERVE_ADMIN_TOKEN=admin_token,
               PDSERVE_IMAGE=args.image, GATEWAY_PORTS=str(gateway_port),
               PROMETHEUS_PORT=str(prometheus_port), WORKER_THREADS="1")
    if args.base == "debian":
        env.update(PYTHON_IMAGE="localhost/pdserve-base:bookworm",
                   REDIS_IMAGE="localhost/pdserve-redis:bookworm",
                   PROMETHEUS_IMAGE="localhost/pdserve-prometheus:bookworm")
    try:
        engine = detect_engine(args.engine, args.project, DEPLOY / "docker-compose.yml", env)
        print(f">> engine: {engine.describe()}", flush=True)
        engine.check_nothing_left(before_start=True)  # not ours to tear down: stop here
    except (SmokeFailure, subprocess.SubprocessError, OSError) as exc:
        print(f"compose smoke FAILED before starting: {exc}", file=sys.stderr)
        return 1
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    failure: SmokeFailure | None = None
    try:
        build_images(engine, args, timings)
        engine.start_health_ticker()
        up_since_s = start_cluster(engine, timings)
        from openai import OpenAI
        client = OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120,
                        max_retries=0)
        model = serve(client, gateway_url, timings, up_since_s)
        migrate(engine, client, model, gateway_url, admin_token, timings)
        if not args.no_monitoring:
            monitor(engine, f"http://127.0.0.1:{prometheus_port}", timings)
    except SmokeFailure as exc:
        failure = exc
    except (subprocess.SubprocessError, OSError) as exc:
        failure = SmokeFailure("run", repr(exc))
    finally:
        engine.stop_health_ticker()
        if failure is not None:
            engine.show_state()
        if not args.keep:
            since = time.monotonic()
            try:
                engine.teardown()
                engine.check_nothing_left(before_start=False)
                timings.mark("teardown", since)
            except SmokeFailure as exc:
                failure = failure or exc
    timings.mark("total", timings.start_s)
    print("\ncompose smoke timings (" + engine.describe() + "):\n" + timings.report())
    if failure is not None:
        print(f"\ncompose smoke FAILED at {failure.step}: {failure.message}", file=sys.stderr)
        return 1
    print("\ncompose smoke passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
