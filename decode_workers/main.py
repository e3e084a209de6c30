"""Wiring of one decode worker process: options -> KV receiver factory -> DecodeWorker.

Runs (per process): a control HTTP server, one engine thread, one KV receiver (a TCP
control server on the worker's host, port 0, plus the UCX or TCP data plane), and the
registry publisher. See decode_workers/worker.py for the request lifecycle.
"""

from __future__ import annotations

from common.contract.protocol import Role
from common.worker.options import WorkerOptions
from common.worker.runtime import WorkerRuntime
from decode_workers.worker import DecodeWorker
from engine.kv_storage import KVStorage
from kv_transfer.interface import KVReceiver


def build_role(options: WorkerOptions, runtime: WorkerRuntime) -> DecodeWorker:
    async def make_receiver(storage: KVStorage) -> KVReceiver:
        from kv_transfer.backend import make_receiver as make
        return await make(storage, options.kv_transport, host=options.host,
                          token=options.internal_token or "",
                          ucx_shared_memory=options.kv_shared_memory)

    return DecodeWorker(options.worker_id, runtime.metrics, make_receiver,
                        epoch=lambda: runtime.epoch, colocated=options.role is Role.COLOCATED)
