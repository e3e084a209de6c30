"""A whole cluster on this machine, kept up: Redis, workers and the gateway as children.

    start():  Redis (unless a URL is given) → the CUDA MPS daemon (when given one:
              launcher/mps.py) → the workers → the gateway (its port fixed), or N gateway
              replicas sharing that port (SO_REUSEPORT: the kernel spreads connections)
              and their admission limits (in Redis: gateway/admission/shared_limits.py) → the
              operations agent (agent/: it asks for a bad worker's restart over the restart
              line, launcher/restart_line.py; the supervisor kills that child by its own
              handle and supervise() starts it again)
    wait_ready(): until /ready answers and every worker started here is listed ready (with
              N gateway replicas: until N distinct replicas answered /ready with 200)
    supervise(): called periodically; answers the agent's restart requests, restarts what
              exited (launcher/restart_policy.py): a worker with a new process (new epoch),
              the gateway and Redis on their ports; kills a gateway replica, the agent or
              Redis that is alive but frozen, for that restart (launcher/liveness.py)
    stop():   the agent first (so nothing restarts what is stopping), then the gateway
              (SIGTERM: it stops accepting, lets streams finish within its drain timeout,
              ends the rest with an error event and [DONE]), then the workers (they drain and deregister), then the MPS daemon, then Redis

Every child gets the cluster's internal token in its environment (PDSERVE_INTERNAL_TOKEN,
never on a command line), so the workers' control APIs answer only this cluster: the one
in `pdserve up`'s own environment if set, else a new random one; a worker's spec adds its
own variables (the MPS ones) on top. The gateways alone get the admin token
(PDSERVE_ADMIN_TOKEN: role changes, and the /admin views of a gateway beyond loopback,
gateway/ops/admin_access.py), taken the same way; a generated one is written to
LOG_DIR/admin-token (mode 0600) for the operator, and never printed. It is not the
internal token: that one every worker and the agent hold, and it opens the workers'
control ports; the admin token opens /admin only, and no worker ever sees it.

The Redis URL goes the same way (PDSERVE_REDIS_URL): the Redis started here has a
password, and each child gets the credentials of its own ACL user (state/redis_users.py:
the gateway's, the agent's, one per worker id), so a command line shows none; the default
user's URL goes to LOG_DIR/redis-url (mode 0600) for the operator. A Redis given by URL is
passed on as it is (PDSERVE_REDIS_INSECURE=1 too when the operator accepted one without a
password). Worker ids are fixed per cluster (`ROLE-INDEX-TAG`), so a restarted worker
replaces its own registry entry (a higher epoch) instead of leaving a stale one beside it,
and keeps its Redis user.

Lifecycle: created → started → (supervise)* → stopped; `failure` is set when something
essential cannot be kept up, and the caller then stops. stop() is also the clean-up after
a start() that failed half-way. Invariant: after stop() no child started here is alive,
and the MPS daemon, if one was started, was told to quit (after the workers).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launcher.liveness import PROBE_PERIOD_S, BeatWatch, is_frozen, unanswered_since
from launcher.mps import MpsDaemon, MpsError
from launcher.redis_server import RedisServer, RedisServerError
from launcher.restart_line import RestartLine
from launcher.restart_policy import RestartPolicy, consecutive_failures, restart_delay_s
from launcher.secret_file import write_secret
from launcher.supervisor import Child, Supervisor
from protocol.messages import Role
from state.redis_users import AGENT_USER, GATEWAY_USER, cluster_grants, worker_username
from telemetry.options import (ADMIN_TOKEN_ENV, ADMIN_TOKEN_FILE, INTERNAL_TOKEN_ENV,
                               REDIS_URL_FILE, env_name)


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    role: Role  # the role it starts in
    device: str
    worker_id: str
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the cluster's

    @property
    def label(self) -> str:
        return self.role.value


class LocalCluster:
    def __init__(self, workers: list[WorkerSpec], common_args: list[str], gateway_args: list[str],
                 gateway_url: str, log_dir: Path, redis_url: str | None,
                 say: Callable[[str], None], policy: RestartPolicy = RestartPolicy(),
                 drain_timeout_s: float = 30.0, mps: MpsDaemon | None = None,
                 num_gateways: int = 1, agent_args: list[str] | None = None,
                 namespace: str = "pdserve", redis_insecure: bool = False) -> None:
        """`agent_args`: the operations agent's options (it is started after the gateway
        and restarted like a worker); None: no agent. `namespace`: the children's Redis key
        namespace (their ACL users' keys); `redis_insecure`: the children accept a
        `redis_url` without a password."""
        if num_gateways < 1:
            raise ValueError("num_gateways must be >= 1")
        self.worker_specs = workers
        self.common_args = common_args
        self.gateway_args = gateway_args
        self.gateway_url = gateway_url
        self.supervisor = Supervisor(log_dir)
        self.redis_url = redis_url
        self.redis: RedisServer | None = None
        self.namespace = namespace
        self.redis_insecure = redis_insecure
        self.say = say
        self.policy = policy
        self.drain_timeout_s = drain_timeout_s
        self.mps = mps  # started before the workers, stopped after them
        # The operator's token when the environment has one, else a fresh one per cluster.
        self.token = os.environ.get(INTERNAL_TOKEN_ENV) or secrets.token_hex(16)
        self.admin_token = os.environ.get(ADMIN_TOKEN_ENV) or secrets.token_hex(16)
        # Where the operator finds a generated admin token (None: their own, from the
        # environment); written by start().
        self.admin_token_path: Path | None = None
        self._admin_token_generated = not os.environ.get(ADMIN_TOKEN_ENV)
        self.failure: str | None = None
        self.workers: list[Child] = []
        self.workers_by_id: dict[str, Child] = {}  # what the agent may ask to restart
        self.restart_line: RestartLine | None = None  # to the agent, when there is one
        self.num_gateways = num_gateways
        self.gateways: list[Child] = []
        self.agent_args = agent_args
        self.agent: Child | None = None
        self._redis_failures = 0
        self._redis_started_at = 0.0
        self._redis_restart_at: float | None = None
        self._redis_silent_since: float | None = None  # its first unanswered PING
        self._probed_at = 0.0  # the last liveness round (launcher/liveness.py)
        self._beats: dict[str, BeatWatch] = {}  # by child name: the gateways', the agent's
        self._env = {**os.environ, INTERNAL_TOKEN_ENV: self.token}
        self._env.pop(ADMIN_TOKEN_ENV, None)  # the gateways' alone (below)

    # ---------------------------------------------------------------- start

    def start(self) -> None:
        """Start everything; raises RedisServerError when no Redis can run, MpsError when
        the MPS daemon does not, OSError when the admin token's file cannot be written
        (call stop() then too)."""
        if self._admin_token_generated:
            self.admin_token_path = write_secret(self.supervisor.log_dir / ADMIN_TOKEN_FILE,
                                                 self.admin_token)
        if self.redis_url is None:
            grants = cluster_grants(self.namespace, [s.worker_id for s in self.worker_specs])
            self.redis = RedisServer(die_with_parent=True, users=grants)
            self.redis.start()
            self._redis_started_at = time.monotonic()
            self.redis_url = self.redis.address
            url_file = self.supervisor.log_dir / REDIS_URL_FILE
            write_secret(url_file, self.redis.url)
            users = "a password per role" if self.redis.has_acl_users else \
                "one password: this server has no ACL users"
            self.say(f"redis: {self.redis.address} ({Path(self.redis.binary.path).name}; "
                     f"{users}; the admin URL is in {url_file})")
        if self.mps is not None:
            self.mps.start(self._env)
        base = [sys.executable, "-m", "launcher.cli"]
        counts: dict[str, int] = {}
        for spec in self.worker_specs:
            index = counts.get(spec.label, 0)
            counts[spec.label] = index + 1
            child = self.supervisor.start(
                f"{spec.label} worker {index}", worker_argv(spec, base, self.common_args),
                env={**self._redis_env(worker_username(spec.worker_id)), **spec.env})
            self.workers.append(child)
            self.workers_by_id[spec.worker_id] = child
        gateway = [*base, "gateway", *self.gateway_args,
                   "--drain-timeout-s", str(self.drain_timeout_s)]
        if self.num_gateways > 1:
            gateway += ["--reuse-port", "--replicas", str(self.num_gateways)]
        for index in range(self.num_gateways):
            name = "gateway" if self.num_gateways == 1 else f"gateway {index}"
            self.gateways.append(self.supervisor.start(
                name, gateway,
                env={**self._redis_env(GATEWAY_USER), ADMIN_TOKEN_ENV: self.admin_token},
                essential=True, heartbeat=True))
        if self.agent_args is not None:
            line = self.restart_line = RestartLine()
            self.agent = self.supervisor.start(
                "agent", [*base, "agent", *self.agent_args,
                          "--supervisor-fd", str(line.agent_fd)],
                env=self._redis_env(AGENT_USER), pass_fds=(line.agent_fd,), heartbeat=True)

    def _redis_env(self, username: str) -> dict[str, str]:
        """A child's environment: the cluster's, and its way into Redis."""
        env = dict(self._env)
        if self.redis is not None:
            env[env_name("--redis-url")] = self.redis.url_for(username)
        else:
            assert self.redis_url is not None
            env[env_name("--redis-url")] = self.redis_url
            if self.redis_insecure:
                env[env_name("--redis-insecure")] = "1"
        return env

    # ---------------------------------------------------------------- readiness

    def ready_line(self) -> str | None:
        """None once /ready answers 200 and every worker started here is ready; else what
        is missing, for the progress line."""
        ready = self._get_json("/ready")
        if ready is None:
            return "waiting for the gateway"
        listing = self._get_json("/admin/workers")
        listed = {w.get("id"): w.get("state") for w in (listing or {}).get("workers", [])}
        num_ready = sum(listed.get(s.worker_id) == "ready" for s in self.worker_specs)
        if not ready.get("ready") or num_ready < len(self.worker_specs):
            return f"workers ready: {num_ready}/{len(self.worker_specs)} (loading the model)"
        if self.num_gateways > 1:
            num_seen = self._replicas_ready()
            if num_seen < self.num_gateways:
                return f"gateway replicas ready: {num_seen}/{self.num_gateways}"
        return None

    def _replicas_ready(self) -> int:
        """How many gateway replicas answered /ready with 200, over fresh connections (the
        kernel spreads them over the replicas); 0 as soon as one answers otherwise. Each
        replica names itself in its shared admission limits; without them (no names), all
        of 8 x N probes answering 200 counts as all N."""
        seen: set[str] = set()
        for _ in range(8 * self.num_gateways):
            ready = self._get_json("/ready")
            if ready is None or not ready.get("ready"):
                return 0
            seen.add(str((ready.get("admission_limits") or {}).get("gateway_id", "")))
            if len(seen) == self.num_gateways:
                return len(seen)
        return self.num_gateways if seen == {""} else len(seen)

    def served_model(self) -> str:
        models = self._get_json("/v1/models") or {}
        data = models.get("data") or [{"id": "default"}]
        return str(data[0]["id"])

    def _get_json(self, path: str) -> dict | None:
        # The admin token: /admin/workers needs it on a gateway beyond loopback.
        request = urllib.request.Request(
            self.gateway_url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        try:
            with urllib.request.urlopen(request, timeout=1.0) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                return json.loads(exc.read()) if exc.code == 503 else None
            except ValueError:
                return None
        except (OSError, ValueError):
            return None

    # ---------------------------------------------------------------- supervision

    def first_exit(self) -> Child | None:
        """A child that exited (used during start-up, when any exit is fatal)."""
        return self.supervisor.poll_exited()

    def answer_restarts(self, allow: bool) -> None:
        """Answer the agent's restart requests (`allow` False while starting: refused)."""
        if self.restart_line is not None:
            for line in self.restart_line.answer(self.supervisor, self.workers_by_id, allow):
                self.say(line)

    def supervise(self) -> None:
        """Answer the agent, then restart what exited, when its backoff is due; sets
        `failure` when an essential child (the gateway, Redis) cannot be kept up."""
        self.answer_restarts(allow=True)
        now = time.monotonic()
        for child in self.supervisor.children:
            code = child.returncode()
            if code is None:
                continue
            if child.restart_at is None:
                child.num_failures = consecutive_failures(child.num_failures,
                                                          now - child.started_at, self.policy)
                delay = restart_delay_s(child.num_failures, child.essential, self.policy)
                if delay is None:
                    self.failure = (f"{child.name} exited with code {code} "
                                    f"{child.num_failures} times in a row; stopping the "
                                    f"cluster. Last lines of {child.log_path}:\n"
                                    f"{child.log_tail()}")
                    return
                child.restart_at = now + delay
                self.say(f"{child.name} exited with code {code}; restarting in {delay:.1f} s "
                         f"(restart {child.num_restarts + 1}; log {child.log_path})")
            elif now >= child.restart_at:
                self.supervisor.restart(child)
                self.say(f"{child.name} restarted (pid {child.pid})")
        if now - self._probed_at >= PROBE_PERIOD_S:
            self._probed_at = now
            self._kill_frozen(now)
        self._supervise_redis(now)

    def _kill_frozen(self, now: float) -> None:
        """SIGKILL a gateway replica or agent whose heartbeat stopped, or a Redis that
        stopped answering, for the restart that follows (launcher/liveness.py)."""
        for child in [*self.gateways, *([self.agent] if self.agent else [])]:
            if child.heartbeat is None or child.returncode() is not None:
                continue
            try:
                beat_at: float | None = child.heartbeat.stat().st_mtime
            except OSError:
                beat_at = None
            silence = self._beats.setdefault(child.name, BeatWatch()).observe(beat_at, now)
            if is_frozen(silence) and self.supervisor.kill(child):
                self.say(f"{child.name} (pid {child.pid}) gave no sign of life for "
                         f"{silence:.1f} s: killed, to be restarted")
        redis = self.redis
        if redis is None or not redis.is_running or self._redis_restart_at is not None:
            return
        self._redis_silent_since = unanswered_since(
            self._redis_silent_since, redis.answers(PROBE_PERIOD_S), now)
        if self._redis_silent_since is not None and \
                is_frozen(now - self._redis_silent_since):
            self.say(f"redis did not answer a PING for {now - self._redis_silent_since:.1f} s: "
                     "killed, to be restarted")
            self._redis_silent_since = None
            redis.kill()

    def _supervise_redis(self, now: float) -> None:
        redis = self.redis
        if redis is None or redis.is_running:
            return
        if self._redis_restart_at is None:
            self._redis_failures = consecutive_failures(
                self._redis_failures, now - self._redis_started_at, self.policy)
            delay = restart_delay_s(self._redis_failures, True, self.policy)
            if delay is None:
                self.failure = f"redis exited {self._redis_failures} times in a row"
                return
            self._redis_restart_at = now + delay
            self.say(f"redis exited; restarting it on port {redis.port} in {delay:.1f} s")
            return
        if now < self._redis_restart_at:
            return
        self._redis_restart_at = None
        redis.stop()  # reaps the dead process
        try:
            redis.start()
        except RedisServerError as exc:
            self.say(f"redis did not restart: {exc}")
            self._redis_started_at = time.monotonic()  # counts as a failed run
            return
        self._redis_started_at = time.monotonic()
        self.say("redis restarted (the workers republish their state)")

    # ---------------------------------------------------------------- stop

    def stop(self) -> None:
        try:
            if self.agent is not None:  # first: nothing may restart what is being stopped
                self.supervisor.stop([self.agent], timeout_s=10.0)
            if self.gateways:
                # Streams get the drain timeout, the rest of its shutdown a few seconds.
                self.supervisor.stop(self.gateways, timeout_s=self.drain_timeout_s + 10.0)
            self.supervisor.stop(self.workers, timeout_s=40.0)  # workers drain what is left
        finally:
            if self.mps is not None:  # after the workers: the daemon waits for its clients
                try:
                    self.mps.stop()
                except MpsError as exc:
                    self.say(f"CUDA MPS: {exc}")
            if self.redis is not None:
                self.redis.stop()
            if self.restart_line is not None:
                self.restart_line.close()


def worker_argv(spec: WorkerSpec, base: list[str], common: list[str]) -> list[str]:
    """The command line of one worker: `BASE prefill-worker COMMON --device D --worker-id
    ID` for a prefill worker, `BASE decode-worker ... --role ROLE` for any other role."""
    argv = [*base, "prefill-worker" if spec.role is Role.PREFILL else "decode-worker",
            *common, "--device", spec.device, "--worker-id", spec.worker_id]
    if spec.role is not Role.PREFILL:
        argv += ["--role", spec.role.value]
    return argv
