"""Faults against `pdserve up` with the default model on CPU, as a user would meet them.

One cluster, 1 prefill + 2 decode workers, for the whole module (tests run in order; the
last one stops it with SIGTERM). Chat requests' KV pushes are slowed down by the prefill
worker's fault injection (a FaultRequest: 150 ms before each layer for ids starting
"chatcmpl-"; the cluster runs with PDSERVE_FAULT_INJECTION=1), which opens a window to kill a
decode worker while KV is moving into it.

Every comparison is with an undisturbed run of the same greedy request on the same
cluster: a fault must change neither the text nor the number of tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from up_process import HANDOFF_TIER, UpProcess, child_pids, pid_alive, wait_gone

from protocol.agent_messages import FAULT_INJECTION_ENV, FaultRequest, FaultResponse

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SHORT = "Count slowly from one to ten, in words:"
LONG = "Here is a list of fruits: " + ", ".join(["apple", "pear", "plum", "fig"] * 60) + \
    ". Now count them:"
GREEDY = {"temperature": 0, "max_tokens": 40, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    env = {FAULT_INJECTION_ENV: "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        tiers = tmp_path_factory.mktemp("tiers") / "tiers.toml"
        tiers.write_text(HANDOFF_TIER)  # the shipped tiers, and one that always hands off
        process = UpProcess("--prefill", "1", "--decode", "2", "--drain-timeout-s", "3",
                            "--tiers", str(tiers),
                            log_dir=tmp_path_factory.mktemp("reliability-logs"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield process
    process.stop()


def complete(up: UpProcess, prompt: str, chat: bool = False, max_tokens: int = 40,
             tier: str | None = None) -> dict:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "default", "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    response = httpx.post(up.url + path, json=body, timeout=120,
                          headers={"x-pdserve-tier": tier} if tier else {})
    assert response.status_code == 200, response.text
    return response.json()


def text_of(answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


class Stream:
    """A streamed request read on its own thread; `events` fills as chunks arrive."""

    def __init__(self, up: UpProcess, prompt: str, chat: bool = False, max_tokens: int = 40,
                 tier: str | None = None):
        self.headers = {"x-pdserve-tier": tier} if tier else {}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        self.body = {"model": "default", "temperature": 0, "max_tokens": max_tokens,
                     "ignore_eos": True, "stream": True,
                     "stream_options": {"include_usage": True},
                     **({"messages": [{"role": "user", "content": prompt}]} if chat
                        else {"prompt": prompt})}
        self.url = up.url + path
        self.events: list = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers,
                              timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payload = line[len("data: "):]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc

    @property
    def request_id(self) -> str | None:
        return next((e["id"] for e in self.events if isinstance(e, dict) and "id" in e), None)

    def wait_tokens(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_tokens < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), self.events
            time.sleep(0.01)

    @property
    def num_tokens(self) -> int:
        return sum(1 for e in self.events if isinstance(e, dict) and e.get("choices")
                   and _delta_text(e["choices"][0]))

    def result(self, timeout_s: float = 120.0) -> tuple[str, list]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream never ended"
        if self.error is not None:
            raise self.error
        text = "".join(_delta_text(e["choices"][0]) for e in self.events
                       if isinstance(e, dict) and e.get("choices"))
        return text, self.events


def _delta_text(choice: dict) -> str:
    return (choice.get("delta", {}).get("content") if "delta" in choice
            else choice.get("text")) or ""


def workers(up: UpProcess) -> list[dict]:
    return [w for w in up.workers() if w["state"] == "ready"]


def state_of(up: UpProcess, worker: dict) -> dict:
    return up.internal_get(worker["control_url"] + "/admin/state")


def worker_holding(up: UpProcess, request_id: str, role: str, key: str,
                   timeout_s: float = 30.0) -> dict:
    """The worker of `role` whose /admin/state lists `request_id` under `key`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers(up):
            if worker["role"] == role and request_id in state_of(up, worker).get(key, []):
                return worker
        time.sleep(0.02)
    raise AssertionError(f"no {role} worker lists {request_id} under {key}")


