"""The operations agent against `pdserve up` with the default model on CPU: real workers,
real faults (SIGSTOP, SIGKILL, a slowed engine, a leaked reservation), the official
`openai` client for the traffic, and the agent's own audit trail for the timings.

One cluster (1 prefill + 2 decode workers, the agent started by `pdserve up` as by
default) for the whole module; the tests run in order and each starts from a cluster whose
workers are all ready. The agent's thresholds are shortened through its PDSERVE_*
variables, and the workers take a FaultRequest (PDSERVE_FAULT_INJECTION=1).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx2 as httpx
import msgspec
import openai
import pytest
from up_process import UpProcess, child_pids, pid_alive

from protocol.agent_messages import FaultRequest, FaultResponse
from protocol.messages import LoadReport, ReserveRequest, ReserveResponse
from state.redis_state import RedisState, connect

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

AGENT_ENV = {"PDSERVE_FAULT_INJECTION": "1", "PDSERVE_PROBATION_S": "3",
             "PDSERVE_COOLDOWN_S": "4", "PDSERVE_LEAK_AFTER_S": "5",
             "PDSERVE_SLOW_FOR_S": "3", "PDSERVE_REBALANCE": "off"}
PROMPT = "Count slowly from one to ten, in words:"


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    process = UpProcess("--prefill", "1", "--decode", "2", "--drain-timeout-s", "3",
                        log_dir=tmp_path_factory.mktemp("agent-logs"), env=AGENT_ENV)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(up):
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client: openai.OpenAI, max_tokens: int = 8) -> str:
    answer = client.completions.create(model="default", prompt=PROMPT, max_tokens=max_tokens,
                                       temperature=0)
    return answer.choices[0].text


def events(up: UpProcess) -> list[dict]:
    """The agent's decisions, oldest first."""
    return list(reversed(up.admin_get("/admin/agent/events?limit=1000")["events"]))


def wait_event(up: UpProcess, predicate, timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in events(up) if predicate(e)]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no agent event: {what}\n{events(up)}\n{up.output[-3000:]}")


def wait_report(up: UpProcess, predicate, timeout_s: float, what: str) -> dict:
    """The newest root-cause report that satisfies `predicate`."""
    deadline = time.monotonic() + timeout_s
    reports: list[dict] = []
    while time.monotonic() < deadline:
        reports = up.admin_get("/admin/agent/reports?limit=50")["reports"]
        found = [r for r in reports if predicate(r)]
        if found:
            return found[0]
        time.sleep(0.5)
    raise AssertionError(f"no root-cause report: {what}\n{reports}\n{up.output[-3000:]}")


def decode_workers(up: UpProcess) -> list[dict]:
    return sorted((w for w in up.workers() if w["role"] == "decode"), key=lambda w: w["id"])


def wait_all_ready(up: UpProcess, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = up.workers()
        if len(workers) == 3 and all(w["state"] == "ready" for w in workers):
            return workers
        time.sleep(0.2)
    raise AssertionError(f"workers not all ready: {up.workers()}\n{up.output[-3000:]}")


def wait_new_epoch_ready(up: UpProcess, old: dict, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in up.workers():
            if worker["id"] == old["id"] and (worker["epoch"] or 0) > old["epoch"] \
                    and worker["state"] == "ready":
                return worker
        time.sleep(0.2)
    raise AssertionError(f"{old['id']} not back: {up.workers()}\n{up.output[-3000:]}")


def control_call(up: UpProcess, worker: dict, message, answer_type):
    return up.control_call(worker, message, answer_type)


class Load:
    """Requests on `num_threads` threads until stopped; each result is (start, ok)."""

    def __init__(self, client: openai.OpenAI, num_threads: int = 3, max_tokens: int = 12):
        self.client = client
        self.max_tokens = max_tokens
        self.results: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True)
                         for _ in range(num_threads)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.time()
            try:
                complete(self.client, self.max_tokens)
                self.results.append((started, True, ""))
            except openai.OpenAIError as exc:
                self.results.append((started, False, repr(exc)))

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)

    def failures_after(self, at_unix_s: float) -> list[tuple[float, bool, str]]:
        return [r for r in self.results if r[0] >= at_unix_s and not r[1]]


