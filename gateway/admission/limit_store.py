"""The admission limits that gateway replicas share, as Redis keys and atomic scripts.

This module owns the limits' key schema (docs/redis_schema.md); gateway/admission/shared_limits.py
decides when to call it. `ns` is the namespace (default "pdserve"), a slot member is
"GATEWAY_ID/REQUEST_ID":

    {ns}:gateways                  ZSET  gateway id -> lease expiry (ms, Redis clock)
    {ns}:limits:running:{tier}     ZSET  slot member -> lease expiry: requests admitted
    {ns}:limits:running            ZSET  slot member -> lease expiry: all tiers together
    {ns}:limits:queued:{tier}      ZSET  slot member -> when its waiter gives up (ms)
    {ns}:limits:bucket:{key id}    HASH  level, t: a key's token bucket, PEXPIRE 120 s

Every time is Redis's own (`TIME` inside the scripts), so replicas whose clocks disagree
still agree on leases. A replica that dies leaves its slots until their lease lapses
(`lease_ms`, renewed by the replica's sync), its queued entries until their give-up time
plus one second.

Invariants (each script is atomic, so no replica sees half an update):
  * a tier admits while fewer than `max_running` of its leases and fewer than
    `max_running_total` of all leases are live, and only to its queue's head: a slot
    freed while others wait goes to the earliest give-up time (FIFO within a tier);
  * a tier's queue holds at most `max_queued` live entries;
  * a bucket's level stays within [0, tokens_per_min].
Every call has a deadline (`op_timeout_s`); on a lost or slow Redis it raises one of
`REDIS_FAILURES` and the caller falls back (gateway/admission/shared_limits.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis

from state.redis_state import ScriptArg

# Redis time in ms, then lapsed leases and abandoned queue entries dropped.
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: running:{tier}, queued:{tier}, running (all tiers).
# ARGV: member, max_running, max_queued, max_running_total, lease ms, wait limit ms.
# Returns {state, num_running, num_ahead}: state 1 admitted, 0 queued, -1 refused (queue full).
_ACQUIRE = _NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 1000)
local member = ARGV[1]
local running = redis.call('ZCARD', KEYS[1])
local free = math.min(tonumber(ARGV[2]) - running,
                      tonumber(ARGV[4]) - redis.call('ZCARD', KEYS[3]))
local score = redis.call('ZSCORE', KEYS[2], member)
local ahead
if score then
  ahead = redis.call('ZCOUNT', KEYS[2], '-inf', '(' .. score)
else
  ahead = redis.call('ZCARD', KEYS[2])
end
if free > ahead then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), member)
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[5]), member)
  redis.call('ZREM', KEYS[2], member)
  return {1, running + 1, ahead}
end
if not score then
  if ahead >= tonumber(ARGV[3]) then return {-1, running, ahead} end
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), member)
end
return {0, running, ahead}
"""

# KEYS: bucket. ARGV: tokens, tokens_per_min, "charge" | "refund".
# Returns 0 when charged (or refunded), else ms until the charge would fit.
_BUCKET = _NOW + """
local cap = tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'level', 't')
local level = tonumber(b[1]) or cap
local t = tonumber(b[2]) or now
level = math.min(cap, level + math.max(0, now - t) * cap / 60000)
local n = tonumber(ARGV[1])
local wait = 0
if ARGV[3] == 'refund' then
  level = math.min(cap, level + n)
elseif n <= level then
  level = level - n
else
  wait = math.ceil((math.min(n, cap) - level) * 60000 / cap)
end
redis.call('HSET', KEYS[1], 'level', tostring(level), 't', now)
redis.call('PEXPIRE', KEYS[1], 120000)
return wait
"""