def wait_restarted(up: UpProcess, killed: dict, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers(up):
            if worker["id"] == killed["id"] and worker["epoch"] > killed["epoch"]:
                return worker
        time.sleep(0.1)
    raise AssertionError(f"{killed['id']} was not restarted:\n{up.output[-3000:]}")


def assert_nothing_held(up: UpProcess, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = {w["id"]: state_of(up, w) for w in workers(up)}
        busy = {w: (s["num_held_tables"], s["num_running"], s["num_waiting"],
                    s.get("num_reservations", 0)) for w, s in states.items()
                if s["num_held_tables"] or s["num_running"] or s["num_waiting"]
                or s.get("num_reservations")}
        errors = {w: s["invariant_error"] for w, s in states.items() if s["invariant_error"]}
        if not busy and not errors:
            return
        assert time.monotonic() < deadline, f"held: {busy}, invariants: {errors}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def references(up: UpProcess) -> dict[str, str]:
    """Undisturbed greedy answers, each asked once before any fault."""
    return {"short": text_of(complete(up, SHORT)),
            "long": text_of(complete(up, LONG)),
            "long chat": text_of(complete(up, LONG, chat=True))}


def test_up_reports_up_once_every_worker_is_ready(up) -> None:
    assert sorted(w["role"] for w in workers(up)) == ["decode", "decode", "prefill"]


def test_a_decode_worker_killed_mid_stream_does_not_change_the_answer(up, references) -> None:
    stream = Stream(up, SHORT)
    stream.wait_tokens(8)
    victim = worker_holding(up, stream.request_id, "decode", "streams")
    os.kill(victim["pid"], signal.SIGKILL)
    text, events = stream.result()
    assert text == references["short"]
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 40
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    # Requests started right after the kill, before the restart, succeed too.
    assert text_of(complete(up, SHORT)) == references["short"]
    wait_restarted(up, victim)
    assert_nothing_held(up)


def test_a_prefill_worker_killed_mid_prefill_does_not_fail_the_request(up, references) -> None:
    prefill = next(w for w in workers(up) if w["role"] == "prefill")
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(complete(up, LONG, tier="handoff")),
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not state_of(up, prefill)["active"]:
        assert time.monotonic() < deadline, "the long prompt never reached the prefill worker"
        time.sleep(0.01)
    os.kill(prefill["pid"], signal.SIGKILL)
    thread.join(120)
    assert text_of(answer) == references["long"]
    assert answer["usage"]["completion_tokens"] == 40
    wait_restarted(up, prefill)
    assert_nothing_held(up)


def slow_pushes(up: UpProcess, delay_ms: int = 150) -> None:
    """Every prefill worker now sleeps `delay_ms` before each layer it pushes for a chat
    request (a restarted worker starts without it)."""
    slow = FaultRequest(transfer_layer_delay_ms=delay_ms, request_prefix="chatcmpl-")
    for worker in workers(up):
        if worker["role"] == "prefill":
            answer = up.control_call(worker, slow, FaultResponse)
            assert answer.transfer_layer_delay_ms == delay_ms


def test_a_decode_worker_killed_mid_transfer_does_not_fail_the_request(up, references) -> None:
    slow_pushes(up)
    # The handoff tier always splits (the router may otherwise prefill it on a decode worker).
    stream = Stream(up, LONG, chat=True, tier="handoff")
    stream.wait_tokens(1)  # token 1 came from the prefill worker; its push takes ~4 s
    victim = worker_holding(up, stream.request_id, "decode", "reservations")
    os.kill(victim["pid"], signal.SIGKILL)
    slow_pushes(up, 0)  # the window was for the kill: the request's retry need not wait
    text, events = stream.result()
    assert text == references["long chat"]
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    wait_restarted(up, victim)
    assert_nothing_held(up)  # the prefill worker let go of the blocks it was pushing


def test_redis_killed_and_restarted_under_load_fails_no_request(up, references) -> None:
    redis_pids = [p for p in child_pids(up.process.pid)
                  if any(name in Path(f"/proc/{p}/cmdline").read_bytes()
                         for name in (b"redis-server", b"valkey-server"))]
    assert len(redis_pids) == 1, redis_pids
    results: list[str] = []
    failures: list[BaseException] = []

    def client() -> None:
        for _ in range(3):
            try:
                results.append(text_of(complete(up, SHORT, max_tokens=16)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    os.kill(redis_pids[0], signal.SIGKILL)
    for thread in threads:
        thread.join(180)
    assert not failures and len(results) == 9, f"failed while Redis was down: {failures}"
    assert len(set(results)) == 1 and references["short"].startswith(results[0])
    deadline = time.monotonic() + 30  # the restarted Redis sees every worker again
    while len(workers(up)) < 3:
        assert time.monotonic() < deadline, up.workers()
        time.sleep(0.1)


def test_idle_workers_use_no_cpu_after_transfers(up) -> None:
    pids = [w["pid"] for w in workers(up)]
    complete(up, LONG, max_tokens=4)  # a transfer, then nothing
    time.sleep(0.5)
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu_s(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    before = {pid: cpu_s(pid) for pid in pids}
    time.sleep(3.0)
    usage = {pid: (cpu_s(pid) - before[pid]) / 3.0 for pid in pids}
    assert all(u < 0.05 for u in usage.values()), usage


def test_a_huge_prompt_keeps_health_fast(up) -> None:
    """/health stays fast while the gateway reads and refuses a 4 MB prompt.

    The pinger's first requests (connection set-up, a cold loop) are not
    counted: only pings started after the huge request was sent, until
    0.5 s after its answer, are.
    """
    samples: list[tuple[float, float]] = []  # (started, latency)
    done = threading.Event()

    def ping() -> None:
        with httpx.Client(timeout=5) as client:
            while not done.is_set():
                started = time.perf_counter()
                assert client.get(up.url + "/health").status_code == 200
                samples.append((started, time.perf_counter() - started))
                time.sleep(0.01)

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    deadline = time.monotonic() + 10
    while len(samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.perf_counter()
    response = httpx.post(up.url + "/v1/completions", timeout=60,
                          json={"model": "default", "prompt": "word " * 800_000})  # 4 MB
    time.sleep(0.5)
    done.set()
    pinger.join(10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    latencies = sorted(latency for started, latency in samples if started >= sent)
    assert len(latencies) > 10, f"only {len(latencies)} pings after the request was sent"
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.1, f"p99 {p99 * 1000:.0f} ms over {len(latencies)}: {latencies[-3:]}"


def test_sigterm_ends_every_stream_with_done_or_an_error_never_silently(up) -> None:
    pids = [w["pid"] for w in workers(up)] + child_pids(up.process.pid)
    quick = Stream(up, SHORT, max_tokens=8)  # finishes inside the 3 s drain
    slow = [Stream(up, SHORT, max_tokens=400) for _ in range(2)]  # cannot: cut at 3 s
    for stream in (quick, *slow):
        stream.wait_tokens(1)
    assert up.stop(signal.SIGTERM, timeout_s=90) == 0
    text, events = quick.result()
    assert events[-1] == "[DONE]" and not [e for e in events if "error" in e]
    for stream in slow:
        text, events = stream.result()
        assert events[-1] == "[DONE]", events[-3:]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and "shutting down" in errors[0]["error"]["message"]
    assert wait_gone(pids) == []
    assert not any(pid_alive(p) for p in pids)
