"""The Redis routing state: worker registry, load, and the global prefix-cache index.

This is the only module that knows the key schema (docs/redis_schema.md); every other
module calls the methods below. `ns` is the namespace (default "pdserve"):

    {ns}:workers                      SET    worker ids registered and not yet purged
    {ns}:worker:{id}:epoch            STRING epoch counter, INCR at every worker start
    {ns}:worker:{id}:info             STRING WorkerInfo (msgpack), PX lease_ttl   (the lease)
    {ns}:worker:{id}:load             STRING LoadReport (msgpack), PX lease_ttl
    {ns}:worker:{id}:prefixes         SET    block hashes this worker has in the index
    {ns}:worker:{id}:prefix_epoch     STRING the epoch those hashes belong to
    {ns}:prefix:{hash}                HASH   worker id -> epoch, one field per holder
    {ns}:prefix_events                STREAM field "e": PrefixIndexEvent (msgpack), ~MAXLEN
    {ns}:index_generation             STRING random token; changes when Redis lost its data

Lifecycle of one worker's entries: register (INCR epoch) → heartbeat (SET info+load PX ttl,
every period) → ... → deregister (graceful) or lease expiry then purge_expired_worker().
A restart registers again with a higher epoch; its first index write drops every entry of
the older epoch, in Redis and (through the stream) in every mirror.

Invariants (kept atomic by Lua scripts, so no reader sees half a batch):
  - every write carrying epoch e is refused (StaleEpochError) once the counter is above e:
    a zombie incarnation cannot overwrite its successor;
  - {ns}:prefix:{h} has field w  <=>  h is in {ns}:worker:{w}:prefixes;
  - every index change appends exactly one event to the stream, in the same script.
Every method has a deadline (`timeout_s`, else the instance's op_timeout_s). Only a single
Redis instance is supported (scripts touch keys they compute; not Redis Cluster safe).

Trust: `read_registry` returns only entries bound by the cluster's secret (state/entry_check.py);
the others, and ids that are no worker id, are left out and listed in `unbound_ids`.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from protocol.messages import (WORKER_ID_PATTERN, LoadReport, MessageDecoder, PrefixIndexEvent,
                               ProtocolError, WorkerInfo, encode, is_worker_id)
from state.entry_check import EntryCheck
from state.redis_scripts import APPLY_INDEX, HEARTBEAT, PURGE, SNAPSHOT

StreamId = str  # "<ms>-<seq>"; "0-0" before the first event
# The key names after "{ns}:" (the schema above); worker entries are "{ns}:worker:{id}:{field}".
_WORKER, _WORKERS, _PREFIX = "worker:", "workers", "prefix:"
_EVENTS, _GENERATION = "prefix_events", "index_generation"
ScriptArg = bytes | str | int | float  # what a Lua script's ARGV takes

# What a lost, restarted, loading or hung Redis looks like from redis-py and asyncio. Other
# RedisErrors (a bad script, a wrong type) are bugs and propagate instead of being retried.
REDIS_FAILURES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                  TimeoutError)


class StaleEpochError(RuntimeError):
    """A newer incarnation of this worker id has registered; this one must stop writing."""


class Registry(msgspec.Struct, frozen=True, kw_only=True):
    """The registry as one read saw it."""

    registered_ids: list[str]  # registered and not yet purged, live or with a lapsed lease
    workers: dict[str, WorkerInfo]  # holding a live lease (and a binding that verifies), by id
    loads: dict[str, LoadReport]  # of live workers, at their live epoch
    # ms left on each registered worker's lease (0: lapsed); read only when asked for
    lease_left_ms: dict[str, int] = {}
    # Ids whose entry is not bound by the cluster's secret (or that are no worker id): in
    # neither of the above (state/entry_check.py)
    unbound_ids: list[str] = []


class IndexSnapshot(msgspec.Struct, frozen=True):
    generation: str  # "" when no index write happened since Redis started
    last_event_id: StreamId
    holdings: dict[str, tuple[int, list[int]]]  # worker id -> (epoch, hashes)


def raise_if_cancelling(exc: BaseException | None = None) -> None:
    """Re-raise a stop that arrived as a timeout, or did not arrive at all.

    On Python 3.11 a cancel racing an expiring asyncio.timeout (ours or redis-py's) can
    surface as TimeoutError, and a cancel that lands while redis-py reads a reply can be
    swallowed by it (the call returns normally): a loop that goes on would wait for good.
    Loops call this in their handler of Redis failures and after each Redis call.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


async def stop_task(task: asyncio.Task[None], client: aioredis.Redis, timeout_s: float) -> bool:
    """Cancel a background task and wait for it; True when it ended within the deadline.

    If it is still stuck in a socket read, the client's connections are dropped to free it.
    """
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        await client.connection_pool.disconnect()
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    return bool(done)


def connect(url: str, connect_timeout_s: float = 1.0, socket_timeout_s: float = 5.0,
            max_connections: int | None = None, wait_s: float = 0.25) -> aioredis.Redis:
    """A client without hidden retries: callers own retry policy and deadlines. With
    `max_connections`, a burst queues up to `wait_s` for one (then ConnectionError)."""
    options: dict[str, Any] = dict(
        socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0), decode_responses=False)
    if max_connections is None:
        return aioredis.Redis.from_url(url, **options)
    pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                    timeout=wait_s, **options)
    return aioredis.Redis.from_pool(pool)  # closing the client closes its pool