# KEYS: gateways, running (all tiers). ARGV: gateway id, lease ms, key prefix, then
# num_released, (tier, member) pairs, num_held, (tier, member) pairs, num_refunds,
# (key id, tokens, tokens_per_min) triples. Returns the number of live gateways.
_SYNC = _NOW + """
local lease = tonumber(ARGV[2])
local pfx = ARGV[3]
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local i = 4
local n = tonumber(ARGV[i])
for _ = 1, n do
  local tier, member = ARGV[i + 1], ARGV[i + 2]
  redis.call('ZREM', pfx .. 'running:' .. tier, member)
  redis.call('ZREM', pfx .. 'queued:' .. tier, member)
  redis.call('ZREM', KEYS[2], member)
  i = i + 2
end
i = i + 1
n = tonumber(ARGV[i])
for _ = 1, n do
  local tier, member = ARGV[i + 1], ARGV[i + 2]
  redis.call('ZADD', pfx .. 'running:' .. tier, now + lease, member)
  redis.call('ZADD', KEYS[2], now + lease, member)
  i = i + 2
end
i = i + 1
n = tonumber(ARGV[i])
for _ = 1, n do
  local key, tokens, cap = pfx .. 'bucket:' .. ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local b = redis.call('HMGET', key, 'level', 't')
  if b[1] then
    local level = math.min(cap, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * cap / 60000)
    redis.call('HSET', key, 'level', tostring(math.min(cap, level + tokens)), 't', now)
  end
  i = i + 3
end
return redis.call('ZCOUNT', KEYS[1], now, '+inf')
"""


@dataclass(frozen=True, slots=True)
class SlotAnswer:
    state: int  # 1 admitted, 0 queued (ask again), -1 refused: the tier's queue is full
    num_running: int  # the tier's live leases, this one included when admitted
    num_ahead: int  # queued before this request


@dataclass(frozen=True, slots=True)
class SyncBatch:
    released: Sequence[tuple[str, str]]  # (tier, member): slots and queue entries to drop
    held: Sequence[tuple[str, str]]  # (tier, member): slots to renew (or re-add)
    refunds: Sequence[tuple[str, int, int]]  # (key id, tokens, tokens_per_min)


class LimitStore:
    def __init__(self, client: aioredis.Redis, namespace: str = "pdserve",
                 op_timeout_s: float = 0.25) -> None:
        self._redis = client
        self._ns = namespace
        self.op_timeout_s = op_timeout_s
        self._acquire = client.register_script(_ACQUIRE)
        self._bucket = client.register_script(_BUCKET)
        self._sync = client.register_script(_SYNC)

    @property
    def _prefix(self) -> str:
        return f"{self._ns}:limits:"

    async def acquire(self, tier: str, member: str, max_running: int, max_queued: int,
                      max_running_total: int, lease_ms: int, wait_limit_ms: int) -> SlotAnswer:
        keys = [f"{self._prefix}running:{tier}", f"{self._prefix}queued:{tier}",
                f"{self._prefix}running"]
        args: list[ScriptArg] = [member, max_running, max_queued, max_running_total, lease_ms,
                                 max(1, wait_limit_ms)]
        state, num_running, num_ahead = cast(
            list[int], await self._call(self._acquire(keys=keys, args=args)))
        return SlotAnswer(int(state), int(num_running), int(num_ahead))

    async def charge(self, key_id: str, num_tokens: int, tokens_per_min: int) -> float | None:
        """Charge a key's bucket; None when allowed, else seconds until it would fit."""
        wait_ms = await self._call(self._bucket(
            keys=[f"{self._prefix}bucket:{key_id}"], args=[num_tokens, tokens_per_min, "charge"]))
        return None if int(wait_ms) == 0 else int(wait_ms) / 1000.0

    async def sync(self, gateway_id: str, lease_ms: int, batch: SyncBatch) -> int:
        """Release, renew and refund in one script; returns the number of live gateways
        (this one included)."""
        args: list[ScriptArg] = [gateway_id, lease_ms, self._prefix, len(batch.released)]
        for tier, member in batch.released:
            args += [tier, member]
        args.append(len(batch.held))
        for tier, member in batch.held:
            args += [tier, member]
        args.append(len(batch.refunds))
        for key_id, num_tokens, tokens_per_min in batch.refunds:
            args += [key_id, num_tokens, tokens_per_min]
        keys = [f"{self._ns}:gateways", f"{self._prefix}running"]
        return int(await self._call(self._sync(keys=keys, args=args)))

    async def num_running(self, tier: str) -> int:
        """The tier's live and lapsed leases (for tests and /admin)."""
        return int(await self._call(self._redis.zcard(f"{self._prefix}running:{tier}")))

    async def num_queued(self, tier: str) -> int:
        """The tier's queue entries, live and lapsed (for tests and /admin)."""
        return int(await self._call(self._redis.zcard(f"{self._prefix}queued:{tier}")))

    async def _call(self, awaitable: Awaitable[Any]) -> Any:
        async with asyncio.timeout(self.op_timeout_s):
            return await awaitable