def test_the_events_endpoint_refuses_bad_limits(up) -> None:
    token = up.admin_headers
    for path in ("events", "reports"):
        for limit in ("0", "1001", "ten", "-1"):
            response = httpx.get(f"{up.url}/admin/agent/{path}?limit={limit}", headers=token)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "limit"
    assert httpx.get(f"{up.url}/admin/agent/events?limit=5", headers=token).json() == \
        {"events": []}  # nothing decided yet on a healthy cluster
    assert httpx.get(f"{up.url}/admin/agent/reports", headers=token).json() == \
        {"reports": []}  # and no tier dropped


def test_a_leaked_reservation_is_reclaimed(up) -> None:
    from rpc.channel_client import ChannelPool
    from rpc.control_client import ControlClient

    wait_all_ready(up)
    worker = decode_workers(up)[0]

    async def leak() -> dict:
        # A gateway that reserved and is stuck: its channel stays open (a closed one would
        # free the reservation at once), and no decode request ever follows.
        pool = ChannelPool(up.token)
        try:
            reserved = await ControlClient(worker["control_url"], pool).call(ReserveRequest(
                request_id="leaked-1", prompt_token_ids=list(range(1, 100)),
                timeout_ms=120_000), ReserveResponse, 10.0)
            assert reserved.destination.worker_id == worker["id"]
            state = up.internal_get(worker["control_url"] + "/admin/state")
            assert state["num_reservations"] == 1
            return await asyncio.to_thread(
                wait_event, up, lambda e: e["action"] == "reclaim"
                and e["worker_id"] == worker["id"], 45, "reclaim")
        finally:
            await pool.aclose()

    event = asyncio.run(leak())
    assert event["rule"] == "leaked_kv" and event["outcome"].startswith("done: 1 reservation")
    state = up.internal_get(worker["control_url"] + "/admin/state")
    assert state["num_reservations"] == 0 and state["num_kv_blocks_used"] == 0
    # Reclaiming is not ejecting: the worker kept serving.
    assert {w["id"]: w["state"] for w in up.workers()}[worker["id"]] == "ready"


def test_a_slow_worker_is_ejected_and_its_peer_is_not(up, client) -> None:
    slow, peer = decode_workers(up)
    answer = control_call(up, slow, FaultRequest(step_delay_ms=500),
                          FaultResponse)
    assert answer.step_delay_ms == 500
    started = time.time()
    load = Load(client)
    try:
        ejected = wait_event(up, lambda e: e["worker_id"] == slow["id"] and
                             e["action"] == "eject", 90, "the slow worker ejected")
        assert ejected["rule"] == "slow" and ejected["epoch"] == slow["epoch"]
        # Found slow again after its probation (the fault is still on): restarted, which
        # clears the fault; the new epoch comes back and is re-admitted.
        restarted = wait_event(up, lambda e: e["worker_id"] == slow["id"] and
                               e["action"] == "eject+restart", 90, "the slow worker restarted")
        assert restarted["epoch"] == slow["epoch"]
        wait_new_epoch_ready(up, slow, 120)
        # Its tier's attainment fell meanwhile: the root-cause report names the worker and
        # the stage that grew.
        report = wait_report(up, lambda r: r["causes"] and r["at_unix_ms"] >= started * 1000,
                             30, "the slow worker's tier")
        cause = report["causes"][0]
        assert cause["kind"] == "slow_worker" and cause["worker_ids"] == [slow["id"]], report
        assert cause["stage"] == "decode_step", report
    finally:
        load.stop()
    assert not [e for e in events(up) if e["worker_id"] == peer["id"]
                and e["action"].startswith("eject") and e["at_unix_ms"] >= started * 1000]
    assert load.failures_after(ejected["at_unix_ms"] / 1000) == []
    assert sum(ok for _, ok, _ in load.results) >= 5


