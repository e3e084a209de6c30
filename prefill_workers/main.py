"""Wiring of one prefill worker process: options -> KV sender factory -> PrefillWorker.

Runs (per process): a control HTTP server (common/contract/control_server.py), one engine
thread, one KV sender (UCX or TCP links to decode workers, opened on first use), and the
registry publisher. See prefill_workers/worker.py for the request lifecycle.
"""

from __future__ import annotations

from common.worker.options import WorkerOptions
from common.worker.runtime import WorkerRuntime
from engine.kv_storage import KVStorage
from kv_transfer.interface import KVSender
from prefill_workers.worker import PrefillWorker


def build_role(options: WorkerOptions, runtime: WorkerRuntime) -> PrefillWorker:
    def make_sender(storage: KVStorage) -> KVSender:
        from kv_transfer.backend import make_sender as make
        return make(storage, options.kv_transport, host=options.host,
                    token=options.internal_token or "",
                    ucx_shared_memory=options.kv_shared_memory)

    return PrefillWorker(runtime.metrics, make_sender,
                         transfer_layer_delay_s=options.fault_transfer_delay_ms / 1000,
                         fault_request_prefix=options.fault_request_prefix)
