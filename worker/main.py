"""Wiring of one worker process: options -> KV sender and receiver factories -> AnyRoleWorker.

Every worker process (`pdserve prefill-worker`, `pdserve decode-worker --role R`) runs the
same thing: a control HTTP server, one engine thread, a KV receiver (a TCP control server
on the worker's host, port 0, plus the UCX or TCP carrier; opened when the role takes
reservations), a KV sender (links opened on first use; created when the role prefills for
others) and the registry publisher. Sender and receiver share the process's one UCX
worker (ucxx runs one per event loop), created by whichever comes first. Its role only
decides which work it takes, and can change at run time (worker/role_gate.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.kv_storage import KVStorage
from kv_transfer.interface import KVReceiver, KVSender
from worker.decode_half import DecodeWorker
from worker.options import WorkerOptions
from worker.prefill_half import PrefillWorker
from worker.role_gate import AnyRoleWorker
from worker.runtime import WorkerRuntime

if TYPE_CHECKING:  # ucxx is optional: imported only where UCX is chosen
    from kv_transfer.ucx import UcxWorker


class SharedUcxWorker:
    """The process's one UCX worker: made on the event loop on first use (by the sender or
    the receiver, whichever comes first); None when the KV transport is not UCX."""

    def __init__(self, options: WorkerOptions) -> None:
        self._options = options
        self._worker: UcxWorker | None = None

    def get(self) -> UcxWorker | None:
        from kv_transfer.backend import make_ucx_worker
        from kv_transfer.transport_choice import resolve_backend
        if resolve_backend(self._options.kv_transport) != "ucx":
            return None
        if self._worker is None:
            self._worker = make_ucx_worker(self._options.host,
                                           ucx_shared_memory=self._options.kv_shared_memory)
        return self._worker


def build_role(options: WorkerOptions, runtime: WorkerRuntime) -> AnyRoleWorker:
    ucx_worker = SharedUcxWorker(options).get

    def make_sender(storage: KVStorage) -> KVSender:
        from kv_transfer.backend import make_sender as make
        return make(storage, options.kv_transport, host=options.host,
                    token=options.internal_token or "", ucx_worker=ucx_worker(),
                    ucx_shared_memory=options.kv_shared_memory, mapping=options.kv_mapping)

    async def make_receiver(storage: KVStorage) -> KVReceiver:
        from kv_transfer.backend import make_receiver as make
        return await make(storage, options.kv_transport, host=options.host,
                          token=options.internal_token or "", ucx_worker=ucx_worker(),
                          ucx_shared_memory=options.kv_shared_memory,
                          mapping=options.kv_mapping)

    prefill = PrefillWorker(runtime.metrics, make_sender, runtime.faults)
    decode = DecodeWorker(options.worker_id, runtime.metrics, make_receiver,
                          epoch=lambda: runtime.epoch,
                          own_epoch=lambda e: e in runtime.own_epochs)
    from kv_transfer.transport_choice import resolve_backend
    gate = AnyRoleWorker(options.role, prefill, decode, runtime.metrics, runtime.change_role,
                         epoch=lambda: runtime.epoch, tracing=runtime.tracing,
                         kv_backend=resolve_backend(options.kv_transport))
    gate.add_routes(runtime.app)
    return gate
