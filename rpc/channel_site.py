"""One port for a worker's channels and its HTTP (rpc/channel_server.py has the channel's
end, rpc/control_server.py the server that runs it).

    connection ──▶ PortSniffer: first bytes MAGIC? ──yes──▶ ServerChannel
                                                   └─no──▶ aiohttp (probes and /admin)

`ChannelSite` is the aiohttp site that listens: it hands each connection to a sniffer, and
each channel the cluster's channel key and the endpoint (host:port) it serves, which its
greeting proves (rpc/channel_wire.py).

Lifecycle: start() binds (port 0: the OS picks) → connections → close_channels() closes
every channel and waits, bounded, for their streams' producers to close.
Invariant: `channels` holds exactly the channels whose connection is open.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

from aiohttp import web

from protocol.cluster_secret import KeyPurpose, derive_optional_key
from rpc.channel_server import ServerChannel
from rpc.channel_wire import MAGIC, endpoint
from rpc.control_app import ChannelRoutes, ControlLimits


class PortSniffer(asyncio.Protocol):
    """Tells a channel from an HTTP connection by its first bytes, then hands it over."""

    def __init__(self, http: Callable[[], asyncio.Protocol],
                 channel: Callable[[], asyncio.Protocol], first_bytes_timeout_s: float) -> None:
        self._http = http
        self._channel = channel
        self._timeout_s = first_bytes_timeout_s
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an asyncio.Transport subclass).
        self._transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s,
                                                            self._transport.abort)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data
        if len(buffer) < len(MAGIC) and MAGIC.startswith(buffer):
            self._buffer = buffer  # "P" may still be "POST"
            return
        assert self._transport is not None
        if self._timer is not None:
            self._timer.cancel()
        protocol = self._channel() if buffer.startswith(MAGIC) else self._http()
        self._transport.set_protocol(protocol)
        protocol.connection_made(self._transport)
        protocol.data_received(buffer)

    def eof_received(self) -> bool:
        return False  # closes the transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()


class ChannelSite(web.BaseSite):
    """A TCP site serving the runner's HTTP app and channels on one port."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, routes: ChannelRoutes,
                 limits: ControlLimits, token: str | None) -> None:
        super().__init__(runner)
        self._host, self._port = host, port
        self._routes, self._limits = routes, limits
        self._key = derive_optional_key(token, KeyPurpose.CHANNEL)
        self.channels: set[ServerChannel] = set()
        self.bound_port: int | None = None
        # The port callers dial, when it is not the bound one (a fault proxy in front,
        # rpc/fault_proxy.py): the endpoint each channel's greeting proves.
        self.advertised_port: int | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        http = self._runner.server
        assert http is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: PortSniffer(http, self._new_channel, self._limits.body_timeout_s),
            self._host, self._port)
        self.bound_port = self._server.sockets[0].getsockname()[1]

    def _new_channel(self) -> ServerChannel:
        assert self.bound_port is not None
        port = self.advertised_port or self.bound_port
        channel = ServerChannel(self._routes, self._limits, self._key,
                                endpoint(self._host, port), self.channels.discard)
        self.channels.add(channel)
        return channel

    async def close_channels(self, timeout_s: float) -> None:
        """Close every channel and wait (bounded) for its streams' producers to close."""
        tasks = [task for channel in self.channels for task in channel.tasks.values()]
        for channel in list(self.channels):
            channel.close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
