"""The cluster secret's uses: a registry entry bound to it (every field covered, any change
or another cluster's key detected), keys per purpose, and worker ids that can never name
another process of the cluster."""

from __future__ import annotations

import msgspec
import pytest

from protocol.cluster_secret import ENTRY_FIELDS, KeyPurpose, bind_entry, derive_key, entry_is_bound
from protocol.messages import (RESERVED_WORKER_IDS, ProtocolError, Role, WorkerInfo, decode, encode,
                               is_worker_id)

KEY = derive_key("cluster-token", KeyPurpose.REGISTRY)
INFO = WorkerInfo(worker_id="decode-0-ab12", role=Role.DECODE, model="default",
                  control_url="http://127.0.0.1:41000", kv_address="tcp://127.0.0.1:41001",
                  num_kv_blocks=512, block_size=16, epoch=7, pid=4242, started_unix_ms=1)

# A value other than INFO's for every field, as a forger would write it.
CHANGED = {"worker_id": "decode-9", "epoch": 8, "role": Role.PREFILL, "model": "other",
           "control_url": "http://127.0.0.1:1", "kv_address": "tcp://127.0.0.1:2",
           "device": "cuda:0", "num_kv_blocks": 4096, "block_size": 32,
           "max_num_batched_tokens": 1, "started_unix_ms": 2, "pid": 1,
           "kv_bytes_per_token": 3, "sm_share_percent": 50, "draining": True,
           "kv_dtype": "fp8_e4m3"}


def test_every_field_but_the_binding_is_bound() -> None:
    fields = set(WorkerInfo.__struct_fields__)
    assert set(ENTRY_FIELDS) == fields - {"binding"}, "a WorkerInfo field the binding misses"
    assert set(CHANGED) == set(ENTRY_FIELDS)


def test_a_bound_entry_verifies_and_survives_the_wire() -> None:
    bound = bind_entry(INFO, KEY)
    assert bound.binding and entry_is_bound(bound, KEY)
    assert entry_is_bound(decode(encode(bound), WorkerInfo), KEY)
    assert not entry_is_bound(INFO, KEY), "an unbound entry passed"


@pytest.mark.parametrize("field", ENTRY_FIELDS)
def test_changing_any_field_breaks_the_binding(field: str) -> None:
    bound = bind_entry(INFO, KEY)
    forged = msgspec.structs.replace(bound, **{field: CHANGED[field]})
    assert not entry_is_bound(forged, KEY), field


def test_another_clusters_key_or_purpose_does_not_verify() -> None:
    bound = bind_entry(INFO, KEY)
    assert not entry_is_bound(bound, derive_key("another-token", KeyPurpose.REGISTRY))
    assert not entry_is_bound(bound, derive_key("cluster-token", KeyPurpose.CHANNEL))
    assert derive_key("cluster-token", KeyPurpose.REGISTRY) != \
        derive_key("cluster-token", KeyPurpose.CHANNEL)


def test_without_a_key_nothing_is_bound_nor_checked() -> None:
    assert bind_entry(INFO, None) is INFO and entry_is_bound(INFO, None)


def test_the_names_of_the_other_processes_are_never_worker_ids() -> None:
    for name in RESERVED_WORKER_IDS:
        for spelling in (name, name.upper(), name.capitalize()):
            assert not is_worker_id(spelling), spelling
            with pytest.raises(ProtocolError):
                decode(encode(msgspec.structs.replace(INFO, worker_id=spelling)), WorkerInfo)
    for worker_id in ("decode-0-ab12", "gateway-worker", "agent.7", "redis2", "prefill-0"):
        assert is_worker_id(worker_id), worker_id
    assert not is_worker_id("a b") and not is_worker_id("") and not is_worker_id("x" * 129)
