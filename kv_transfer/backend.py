"""Choosing a carrier: `make_receiver` / `make_sender` for "ucx", "tcp" or "auto".

"auto" takes UCX when `ucxx` imports and says in the log when it falls back to TCP. The
carrier carries the bytes only where the peers cannot map each other's pools: with
`mapping` on (the default) a sender on the receiver's host copies straight into the
receiver's pool (pool_mapping.py, mapped_copy.py) and the carrier stays idle. The
UCX objects of one process share one `UcxWorker` (pass it to both if a process sends and
receives); ucxx progresses one worker per event loop.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from typing import TYPE_CHECKING

from engine.kv_storage import KVStorage
from kv_transfer.outbound import SendCarrier
from kv_transfer.packing import PackingLimits
from kv_transfer.receiver import ReceiveCarrier, TransferReceiver
from kv_transfer.sender import TransferSender
from kv_transfer.staging import StagingPool
from kv_transfer.transport_choice import resolve_backend

if TYPE_CHECKING:  # ucxx is optional: imported only where UCX is chosen
    from kv_transfer.ucx import UcxWorker

log = logging.getLogger(__name__)


def interface_of(host: str) -> str | None:
    """The network interface a worker bound to `host` may let UCX use: "lo" for loopback,
    the interface holding `host`'s address otherwise; None (every one) for a wildcard or
    an address no local interface holds."""
    if host in ("", "0.0.0.0", "::"):
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    if all(ipaddress.ip_address(a).is_loopback for a in addresses):
        return "lo"
    for _, name in socket.if_nameindex():
        if addresses & _interface_addresses(name):
            return name
    return None


def _interface_addresses(name: str) -> set[str]:
    """IPv4 address of one interface (Linux ioctl; empty elsewhere or without one)."""
    try:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        return {socket.inet_ntoa(packed[20:24])}
    except (OSError, ImportError):
        return set()


async def make_receiver(storage: KVStorage, backend: str = "auto", *, host: str = "127.0.0.1",
                        port: int = 0, token: str = "", ucx_worker: UcxWorker | None = None,
                        abort_timeout_s: float = 1.0, ucx_shared_memory: bool = False,
                        mapping: bool = True) -> TransferReceiver:
    """A started receiver; its `address` is what senders connect to.

    `ucx_shared_memory` (when `ucx_worker` is not given) selects UCX's shared-memory and
    cuda_ipc transports, which need UCX endpoint error handling off: faster on one host, but
    a sender killed in the middle of a copy can make UCX abort *this* process. Off by
    default: a dying prefill worker must never take a decode worker with it.
    `mapping`: offer senders on this host to map the pool (the Welcome's export).
    """
    name = resolve_backend(backend)
    limits = PackingLimits.for_device(storage.kv.is_cuda)
    staging = StagingPool(storage.kv.device, slot_bytes=limits.slot_bytes,
                          num_slots=limits.num_slots)
    carrier: ReceiveCarrier
    if name == "ucx":
        from kv_transfer.ucx import UcxReceiveCarrier, UcxWorker
        worker = ucx_worker or UcxWorker(error_handling=not ucx_shared_memory,
                                         net_devices=interface_of(host))
        carrier = UcxReceiveCarrier(worker, storage.kv, staging)
    else:
        from kv_transfer.tcp import TcpReceiveCarrier
        carrier = TcpReceiveCarrier(storage.kv, staging)
    receiver = TransferReceiver(storage, carrier, host=host, port=port, token=token,
                                abort_timeout_s=abort_timeout_s, export=mapping)
    await receiver.start()
    return receiver


def make_ucx_worker(host: str, *, ucx_shared_memory: bool = False) -> UcxWorker:
    """The one UCX worker of a process that sends and receives (call on its event loop):
    pass it to both `make_sender` and `make_receiver`; it closes with the last carrier."""
    from kv_transfer.ucx import UcxWorker
    return UcxWorker(error_handling=not ucx_shared_memory, net_devices=interface_of(host))


def make_sender(storage: KVStorage, backend: str = "auto", *, host: str = "127.0.0.1",
                token: str = "",
                ucx_worker: UcxWorker | None = None, abort_timeout_s: float = 1.0,
                ucx_shared_memory: bool = False,
                limits: PackingLimits | None = None, mapping: bool = True) -> TransferSender:
    """A sender; `ucx_shared_memory` as for `make_receiver` (both peers must agree).

    `limits`: staging budget and when to pack (packing.py); default per device.
    `mapping`: map a receiver's pool when it offers it and it can be mapped here."""
    name = resolve_backend(backend)
    carrier: SendCarrier
    if name == "ucx":
        from kv_transfer.ucx import UcxSendCarrier, UcxWorker
        carrier = UcxSendCarrier(ucx_worker or UcxWorker(error_handling=not ucx_shared_memory,
                                                     net_devices=interface_of(host)))
    else:
        from kv_transfer.tcp import TcpSendCarrier
        carrier = TcpSendCarrier()
    return TransferSender(storage, carrier, token=token, abort_timeout_s=abort_timeout_s,
                          limits=limits, map_pools=mapping)
