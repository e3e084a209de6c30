"""A loopback TCP proxy in front of a worker's control server, for drills: every byte to
and from the control port passes through it, and a NetFault (rpc/net_fault.py) set on it
delays, loses (retransmits late) or partitions that traffic, as `tc netem` would on the
worker's interface, without root or a network namespace. A worker runs one only when
started with fault injection on (worker/runtime.py); it then registers the proxy's address.

    caller ──TCP──▶ proxy (host:port, the registered one) ──TCP──▶ control server (host:0)
                    per direction: reader ─▶ queue of (release time, chunk) ─▶ writer

Lifecycle: start(upstream_port) binds → connections (each a task running its two
directions; a connection ends when both directions ended, or either side failed) →
stop() closes the listener and every connection.
Invariants: each direction writes its chunks in the order it read them, none before its
release time; `num_connections` counts the connection tasks still running, and after
stop() it is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from rpc.net_fault import NO_FAULT, NetFault, release_at

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 16
MAX_HELD_CHUNKS = 1024  # per direction (64 MiB): a reader waits for its writer beyond that
CONNECT_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 30.0


class FaultProxy:
    def __init__(self, host: str, rng: random.Random | None = None) -> None:
        self.host = host
        self.fault: NetFault = NO_FAULT
        self._rng = rng or random.Random()
        self._upstream_port: int | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port: int | None = None

    async def start(self, port: int, upstream_port: int) -> int:
        """Listen on host:port (0: the OS picks) for the control server on upstream_port;
        returns the bound port."""
        self._upstream_port = upstream_port
        self._server = await asyncio.start_server(self._accept, self.host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self._upstream_port is not None
        self._connections.add(task)
        upstream: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up_reader, upstream = await asyncio.open_connection(self.host,
                                                                    self._upstream_port)
            async with asyncio.TaskGroup() as group:
                group.create_task(self._direction(reader, upstream))
                group.create_task(self._direction(up_reader, writer))
        except (OSError, TimeoutError, ExceptionGroup) as exc:
            log.debug("fault proxy: a connection ended: %r", exc)
        finally:
            self._connections.discard(task)
            for side in (writer, upstream):
                if side is not None:
                    side.close()

    async def _direction(self, source: asyncio.StreamReader,
                         sink: asyncio.StreamWriter) -> None:
        """Copy source to sink, each chunk at its release time; an EOF passes on in order."""
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(MAX_HELD_CHUNKS)

        async def read() -> None:
            previous_s = 0.0
            while True:
                chunk = await source.read(CHUNK_BYTES)  # b"": EOF, queued as such
                previous_s = release_at(self.fault, time.monotonic(), previous_s,
                                        self._rng.random())
                await held.put((previous_s, chunk))
                if not chunk:
                    return

        async with asyncio.TaskGroup() as group:
            group.create_task(read())
            while True:
                due_s, chunk = await held.get()
                await asyncio.sleep(max(0.0, due_s - time.monotonic()))
                if not chunk:
                    with contextlib.suppress(OSError):
                        if sink.can_write_eof():
                            sink.write_eof()
                    return
                sink.write(chunk)
                async with asyncio.timeout(DRAIN_TIMEOUT_S):  # a peer that stopped reading
                    await sink.drain()

    def check_invariants(self) -> None:
        assert all(not task.done() for task in self._connections), \
            "a finished connection is still listed"