def stream_id_key(stream_id: StreamId) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


class RedisState:
    """Typed operations on the routing state; owns no tasks, holds no state but the client
    and its entry check.

    `entry_key`: the cluster's registry key (protocol/cluster_secret.py's `derive_key`),
    with which the publisher binds this process's own entry and `read_registry` checks
    every other one; None: a cluster without a token (nothing bound, nothing checked)."""

    def __init__(self, client: aioredis.Redis, namespace: str = "pdserve",
                 op_timeout_s: float = 1.0, stream_maxlen: int = 100_000,
                 entry_key: bytes | None = None) -> None:
        self.client = client
        self.entry_key = entry_key
        self.entries = EntryCheck(entry_key)
        self.ns = namespace
        self.op_timeout_s = op_timeout_s
        self.stream_maxlen = stream_maxlen
        self._heartbeat = client.register_script(HEARTBEAT)
        self._apply_index = client.register_script(APPLY_INDEX)
        self._purge = client.register_script(PURGE)
        self._snapshot = client.register_script(SNAPSHOT)
        self._load_decoder: MessageDecoder[LoadReport] = MessageDecoder(LoadReport)
        self._event_decoder: MessageDecoder[PrefixIndexEvent] = MessageDecoder(PrefixIndexEvent)
        # A fresh token per process: whichever writer first touches an empty Redis sets it.
        self._generation_candidate = uuid.uuid4().hex

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---------------------------------------------------------------- keys (the schema)

    def _worker_key(self, worker_id: str, field: str) -> str:
        if not is_worker_id(worker_id):
            raise ValueError(f"invalid worker id {worker_id!r}: must match {WORKER_ID_PATTERN}")
        return f"{self.ns}:{_WORKER}{worker_id}:{field}"

    def epoch_key(self, worker_id: str) -> str:
        """The epoch counter's key, for scripts of other modules that fence by epoch."""
        return self._worker_key(worker_id, "epoch")

    @property
    def _workers_key(self) -> str:
        return f"{self.ns}:{_WORKERS}"

    @property
    def _prefix_key_prefix(self) -> str:
        return f"{self.ns}:{_PREFIX}"

    @property
    def events_key(self) -> str:
        return f"{self.ns}:{_EVENTS}"

    @property
    def _generation_key(self) -> str:
        return f"{self.ns}:{_GENERATION}"

    def deadline(self, timeout_s: float | None) -> asyncio.Timeout:
        return asyncio.timeout(self.op_timeout_s if timeout_s is None else timeout_s)

    # ---------------------------------------------------------------- registry and load

    async def next_epoch(self, worker_id: str, timeout_s: float | None = None) -> int:
        """Called exactly once per worker start; the returned epoch fences older starts."""
        async with self.deadline(timeout_s):
            return int(await self.client.incr(self._worker_key(worker_id, "epoch")))

    async def heartbeat(self, info: WorkerInfo, load: LoadReport | None, lease_ttl_ms: int,
                        timeout_s: float | None = None) -> bool:
        """Renew the lease (and load); False when the lease had lapsed and was re-created."""
        wid = info.worker_id
        keys = [self._worker_key(wid, "epoch"), self._worker_key(wid, "info"),
                self._worker_key(wid, "load"), self._workers_key]
        args: list[ScriptArg] = [wid, info.epoch, encode(info), encode(load) if load is not None else b"",
                lease_ttl_ms]
        async with self.deadline(timeout_s):
            result = int(await self._heartbeat(keys=keys, args=args))
        if result < 0:
            raise StaleEpochError(f"worker {wid} epoch {info.epoch} was superseded")
        return result == 1

    async def deregister(self, worker_id: str, epoch: int, timeout_s: float | None = None) -> bool:
        """Graceful exit: drop the lease, load and index entries. False if fenced already."""
        return await self._purge_worker(worker_id, epoch, "deregister", timeout_s) == 1

    async def purge_expired_worker(self, worker_id: str, timeout_s: float | None = None) -> bool:
        """Drop the index entries of a worker whose lease expired; False if it is alive."""
        async with self.deadline(timeout_s):
            epoch = int(await self.client.get(self._worker_key(worker_id, "epoch")) or 0)
        return await self._purge_worker(worker_id, epoch, "expired", timeout_s) == 1

    async def _purge_worker(self, worker_id: str, epoch: int, mode: str,
                            timeout_s: float | None) -> int:
        keys = [self._worker_key(worker_id, f) for f in ("epoch", "info", "load", "prefixes",
                                                           "prefix_epoch")]
        keys += [self._workers_key, self.events_key]
        event = PrefixIndexEvent(worker_id=worker_id, epoch=epoch, reset=True)
        args: list[ScriptArg] = [worker_id, epoch, mode, encode(event), self.stream_maxlen, self._prefix_key_prefix]
        async with self.deadline(timeout_s):
            return int(await self._purge(keys=keys, args=args))

    async def list_worker_ids(self, timeout_s: float | None = None) -> list[str]:
        """Every registered id, live or with a lapsed lease not yet purged."""
        async with self.deadline(timeout_s):
            return sorted(_text(m) for m in await self.client.smembers(self._workers_key))

    async def list_workers(self, timeout_s: float | None = None) -> dict[str, WorkerInfo]:
        """Workers holding a live lease, by id."""
        return (await self.read_registry(timeout_s)).workers

    async def list_loads(self, timeout_s: float | None = None) -> dict[str, LoadReport]:
        """Latest load of each live worker; loads of an older epoch are left out."""
        return (await self.read_registry(timeout_s)).loads

    async def read_registry(self, timeout_s: float | None = None,
                            with_leases: bool = False) -> Registry:
        """The whole registry in two round trips: the id set, then every info and load (and,
        `with_leases`, what each lease has left)."""
        async with self.deadline(timeout_s):
            members = sorted(_text(m) for m in await self.client.smembers(self._workers_key))
            ids = [w for w in members if is_worker_id(w)]
            unbound = [w for w in members if not is_worker_id(w)]
            for worker_id in unbound:
                self.entries.report(worker_id, b"", "its id is not a worker id")
            if not ids:
                return Registry(registered_ids=[], workers={}, loads={}, unbound_ids=unbound)
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.mget([self._worker_key(w, f) for f in ("info", "load") for w in ids])
                for w in ids if with_leases else ():
                    pipe.pttl(self._worker_key(w, "info"))
                blobs, *ttls = await pipe.execute()
        workers = {}
        for worker_id, blob in zip(ids, blobs[:len(ids)]):
            if blob is None:
                continue
            info = self.entries.trusted(worker_id, _blob(blob))
            if info is None:
                unbound.append(worker_id)
            else:
                workers[worker_id] = info
        loads = {}
        for worker_id, blob in zip(ids, blobs[len(ids):]):
            live = workers.get(worker_id)
            if blob is None or live is None:
                continue
            try:
                report = self._load_decoder.decode(_blob(blob))
            except ProtocolError:
                continue  # no load known: routed as an idle worker, as before its first one
            if report.worker_id == worker_id and report.epoch == live.epoch:
                loads[worker_id] = report
        # An id whose entry cannot be trusted is neither live nor lapsed: nobody calls it,
        # and nobody restarts a worker because someone overwrote its entry. Once that entry
        # lapses, the id is an ordinary lapsed one (and purged as such).
        leases = {w: max(0, int(ttl)) for w, ttl in zip(ids, ttls) if w not in unbound}
        return Registry(registered_ids=[w for w in ids if w not in unbound], workers=workers,
                        loads=loads, lease_left_ms=leases, unbound_ids=sorted(unbound))

    # ---------------------------------------------------------------- prefix index

    async def apply_index_event(self, event: PrefixIndexEvent,
                                timeout_s: float | None = None) -> StreamId:
        """Apply one batch of insert/evict changes atomically and append it to the stream."""
        wid = event.worker_id
        keys = [self._worker_key(wid, "epoch"), self._worker_key(wid, "prefixes"),
                self._worker_key(wid, "prefix_epoch"), self.events_key, self._generation_key,
                self._workers_key]
        args: list[ScriptArg] = [wid, event.epoch, "1" if event.reset else "0", len(event.inserted),
                              len(event.evicted), encode(event), self.stream_maxlen,
                              self._prefix_key_prefix, self._generation_candidate]
        args += event.inserted
        args += event.evicted
        async with self.deadline(timeout_s):
            result = await self._apply_index(keys=keys, args=args)
        if isinstance(result, int):
            raise StaleEpochError(f"worker {wid} epoch {event.epoch} was superseded")
        return result.decode()

    async def query_prefix_holders(self, hashes: Sequence[int],
                                   timeout_s: float | None = None) -> list[dict[str, int]]:
        """For each hash, worker id -> epoch as stored (callers filter by live epochs)."""
        async with self.deadline(timeout_s):
            async with self.client.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.hgetall(f"{self._prefix_key_prefix}{h}")
                rows = await pipe.execute()
        return [{k.decode(): int(v) for k, v in row.items()} for row in rows]

    async def snapshot_index(self, timeout_s: float | None = None) -> IndexSnapshot:
        async with self.deadline(timeout_s):
            out = await self._snapshot(keys=[self._workers_key, self.events_key,
                                             self._generation_key],
                                       args=[f"{self.ns}:{_WORKER}"])
        holdings = {_text(out[i]): (int(out[i + 1]), [int(h) for h in out[i + 2]])
                    for i in range(2, len(out), 3)}
        return IndexSnapshot(_text(out[0]), _text(out[1]), holdings)

    async def index_generation(self, timeout_s: float | None = None) -> str:
        async with self.deadline(timeout_s):
            return _text(await self.client.get(self._generation_key) or b"")

    async def first_event_id(self, timeout_s: float | None = None) -> StreamId | None:
        """Oldest event still in the stream (older ones were trimmed), None when empty."""
        async with self.deadline(timeout_s):
            rows = await self.client.xrange(self.events_key, "-", "+", count=1)
        return _text(rows[0][0] or b"") if rows else None

    async def read_index_events(self, after_id: StreamId, count: int = 1000, block_ms: int | None = None,
                                timeout_s: float | None = None
                                ) -> list[tuple[StreamId, PrefixIndexEvent]]:
        """Events after `after_id`, oldest first; waits up to block_ms for the first one."""
        budget = (self.op_timeout_s if timeout_s is None else timeout_s) + (block_ms or 0) / 1000
        async with asyncio.timeout(budget):
            reply = await self.client.xread({self.events_key: after_id}, count=count, block=block_ms)
        if not reply:
            return []
        # RESP2 answers a list of [stream, entries], RESP3 a map stream -> [entries].
        streams = cast("list[list[Any]] | dict[Any, list[Any]]", reply)
        entries = streams[0][1] if isinstance(streams, list) else next(iter(streams.values()))[0]
        return [(_text(eid), self._event_decoder.decode(_blob(fields[b"e"])))
                for eid, fields in entries]

    async def trim_events(self, max_len: int, timeout_s: float | None = None) -> None:
        """Exact trim; for tests and operators (writers trim approximately on their own)."""
        async with self.deadline(timeout_s):
            await self.client.xtrim(self.events_key, maxlen=max_len, approximate=False)