def test_a_frozen_decode_worker_is_ejected_restarted_and_readmitted(up, client) -> None:
    wait_all_ready(up)
    frozen = decode_workers(up)[0]
    os.kill(frozen["pid"], signal.SIGSTOP)
    stopped_at = time.time()
    try:
        ejected = wait_event(up, lambda e: e["worker_id"] == frozen["id"] and
                             e["epoch"] == frozen["epoch"] and e["action"] == "eject+restart",
                             30, "the frozen worker ejected")
    finally:
        if pid_alive(frozen["pid"]):
            os.kill(frozen["pid"], signal.SIGCONT)  # (the agent's SIGKILL works either way)
    assert ejected["at_unix_ms"] / 1000 - stopped_at <= 5.0, ejected
    assert ejected["rule"] in ("dead", "hung"), ejected
    # The next requests go to the other decode worker and succeed.
    assert all(complete(client) for _ in range(3))
    back = wait_new_epoch_ready(up, frozen, 120)
    assert back["pid"] != frozen["pid"] and not pid_alive(frozen["pid"])
    wait_event(up, lambda e: e["worker_id"] == frozen["id"] and e["action"] == "recovered"
               and e["epoch"] == back["epoch"], 5, "recovered as its new epoch")
    wait_event(up, lambda e: e["worker_id"] == frozen["id"] and e["action"] == "readmit"
               and e["epoch"] == back["epoch"], 5, "re-admitted after its probation")


def test_a_killed_worker_is_serving_again_within_60_s(up, client) -> None:
    wait_all_ready(up)
    killed = decode_workers(up)[1]
    os.kill(killed["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    ejected = wait_event(up, lambda e: e["worker_id"] == killed["id"] and
                         e["epoch"] == killed["epoch"] and e["action"].startswith("eject"),
                         10, "the killed worker ejected")
    assert ejected["rule"] == "dead"
    assert all(complete(client) for _ in range(2))  # started after the ejection: served
    wait_new_epoch_ready(up, killed, 60 - (time.monotonic() - killed_at))
    assert complete(client)


class Listener:
    """A port that records every connection and byte, and answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = bytearray()
        self.num_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.num_connections += 1
            conn.settimeout(0.5)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_a_fake_registry_entry_carrying_the_gateways_pid_kills_nothing(up, client) -> None:
    """The issue's probe on a default `pdserve up`: a process that can write the cluster's
    Redis but does not hold its token registers copies of a decode worker's entry with the
    project's own calls, carrying the gateway's pid and pointing at its own listener: one
    named like an element of the gateway's command line (its namespace: `gateway` itself
    is no worker id), its lease left to run down (what the agent calls dead), one renewed
    and idle (what the router would prefer). Nothing happens: no process is killed, the
    listener gets no connection, the agent decides nothing about them."""
    wait_all_ready(up)
    redis_url = (up.log_dir / "redis-url").read_text().strip()  # an insider: the password
    [gateway_pid] = [pid for pid in child_pids(up.process.pid)
                     if b"\0gateway\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    listener = Listener()
    seen_events, seen_output = len(events(up)), len(up.output)

    async def forge(seconds: float) -> None:
        state = RedisState(connect(redis_url), "pdserve")  # Redis access, no token
        try:
            real = (await state.read_registry()).workers[decode_workers(up)[0]["id"]]
            fakes = []
            for worker_id, lease_ms in (("pdserve", 2500), ("decoy-decode-0", 3000)):
                fake = msgspec.structs.replace(real, worker_id=worker_id, binding=b"",
                                               control_url=listener.url, pid=gateway_pid,
                                               epoch=await state.next_epoch(worker_id))
                fakes.append((fake, lease_ms))
            deadline = time.monotonic() + seconds
            first = True
            while time.monotonic() < deadline:
                for fake, lease_ms in fakes:
                    if first or lease_ms == 3000:  # the first one's lease runs down
                        await state.heartbeat(fake, LoadReport(worker_id=fake.worker_id,
                                                               epoch=fake.epoch), lease_ms)
                first = False
                await asyncio.sleep(0.3)
        finally:
            await state.aclose()

    forger = threading.Thread(target=asyncio.run, args=(forge(8.0),), daemon=True)
    forger.start()
    try:
        for _ in range(4):
            assert complete(client)
        forger.join(30)
    finally:
        listener.close()
    assert pid_alive(gateway_pid) and up.process.poll() is None, up.output[-3000:]
    assert listener.num_connections == 0 and up.token.encode() not in listener.received
    decided = events(up)[seen_events:]
    assert not [e for e in decided if e["worker_id"] in ("pdserve", "decoy-decode-0")], decided
    assert "restart of" not in up.output[seen_output:], up.output[-3000:]  # none was asked
