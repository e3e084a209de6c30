"""What the operations agent keeps in Redis for the rest of the cluster: the ejection list
and its event log. This module alone reads and writes these keys (docs/redis_schema.md):

    {ns}:ejected        HASH    worker id -> Ejection (JSON): out of routing at that epoch
    {ns}:agent_events   STREAM  field "e": AgentEvent (JSON), MAXLEN ~ 10000
    {ns}:agent_leader   STRING  the acting agent's id, PX lease (one agent acts at a time)
    {ns}:agent_reports  STREAM  field "r": RootCauseReport (JSON), MAXLEN ~ 1000

An ejection names one epoch of a worker: the gateway routes nothing new to that worker
while its live epoch is the ejected one and the entry has not lapsed (`until_unix_ms`; the
agent renews what it still wants out, so a dead agent's ejections end by themselves). A
restarted worker (a new epoch) is routable at once, whatever the list says.

Invariants: `eject` refuses an epoch older than the worker's counter (a newer incarnation
replaced it: StaleEpochError) — checked in the same script that writes; `readmit` removes
an entry only when it names the given epoch, so a late re-admission never clears a newer
ejection.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec

from protocol.root_cause_report import RootCauseReport
from state.redis_state import RedisState, StaleEpochError, glob_escape

EVENTS_MAXLEN = 10_000
REPORTS_MAXLEN = 1000
# The key names after "{ns}:" (the schema above).
_EJECTED, _EVENTS, _LEADER = "ejected", "agent_events", "agent_leader"
_REPORTS = "agent_reports"

# KEYS: ejected. ARGV: worker id, epoch, entry (JSON), the worker's epoch counter key (an
# argument, not a key: a script's keys need write access, and the agent's Redis user may
# only read it, state/redis_users.py). Returns -1 when a newer epoch registered, else 1.
_EJECT = """
local cur = tonumber(redis.call('GET', ARGV[4]) or '0')
if cur > tonumber(ARGV[2]) then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# KEYS: ejected. ARGV: worker id, epoch. Returns 1 when the entry named that epoch.
_READMIT = """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return 0 end
if tonumber(cjson.decode(entry)['epoch']) ~= tonumber(ARGV[2]) then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


# KEYS: leader. ARGV: agent id, ttl ms. Returns 1 when this agent holds the lease now.
_LEAD = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: leader. ARGV: agent id. Drops the lease only if this agent holds it.
_RESIGN = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) return 1 end
return 0
"""


class Ejection(msgspec.Struct, frozen=True, kw_only=True):
    worker_id: str
    epoch: int
    rule: str  # the detection rule that fired (agent/health_rules.py), or "operator"
    reason: str
    at_unix_ms: int
    until_unix_ms: int  # lapses then unless renewed

    def applies(self, live_epoch: int | None, now_unix_ms: int) -> bool:
        """Does it keep the worker, live at `live_epoch`, out of routing now?"""
        return live_epoch == self.epoch and now_unix_ms < self.until_unix_ms


class AgentEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One decision of the agent: what it saw, which rule fired, what it did, how it went."""

    at_unix_ms: int
    worker_id: str
    epoch: int
    rule: str  # a detection rule, "probation" or "rebalance"
    evidence: str
    action: str  # what was decided ("eject", "restart", "readmit", "hold", ...)
    outcome: str  # "done", "dry_run", "held: <why>", "failed: <why>"


def now_unix_ms() -> int:
    return int(time.time() * 1000)


def agent_write_patterns(namespace: str) -> list[str]:
    """The keys the agent writes, as glob patterns (its ACL user's): these four only."""
    ns = glob_escape(namespace)
    return [f"{ns}:{name}" for name in (_EJECTED, _EVENTS, _LEADER, _REPORTS)]


def active_ejections(ejected: Mapping[str, Ejection], live_epochs: Mapping[str, int],
                     now_ms: int) -> frozenset[str]:
    """The worker ids that must get nothing new now (pure)."""
    return frozenset(w for w, e in ejected.items() if e.applies(live_epochs.get(w), now_ms))


class AgentState:
    """Typed operations on the agent's keys; every call under the state's op deadline."""

    def __init__(self, state: RedisState) -> None:
        self.state = state
        self._eject = state.client.register_script(_EJECT)
        self._readmit = state.client.register_script(_READMIT)
        self._lead = state.client.register_script(_LEAD)
        self._resign = state.client.register_script(_RESIGN)
        self._decoder = msgspec.json.Decoder(Ejection)
        self._event_decoder = msgspec.json.Decoder(AgentEvent)
        self._report_decoder = msgspec.json.Decoder(RootCauseReport)

    @property
    def ejected_key(self) -> str:
        return f"{self.state.ns}:{_EJECTED}"

    @property
    def events_key(self) -> str:
        return f"{self.state.ns}:{_EVENTS}"

    @property
    def reports_key(self) -> str:
        return f"{self.state.ns}:{_REPORTS}"

    @property
    def leader_key(self) -> str:
        return f"{self.state.ns}:{_LEADER}"

    async def lead(self, agent_id: str, ttl_ms: int, timeout_s: float | None = None) -> bool:
        """Take or renew the leader lease; False while another agent holds it."""
        async with self.state.deadline(timeout_s):
            return int(await self._lead(keys=[self.leader_key], args=[agent_id, ttl_ms])) == 1

    async def resign(self, agent_id: str, timeout_s: float | None = None) -> None:
        async with self.state.deadline(timeout_s):
            await self._resign(keys=[self.leader_key], args=[agent_id])

    async def eject(self, ejection: Ejection, timeout_s: float | None = None) -> None:
        """Write (or renew) an ejection; StaleEpochError when a newer epoch registered."""
        keys = [self.ejected_key]
        args: list[bytes | str | int] = [ejection.worker_id, ejection.epoch,
                                         msgspec.json.encode(ejection),
                                         self.state.epoch_key(ejection.worker_id)]
        async with self.state.deadline(timeout_s):
            result = int(await self._eject(keys=keys, args=args))
        if result < 0:
            raise StaleEpochError(f"worker {ejection.worker_id} epoch {ejection.epoch} was "
                                  "replaced: not ejected")

    async def readmit(self, worker_id: str, epoch: int, timeout_s: float | None = None) -> bool:
        """Drop the ejection of (worker, epoch); False when there was none of that epoch."""
        async with self.state.deadline(timeout_s):
            return int(await self._readmit(keys=[self.ejected_key],
                                           args=[worker_id, epoch])) == 1

    async def read_ejected(self, timeout_s: float | None = None) -> dict[str, Ejection]:
        async with self.state.deadline(timeout_s):
            rows = await self.state.client.hgetall(self.ejected_key)
        out = {}
        for value in rows.values():
            try:
                entry = self._decoder.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # not ours: never let one bad field stop routing
            out[entry.worker_id] = entry
        return out

    async def record(self, event: AgentEvent, timeout_s: float | None = None) -> None:
        async with self.state.deadline(timeout_s):
            await self.state.client.xadd(self.events_key, {"e": msgspec.json.encode(event)},
                                         maxlen=EVENTS_MAXLEN, approximate=True)

    async def recent_events(self, count: int, timeout_s: float | None = None
                            ) -> list[AgentEvent]:
        """The last `count` events, newest first."""
        async with self.state.deadline(timeout_s):
            rows = await self.state.client.xrevrange(self.events_key, count=count)
        events = []
        for _, fields in rows or []:
            try:
                events.append(self._event_decoder.decode((fields or {})[b"e"]))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue
        return events

    async def record_report(self, report: RootCauseReport, timeout_s: float | None = None
                            ) -> None:
        async with self.state.deadline(timeout_s):
            await self.state.client.xadd(self.reports_key, {"r": msgspec.json.encode(report)},
                                         maxlen=REPORTS_MAXLEN, approximate=True)

    async def recent_reports(self, count: int, timeout_s: float | None = None
                             ) -> list[RootCauseReport]:
        """The last `count` root-cause reports, newest first."""
        async with self.state.deadline(timeout_s):
            rows = await self.state.client.xrevrange(self.reports_key, count=count)
        reports = []
        for _, fields in rows or []:
            try:
                reports.append(self._report_decoder.decode((fields or {})[b"r"]))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                continue
        return reports