def glob_escape(text: str) -> str:
    """`text` matched literally inside a Redis glob pattern (an ACL user's key patterns)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def namespace_pattern(namespace: str) -> str:
    """Every key of the namespace, as a glob pattern."""
    return f"{glob_escape(namespace)}:*"


def worker_write_patterns(namespace: str, worker_id: str) -> list[str]:
    """The keys one worker's writes touch, as glob patterns (its ACL user's: register,
    heartbeat, index events, deregister): its own entries and the index keys every worker
    shares. Another worker's entries (epoch, lease, load) are not among them."""
    if not re.fullmatch(WORKER_ID_PATTERN, worker_id):
        raise ValueError(f"invalid worker id {worker_id!r}: must match {WORKER_ID_PATTERN}")
    ns = glob_escape(namespace)
    return [f"{ns}:{_WORKER}{worker_id}:*", f"{ns}:{_WORKERS}", f"{ns}:{_PREFIX}*",
            f"{ns}:{_EVENTS}", f"{ns}:{_GENERATION}"]


def live_epochs(workers: Mapping[str, WorkerInfo] | Iterable[WorkerInfo]) -> dict[str, int]:
    """worker id -> epoch for the workers holding a lease (what index readers trust)."""
    values = workers.values() if isinstance(workers, Mapping) else workers
    return {w.worker_id: w.epoch for w in values}


def _text(value: bytes | str) -> str:
    """A reply field as text (the client returns bytes; redis-py's types allow str too)."""
    return value.decode() if isinstance(value, bytes) else value


def _blob(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
