"""Which registry entries the gateway and the agent trust: those bound by the cluster's secret.

A worker binds its entry with the registry key (protocol/cluster_secret.py); whoever reads
the registry (state/redis_state.py's `read_registry`, for the gateway and the agent) keeps
an entry only when it decodes, is stored under the id it names, and its binding verifies.
Anything else was not written by one of the cluster's workers: a process that can reach
Redis but does not hold the token, an old version, a corrupted value. It is left out and
logged once (per id and content, so a forger renewing the same entry every half second
logs one line), never raised: one bad entry must not stop the reader's poll.

Without a key (a cluster without a token) every entry that decodes is taken as it is.

Invariant: `reported` holds at most MAX_REPORTED entries.
"""

from __future__ import annotations

import hashlib
import logging

from protocol.cluster_secret import entry_is_bound
from protocol.messages import MessageDecoder, ProtocolError, WorkerInfo

log = logging.getLogger(__name__)

MAX_REPORTED = 1024  # distinct unbound entries remembered, so each is logged once


class EntryCheck:
    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self.reported: set[tuple[str, bytes]] = set()
        self._decoder: MessageDecoder[WorkerInfo] = MessageDecoder(WorkerInfo)

    def trusted(self, worker_id: str, blob: bytes) -> WorkerInfo | None:
        """The entry stored under `worker_id` when it can be trusted, else None."""
        try:
            info = self._decoder.decode(blob)
        except ProtocolError as exc:
            self.report(worker_id, blob, f"it does not decode ({exc})")
            return None
        if info.worker_id != worker_id:
            self.report(worker_id, blob, f"it names another worker ({info.worker_id!r})")
            return None
        if not entry_is_bound(info, self.key):
            self.report(worker_id, blob, "its binding does not verify with the cluster's "
                                         "secret (none of its workers wrote it)")
            return None
        return info

    def report(self, worker_id: str, blob: bytes, why: str) -> None:
        """Log that the entry is ignored, once per (id, content)."""
        seen = (worker_id, hashlib.blake2b(blob, digest_size=16).digest())
        if seen in self.reported:
            return
        if len(self.reported) >= MAX_REPORTED:
            self.reported.clear()
        self.reported.add(seen)
        log.warning("ignoring the registry entry %r: %s", worker_id[:200], why)

    def check_invariants(self) -> None:
        assert len(self.reported) <= MAX_REPORTED, "more unbound entries remembered than the cap"
