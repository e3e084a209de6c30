"""The UCX receive carrier on a real ucxx worker: a post that UCX refuses part-way leaves
every receive posted before it tracked, so the transfer's flush completes them (none may
stay posted into blocks the receiver is about to release)."""

import asyncio

import pytest
import torch

from engine.kv_storage import KVLayout, KVStorage
from kv_transfer.inbound import InboundTransfer
from kv_transfer.interface import TransferSpec
from kv_transfer.layout import TransferPlan
from kv_transfer.staging import StagingPool

ucx = pytest.importorskip("kv_transfer.ucx")

LAYOUT = KVLayout(dtype="bfloat16", num_layers=2, num_blocks=16, block_size=4,
                  num_kv_heads=2, head_dim=8)


def test_a_post_refused_part_way_leaves_the_posted_receives_to_the_flush(monkeypatch) -> None:
    async def main() -> None:
        worker = ucx.UcxWorker(flush_timeout_s=2.0)
        storage = KVStorage(LAYOUT)
        carrier = ucx.UcxReceiveCarrier(worker, storage.kv,
                                    StagingPool("cpu", slot_bytes=1 << 16, num_slots=2))
        # Blocks 3 and 9 are two runs: 2 layers x K|V x 2 runs = 8 messages.
        spec = TransferSpec(request_id="a", src_block_ids=[1, 2], dst_block_ids=[3, 9],
                            layer_begin=0, layer_end=2)
        transfer = InboundTransfer("a", [3, 9], range(2), lambda ids: None,
                                   asyncio.get_running_loop().time() + 10)
        transfer.accept(TransferPlan(LAYOUT, spec), 1, object())
        assert transfer.num_messages == 8

        made = []
        real_array = ucx.Array

        def refusing_array(view):  # the third receive's buffer is refused
            made.append(view)
            if len(made) == 3:
                raise RuntimeError("UCX refused a receive")
            return real_array(view)
        monkeypatch.setattr(ucx, "Array", refusing_array)
        with pytest.raises(RuntimeError, match="refused"):
            carrier.post(transfer, lambda t: None, lambda t, exc: None)
        assert carrier.num_posted == 2  # the two posted before the refusal are tracked
        carrier.check_invariants()

        await carrier.flush(transfer)  # zero-byte self-sends complete them
        assert carrier.num_posted == 0
        carrier.check_invariants()
        assert not torch.count_nonzero(storage.kv.view(torch.int16))  # nothing landed
        await carrier.close()

    asyncio.run(main())
