"""The operations agent's Redis state against a real Redis server: ejections fenced by
epoch, lapsing by themselves, honoured by the gateway's cluster view at its next poll; the
leader lease; the event stream."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.upstream.cluster import ClusterView
from protocol.messages import Role, WorkerInfo
from protocol.worker_load import WorkerLoad
from state.agent_state import AgentEvent, AgentState, Ejection, now_unix_ms
from state.prefix_index_mirror import PrefixIndexMirror
from state.redis_state import RedisState, StaleEpochError, connect
from worker.publisher import WorkerPublisher

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
async def state(redis_url: str) -> AsyncIterator[RedisState]:
    st = RedisState(connect(redis_url), namespace=f"t{uuid.uuid4().hex[:8]}")
    yield st
    await st.aclose()


def info(worker_id: str, role: Role = Role.DECODE) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, model="tiny",
                      control_url="http://127.0.0.1:1", num_kv_blocks=64, block_size=16)


def ejection(worker_id: str, epoch: int, hold_ms: int = 60_000) -> Ejection:
    now = now_unix_ms()
    return Ejection(worker_id=worker_id, epoch=epoch, rule="slow", reason="test",
                    at_unix_ms=now, until_unix_ms=now + hold_ms)


async def publish(state: RedisState, worker_id: str) -> WorkerPublisher:
    publisher = WorkerPublisher(state, info(worker_id), lambda: WorkerLoad(num_kv_blocks_total=64),
                                period_s=0.1, lease_ttl_s=1.0)
    await publisher.start()
    return publisher


async def test_an_ejection_names_one_epoch_and_a_restart_ends_it(state: RedisState) -> None:
    agent = AgentState(state)
    first = await publish(state, "d0")
    await agent.eject(ejection("d0", first.epoch))
    assert (await agent.read_ejected())["d0"].epoch == first.epoch
    await first.stop(deregister=False)
    second = await publish(state, "d0")  # a restart: a newer epoch
    try:
        with pytest.raises(StaleEpochError):  # the old epoch can no longer be ejected
            await agent.eject(ejection("d0", first.epoch))
        # A late re-admission of an older epoch never clears a newer ejection.
        await agent.eject(ejection("d0", second.epoch))
        assert not await agent.readmit("d0", first.epoch)
        assert (await agent.read_ejected())["d0"].epoch == second.epoch
        assert await agent.readmit("d0", second.epoch)
        assert await agent.read_ejected() == {}
    finally:
        await second.stop()


async def test_the_gateway_routes_nothing_to_an_ejected_epoch(state: RedisState) -> None:
    agent = AgentState(state)
    workers = [await publish(state, w) for w in ("d0", "d1")]
    view = ClusterView(state, PrefixIndexMirror(state), random.Random(0), poll_period_s=0.05,
                       agent_state=agent)
    await view.start()
    try:
        await view.poll()
        assert {w.worker_id for w in view._routable({})} == {"d0", "d1"}
        await agent.eject(ejection("d0", workers[0].epoch))
        await view.poll()
        assert {w.worker_id for w in view._routable({})} == {"d1"}
        view.check_invariants()
        entry = next(e for e in view.entries() if e.worker_id == "d0")
        assert entry.ejection is not None and entry.ejection.rule == "slow"
        # A lapsed ejection (the agent that wrote it stopped renewing) no longer applies.
        await agent.eject(ejection("d0", workers[0].epoch, hold_ms=-1))
        await view.poll()
        assert {w.worker_id for w in view._routable({})} == {"d0", "d1"}
        # Garbage in the list never stops routing.
        await state.client.hset(agent.ejected_key, "d1", b"not json")
        await view.poll()
        assert {w.worker_id for w in view._routable({})} == {"d0", "d1"}
    finally:
        await view.stop()
        for worker in workers:
            await worker.stop()


async def test_one_agent_leads_at_a_time(state: RedisState) -> None:
    agent = AgentState(state)
    assert await agent.lead("a", 300)
    assert await agent.lead("a", 300)  # renewal
    assert not await agent.lead("b", 300)
    await agent.resign("b")  # not the holder: nothing changes
    assert not await agent.lead("b", 300)
    await asyncio.sleep(0.4)  # a's lease lapses: b takes over
    assert await agent.lead("b", 300)
    await agent.resign("b")
    assert await agent.lead("a", 300)


async def test_events_come_back_newest_first(state: RedisState) -> None:
    agent = AgentState(state)
    for index in range(5):
        await agent.record(AgentEvent(at_unix_ms=index, worker_id="d0", epoch=1, rule="slow",
                                      evidence=f"e{index}", action="eject", outcome="done"))
    await state.client.xadd(agent.events_key, {"e": b"garbage"})
    events = await agent.recent_events(4)
    assert [e.evidence for e in events] == ["e4", "e3", "e2"]  # the garbage one is skipped


async def test_the_audit_records_a_held_decision_once_per_reason(state: RedisState,
                                                                 tmp_path) -> None:
    from agent.audit import Audit
    from agent.decision import Decision, EventAction, Outcome
    from agent.health_rules import Rule
    from telemetry.metrics import MetricsRegistry

    audit = Audit(AgentState(state), MetricsRegistry(), tmp_path / "audit.jsonl")
    audit.open()

    def event(outcome: str) -> Decision:
        return Decision(at_unix_ms=1, worker_id="d0", epoch=1, rule=Rule.SLOW, evidence="x",
                        action=EventAction.HOLD, outcome=Outcome.held(outcome))

    assert await audit.record(event("acted on 1.0 s ago (cooldown 10 s)"))
    assert not await audit.record(event("acted on 2.0 s ago (cooldown 10 s)"))
    assert await audit.record(event("1 of the 2 decode worker(s) are out already"))
    audit.close()
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert len(lines) == 2 and len(await AgentState(state).recent_events(10)) == 2
    assert audit.decisions.value(rule="slow", action="hold", outcome="held") == 2
